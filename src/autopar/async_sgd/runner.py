"""Train any model on the parameter server from plain callables (no Trainer): the entry point for
benchmarks (`autopar reproduce dpsgd`) and the tests that need to steer the workers.

    result = train_with_parameter_server(model, loss_fn, batch_fn, steps=50, lr=0.1, staleness=2,
                                         servers=1, link_model=LinkModel(latency_s=0.002))

Every rank of the default process group calls it; the last `servers` ranks serve, the
others work. Worker i at step t trains on `batch_fn(t, i, workers)` with the loss
`loss_fn(module, batch)` (a mean over that batch) scaled by 1/workers, so one step of
every worker adds up to one SGD step on the mean over their batches.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..data_parallel.links import LinkModel, Links
from .layout import FlatLayout
from .roles import Roles
from .server import ParameterServer, PullRecord, PushRecord
from .worker import ServerClient


@dataclass
class AsyncRunResult:
    """The same on every rank."""

    losses: list[float]  # per step: mean over workers of their batch loss (each at the parameters it pulled)
    step_end_s: list[float]  # per step: seconds from the common start until the last worker finished it
    wall_s: float  # until every worker held the final parameters
    params: torch.Tensor  # final flat parameters
    pushes: list[PushRecord] = field(default_factory=list)  # every shard's log
    pulls: list[PullRecord] = field(default_factory=list)
    bytes_sent: int = 0  # over all ranks (the link layer's counters)
    messages_sent: int = 0
    worker_losses: list[list[float]] = field(default_factory=list)  # [worker][step]

    def staleness_per_push(self) -> list[int]:
        """One value per (worker, step): the largest over shards."""
        return list(push_staleness(self.pushes).values())

    def staleness_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.staleness_per_push()).items()))


def push_staleness(pushes: list[PushRecord]) -> dict[tuple[int, int], int]:
    """(worker, step) -> staleness, the largest over shards."""
    out: dict[tuple[int, int], int] = {}
    for p in pushes:
        key = (p.worker, p.clock)
        out[key] = max(out.get(key, 0), p.staleness)
    return out


def train_with_parameter_server(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                                batch_fn: Callable[[int, int, int], Any], *, steps: int,
                                lr: float | Callable[[int], float], staleness: int = 0, servers: int = 1,
                                link_model: LinkModel | None = None, weight_decay: float = 0.0,
                                round_robin: bool = False, before_push: Callable[[int, int], None] | None = None,
                                timeout_s: float = 60.0) -> AsyncRunResult:
    """Collective over the default group. `model` must be on the CPU; rank 0's weights are the start point.

    round_robin: servers apply pushes in worker order (deterministic; equals delayed.DelayedSGD).
    before_push(step, worker): called on the worker before each push (tests use it to inject delays).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    roles = Roles.check(world, servers, staleness)
    workers = roles.num_workers
    lr_at = lr if callable(lr) else (lambda step, value=float(lr): value)
    layout = FlatLayout(model, roles.servers)
    initial = layout.gather_params()
    dist.broadcast(initial, src=0)
    layout.load_params(initial)
    links = Links(link_model or LinkModel(), timeout_s=timeout_s)
    records: list[tuple[float, float]] = []  # (loss, seconds since start) per step
    server = None
    dist.barrier()
    start = time.perf_counter()
    try:
        if roles.is_server(rank):
            server = ParameterServer(layout, roles.shard_of(rank), workers=roles.worker_ranks, staleness=staleness,
                                     links=links, weight_decay=weight_decay, round_robin=round_robin, initial=initial)
            server.serve()
        else:
            client = ServerClient(layout, roles.server_ranks, links, rank=rank)
            model.train()
            for step in range(steps):
                loss = loss_fn(model, batch_fn(step, rank, workers))
                (loss * (1.0 / workers)).backward()
                if before_push is not None:
                    before_push(step, rank)
                client.push_pull(step, lr_at(step), final=step == steps - 1)
                model.zero_grad(set_to_none=True)
                records.append((float(loss.detach()), time.perf_counter() - start))
        finished = time.perf_counter() - start
    finally:
        links.close()
    final = layout.gather_params()
    dist.broadcast(final, src=0)  # worker 0 holds the parameters after every update
    layout.load_params(final)
    mine = {"records": records, "finished": finished, "bytes": links.bytes_sent, "messages": links.messages_sent,
            "pushes": server.pushes if server else [], "pulls": server.pulls if server else []}
    everyone: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    worker_logs = [everyone[r]["records"] for r in roles.worker_ranks]
    return AsyncRunResult(
        losses=[sum(log[s][0] for log in worker_logs) / workers for s in range(steps)],
        step_end_s=[max(log[s][1] for log in worker_logs) for s in range(steps)],
        wall_s=max(everyone[r]["finished"] for r in roles.worker_ranks), params=final,
        pushes=[p for e in everyone for p in e["pushes"]], pulls=[p for e in everyone for p in e["pulls"]],
        bytes_sent=sum(e["bytes"] for e in everyone), messages_sent=sum(e["messages"] for e in everyone),
        worker_losses=[[loss for loss, _ in log] for log in worker_logs])
