"""Train any model with gossip (or, as the baseline, all-reduce) from plain callables, no Trainer:
the entry point for `autopar reproduce dpsgd`, shaped like async_sgd's train_with_parameter_server.

    result = train_with_gossip(model, loss_fn, batch_fn, steps=50, lr=0.1, topology="ring",
                               link_model=LinkModel(latency_s=0.005), group=group)

Every rank of `group` calls it (ranks outside it must not). Replica i at step t trains on
`batch_fn(t, i, n)` with `loss_fn(module, batch)` (a mean over that batch); each replica
applies plain SGD with its own batch's gradient, and the mixing is the GossipMixer's, as in
GossipEngine. The only traffic during training is the gossip exchange (no per-step
collective), so replicas are coupled only through their neighbours, as in D-PSGD.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..data_parallel.links import LinkModel, Links
from .engine import FlatParameters
from .mixer import GossipMixer
from .topology import build_topology


@dataclass
class RunResult:
    """The same on every rank of the group."""

    losses: list[float]       # per step: mean over replicas of their batch loss (each at its own model)
    step_end_s: list[float]   # per step: seconds from the common start until the last replica finished it
    wall_s: float
    params: torch.Tensor      # final parameters (gossip: the replicas' average), flat
    bytes_sent: int           # over all ranks
    messages_sent: int
    comm_wait_s: float        # mean over ranks of time blocked on communication
    extra: dict


def _collect(records: list[tuple[float, float]], links: Links, waited: float, params: torch.Tensor, group,
             extra: dict) -> RunResult:
    n = dist.get_world_size(group)
    everyone: list[dict] = [None] * n  # type: ignore[list-item]
    dist.all_gather_object(everyone, {"records": records, "bytes": links.bytes_sent,
                                      "messages": links.messages_sent, "waited": waited}, group=group)
    steps = len(records)
    return RunResult(losses=[sum(e["records"][s][0] for e in everyone) / n for s in range(steps)],
                     step_end_s=[max(e["records"][s][1] for e in everyone) for s in range(steps)],
                     wall_s=max(e["records"][-1][1] for e in everyone) if steps else 0.0, params=params,
                     bytes_sent=sum(e["bytes"] for e in everyone), messages_sent=sum(e["messages"] for e in everyone),
                     comm_wait_s=sum(e["waited"] for e in everyone) / n, extra=extra)


def _broadcast_start(flat: FlatParameters, group) -> None:
    src = dist.get_global_rank(group, 0)
    flats = flat.gather()
    for f in flats:
        dist.broadcast(f, src=src, group=group)
    flat.scatter(flats)


def train_with_gossip(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                      batch_fn: Callable[[int, int, int], Any], *, steps: int, lr: float, topology: str = "ring",
                      order: str = "dpsgd", link_model: LinkModel | None = None, group=None,
                      timeout_s: float = 60.0) -> RunResult:
    """D-PSGD (order dpsgd: exchange overlapped with forward/backward) or ATC, with plain SGD."""
    group = group if group is not None else dist.group.WORLD
    n, replica = dist.get_world_size(group), dist.get_rank(group)
    graph = build_topology(topology, n)
    links = Links(link_model or LinkModel(), group=group, timeout_s=timeout_s)
    mixer = GossipMixer(graph, links, replica, [dist.get_global_rank(group, i) for i in range(n)])
    flat = FlatParameters(p for p in model.parameters() if p.requires_grad)
    _broadcast_start(flat, group)
    records: list[tuple[float, float]] = []
    dist.barrier(group=group)
    start = time.perf_counter()
    try:
        model.train()
        for step in range(steps):
            flats = flat.gather()
            if order == "dpsgd":
                mixer.start(flats)  # neighbours' models travel while this replica computes
            loss = loss_fn(model, batch_fn(step, replica, n))
            loss.backward()
            if order == "dpsgd":
                mixer.finish(flats)
            else:  # atc: update, then combine (no overlap possible)
                flats = [f - lr * torch.cat([p.grad.reshape(-1) for p in group_])
                         for f, group_ in zip(flats, flat.groups)]
                mixer.mix(flats)
            with torch.no_grad():
                flat.scatter(flats)
                if order == "dpsgd":
                    for p in flat.params:
                        p.add_(p.grad, alpha=-lr)
            model.zero_grad(set_to_none=True)
            records.append((float(loss.detach()), time.perf_counter() - start))
        mixer.close()
    finally:
        links.close()
    average = torch.cat([f.reshape(-1) for f in flat.gather()])
    dist.all_reduce(average, group=group)
    average /= n
    spread = torch.cat([f.reshape(-1) for f in flat.gather()]) - average
    squares = spread.double().square().sum()
    dist.all_reduce(squares, group=group)
    return _collect(records, links, mixer.wait_s, average, group,
                    {"topology": graph.name, "rho": graph.rho, "order": order,
                     "final_consensus_distance": float(squares.sqrt())})


def train_with_allreduce(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                         batch_fn: Callable[[int, int, int], Any], *, steps: int, lr: float,
                         link_model: LinkModel | None = None, group=None, timeout_s: float = 60.0) -> RunResult:
    """The synchronous baseline: gradients averaged by one (ring-modelled) all-reduce after backward, SGD."""
    group = group if group is not None else dist.group.WORLD
    n, replica = dist.get_world_size(group), dist.get_rank(group)
    links = Links(link_model or LinkModel(), group=group, timeout_s=timeout_s)
    flat = FlatParameters(p for p in model.parameters() if p.requires_grad)
    _broadcast_start(flat, group)
    records: list[tuple[float, float]] = []
    waited = 0.0
    dist.barrier(group=group)
    start = time.perf_counter()
    try:
        model.train()
        for step in range(steps):
            loss = loss_fn(model, batch_fn(step, replica, n))
            loss.backward()
            for params in flat.groups:
                grad = torch.cat([p.grad.reshape(-1) for p in params])
                began = time.perf_counter()
                links.all_reduce(grad, group=group)
                waited += time.perf_counter() - began
                offset = 0
                with torch.no_grad():
                    for p in params:
                        p.add_(grad[offset:offset + p.numel()].view_as(p), alpha=-lr / n)
                        offset += p.numel()
            model.zero_grad(set_to_none=True)
            records.append((float(loss.detach()), time.perf_counter() - start))
    finally:
        links.close()
    return _collect(records, links, waited, torch.cat([f.reshape(-1) for f in flat.gather()]), group, {})
