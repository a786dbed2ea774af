"""The Trainer's engine for `--dp-mode async`: a worker (whole model, gradients pushed to the servers)
or a server (a shard and its serve loop), chosen by rank.

Kept apart from train/engine.py's DataParallelEngine because nothing here may use a
collective during training: workers run ahead of each other by up to `staleness` steps.
The trainer loop for this mode is loop.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..config import Strategy, TrainConfig
from ..data_parallel.links import LinkModel, Links
from ..distributed import group_options
from ..errors import ConfigError
from ..mesh import ProcessMesh
from ..models.materialize import materialize
from ..train.engine import accumulate_gradients, whole_model_eval_sums
from ..train.base import EngineBase
from ..train.loss import Batch
from .layout import FlatLayout
from .roles import Roles
from .server import ParameterServer
from .worker import PullResult, ServerClient


def check_async_setup(strategy: Strategy, config: TrainConfig, world: int) -> tuple[TrainConfig, int]:
    """The batch split of an async run: returns the config with micro-batches resolved over the WORKERS
    (not the world) and the micro-batches per worker per step. What the parameter server combines with is
    the rule table's (config/rules.py), checked before this."""
    roles = Roles.check(world, strategy.replicas.servers, strategy.replicas.staleness)
    try:
        return config.with_micro_batches(roles.num_workers), config.accumulation_steps(roles.num_workers)
    except ConfigError as exc:
        raise ConfigError(f"dp_mode=async splits each global batch over the {roles.num_workers} worker(s) "
                          f"(processes minus --servers {roles.servers}), so 'dp' below means workers: {exc}") from None


class AsyncEngine(EngineBase):
    """This rank's part of a parameter-server run (see async_sgd/__init__.py for the design).

    Each of the W pushes of a step is one SGD update with that worker's share of the gradient;
    weight decay is split the same way (weight_decay / W per push), so that a step of all W
    workers decays the weights once, as a synchronous step does.
    """

    def __init__(self, model: nn.Module, mesh: ProcessMesh, *, device: torch.device, seed: int,
                 forward_fn: Callable, autocast: Callable, timeout_s: float, weight_decay: float,
                 servers: int, staleness: int, link_model: LinkModel | None = None):
        self.module = materialize(model, device, seed=seed)
        self.forward_fn, self.autocast = forward_fn, autocast
        self.rank = dist.get_rank()
        self.roles = Roles.check(dist.get_world_size(), servers, staleness)
        self.staleness = staleness
        self.layout = FlatLayout(self.module, self.roles.servers)
        initial = self.layout.gather_params()
        dist.broadcast(initial, src=0)  # every rank starts from rank 0's weights
        self.layout.load_params(initial)
        # parameters travel as CPU tensors over gloo, which can receive from any source (NCCL cannot)
        group = None
        if device.type != "cpu":
            group = dist.new_group(backend="gloo", pg_options=group_options("gloo", timeout_s))
        self.links = Links(link_model or LinkModel(), group, timeout_s=timeout_s)
        self.is_server = self.roles.is_server(self.rank)
        self.server: ParameterServer | None = None
        self.client: ServerClient | None = None
        if self.is_server:
            self.server = ParameterServer(self.layout, self.roles.shard_of(self.rank), workers=self.roles.worker_ranks,
                                          staleness=staleness, links=self.links,
                                          weight_decay=weight_decay / self.roles.num_workers, initial=initial)
        else:
            self.client = ServerClient(self.layout, self.roles.server_ranks, self.links, rank=self.rank)

    @property
    def num_workers(self) -> int:
        return self.roles.num_workers

    @property
    def worker_index(self) -> int:
        return self.rank  # workers are ranks 0 .. W-1

    # ------------------------------------------------------------------ worker side

    def forward_backward(self, batches: list[Batch], loss_fn) -> torch.Tensor:
        total = accumulate_gradients(self.module, self.forward_fn, self.autocast, batches, loss_fn)
        return total

    def clip_gradients(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.layout.params, max_norm))

    def push_pull(self, step: int, lr: float, *, final: bool) -> PullResult:
        return self.client.push_pull(step, lr, final=final)

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ server side

    def serve(self) -> None:
        self.server.serve()

    # ------------------------------------------------------------------ every rank

    def share_final_parameters(self) -> None:
        """Collective: every rank (servers included) takes worker 0's final parameters, and its buffers (e.g.
        normalisation statistics, which each worker kept for itself), for eval and saving."""
        flat = self.layout.gather_params()
        dist.broadcast(flat, src=0)
        self.layout.load_params(flat)
        with torch.no_grad():
            for buffer in self.module.buffers():
                dist.broadcast(buffer, src=0)

    @torch.no_grad()
    def eval_sums(self, batches: list[Batch], eval_loss: Callable) -> torch.Tensor:
        return whole_model_eval_sums(self.module, self.forward_fn, self.autocast, batches, eval_loss)

    def close(self) -> None:
        self.links.close()

