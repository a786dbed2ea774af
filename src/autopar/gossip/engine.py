"""Decentralized data parallelism (D-PSGD): every replica keeps its own model and averages only
with its neighbours in a gossip graph, instead of an all-reduce of gradients.

Two update orders (`Strategy.gossip_order`), for replica i with local gradient g_i:
- `dpsgd` (Lian et al. 2017, "adapt with combine"): x_i <- sum_j W_ij x_j - lr * g_i(x_i).
  The gradient is taken at the LOCAL model, so the exchange of models is posted before
  forward and collected after backward: communication overlaps computation entirely;
- `atc` (adapt then combine, diffusion): x_i <- sum_j W_ij (x_j - lr * g_j(x_j)). The
  exchange needs the updated models, so it runs (blocking) after the optimizer step; it
  is done at the start of the next step (or before an evaluation / checkpoint averages).
  On a complete graph this is exactly all-reduce SGD; D-PSGD's order is not.

How it fits the trainer's step (forward_backward -> clip -> optimizer.step -> zero_grad):
the engine mixes the parameters inside `forward_backward` (dpsgd) and leaves the
gradient for the trainer's optimizer, so with `--optimizer sgd` the step is exactly the
rule above. Each replica's gradient is scaled by the number of replicas n: the trainer
scales losses so that the SUM over replicas is the global-batch mean (train/loss.py), so
n * g_i is replica i's own batch mean, and the mean of the g_i is the all-reduce gradient.
With another optimizer (Adam, AdamW, Adagrad) each replica keeps its own optimizer state
and applies its adaptive update to the mixed model: decentralized training with local
adaptive steps, a common heuristic that the D-PSGD analysis does not cover; weight decay
then acts on the mixed model. Gradient clipping clips each replica's own gradient.

Only parameters gossip (buffers such as norm statistics stay local). Evaluation uses
the replicas' average model (computed once per step, installed for the evaluation and
then the local models are put back); a checkpoint first sets every replica to the
average (an exact consensus step), so a resumed run continues from what was saved.
Data-parallel only: pipeline or tensor parallelism with gossip is rejected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import GOSSIP_ORDERS as ORDERS
from ..data_parallel.links import LinkModel, Links
from ..errors import ConfigError, choices
from ..mesh import ProcessMesh
from ..models.materialize import materialize
from ..train.engine import accumulate_gradients, broadcast_from_first_replica
from ..train.base import EngineBase
from ..train.loss import Batch
from .mixer import GossipMixer
from .topology import BUILTIN, Topology, build_topology

GOSSIP_ORDERS = ORDERS  # named once, in config.py


def check_gossip_strategy(strategy) -> Topology:
    """The gossip graph `--topology` names (a built-in, or a file that must fit dp); what gossip combines
    with is the rule table's (config/rules.py)."""
    if not isinstance(strategy.replicas.topology, str) or not strategy.replicas.topology:
        raise ConfigError(f"strategy.topology must be one of {choices(BUILTIN)} or a file path, "
                          f"got {strategy.replicas.topology!r}")
    return build_topology(strategy.replicas.topology, strategy.dp)


class FlatParameters:
    """The parameters as one flat buffer per dtype (gathered and scattered by copy)."""

    def __init__(self, params: Iterable[nn.Parameter]):
        unique: dict[int, nn.Parameter] = {}
        for p in params:
            unique.setdefault(id(p), p)
        groups: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in unique.values():
            groups.setdefault(p.dtype, []).append(p)
        self.groups = list(groups.values())
        self.params = [p for group in self.groups for p in group]

    def gather(self) -> list[torch.Tensor]:
        return [torch.cat([p.detach().reshape(-1) for p in group]) for group in self.groups]

    @torch.no_grad()
    def scatter(self, flats: list[torch.Tensor]) -> None:
        for group, flat in zip(self.groups, flats):
            offset = 0
            for p in group:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


@dataclass(frozen=True)
class GossipOptions:
    """The engine's own options: the mixing graph (Strategy.topology over dp replicas) and the update order."""

    topology: Topology
    order: str = "dpsgd"

    @classmethod
    def of(cls, strategy) -> GossipOptions:
        """From a resolved Strategy (dp known: a built-in graph is made for it, a file is checked against it)."""
        return cls(topology=check_gossip_strategy(strategy), order=strategy.replicas.gossip_order)


class GossipEngine(EngineBase):
    """The whole model on every replica, mixed with its gossip neighbours every step (module doc)."""

    def __init__(self, model: nn.Module, mesh: ProcessMesh, *, device: torch.device, seed: int,
                 forward_fn: Callable, autocast: Callable, options: GossipOptions, links: Links | None = None,
                 timeout_s: float = 300.0, verbose: bool = True):
        self.topology, self.order = options.topology, options.order
        self.module = materialize(model, device, seed=seed)
        self.mesh, self.forward_fn, self.autocast = mesh, forward_fn, autocast
        broadcast_from_first_replica(self.module, mesh)
        group = mesh.group("dp")
        self.replicas = dist.get_world_size(group)
        self.links = links or Links(LinkModel(), group=group, timeout_s=timeout_s)
        global_ranks = [dist.get_global_rank(group, i) for i in range(self.replicas)]
        self.mixer = GossipMixer(self.topology, self.links, mesh.dp_rank, global_ranks)
        # only trainable parameters are mixed: frozen ones are equal on every replica and never change
        self.flat = FlatParameters(p for p in self.module.parameters() if p.requires_grad)
        self.params = self.flat.params  # gradients stay local
        self.group = group
        self._combine_pending = False  # atc: the optimizer stepped, neighbours not yet combined
        self._version = 0
        self._average_cache: tuple[int, list[torch.Tensor]] | None = None
        self._step_wait = 0.0
        if verbose and dist.get_rank() == 0:
            print(f"{self.topology.summary()}; order {self.order}; mixing matrix:\n"
                  f"{_format_matrix(self.topology.weights)}", flush=True)

    # ------------------------------------------------------------------ a step

    def forward_backward(self, batches: list[Batch], loss_fn) -> torch.Tensor:
        waited_before = self.mixer.wait_s
        if self._combine_pending:
            self.combine()
        flats = None
        if self.order == "dpsgd":
            flats = self.flat.gather()
            self.mixer.start(flats)  # the exchange runs while this replica computes its gradient
        total = accumulate_gradients(self.module, self.forward_fn, self.autocast, batches, loss_fn)
        self.scale_gradients()
        if flats is not None:
            self.mixer.finish(flats)
            self.flat.scatter(flats)
        else:
            self._combine_pending = True
        self._version += 1
        self._step_wait = self.mixer.wait_s - waited_before
        return total

    def scale_gradients(self) -> None:
        """Replica i's loss share is its batch's part of the global mean: times n, its own batch mean."""
        if self.replicas > 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.replicas)

    def combine(self) -> None:
        """atc: mix the (already updated) models with the neighbours, blocking."""
        flats = self.flat.gather()
        self.mixer.mix(flats)
        self.flat.scatter(flats)
        self._combine_pending = False

    def clip_gradients(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def run_info(self) -> dict:
        return {"gossip": {**self.topology.describe(), "order": self.order}}

    def step_stats(self, elapsed: float, peak_bytes: int) -> dict:
        return {"gossip_wait_s": self._step_wait}

    # ------------------------------------------------------------------ the average model

    def _average(self) -> list[torch.Tensor]:
        """The replicas' mean parameters (one all-reduce, cached until the next step)."""
        if self._average_cache is None or self._average_cache[0] != self._version:
            flats = self.flat.gather()
            for flat in flats:
                self.links.all_reduce(flat, group=self.group)
                flat.div_(self.replicas)
            self._average_cache = (self._version, flats)
        return self._average_cache[1]

    def average_models(self) -> None:
        """Set every replica to the average (before a checkpoint): an exact consensus step."""
        self.flat.scatter(self._average())
        self._combine_pending = False  # combining equal models changes nothing

    def before_checkpoint(self) -> None:
        """Replicas differ: save (and continue from) their mean."""
        self.average_models()

    @torch.no_grad()
    def eval_sums(self, batches: list[Batch], eval_loss: Callable) -> torch.Tensor:
        """Evaluate the average model; the local models are put back afterwards."""
        average = self._average()
        local = self.flat.gather()
        self.flat.scatter(average)
        self.module.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=batches[0]["labels"].device)
        try:
            for batch in batches:
                with self.autocast():
                    sums += eval_loss(self.forward_fn(self.module, batch), batch)
        finally:
            self.flat.scatter(local)
            self.module.train()
        return sums

    def consensus_distance(self) -> float:
        """sqrt(sum_i ||x_i - mean||^2) over replicas (a collective: every replica must call it)."""
        average = self._average()
        squares = torch.zeros((), dtype=torch.float64)
        for local, mean in zip(self.flat.gather(), average):
            squares += (local.double() - mean.double()).square().sum().cpu()
        dist.all_reduce(squares, group=self.group)
        return float(squares.sqrt())

    def close(self) -> None:
        self.mixer.close()
        self.links.close()


def _format_matrix(w: torch.Tensor, limit: int = 16) -> str:
    rows = [" ".join(f"{float(v):.3f}" for v in row[:limit]) + (" ..." if w.shape[1] > limit else "")
            for row in w[:limit]]
    return "\n".join(rows) + ("\n..." if w.shape[0] > limit else "")
