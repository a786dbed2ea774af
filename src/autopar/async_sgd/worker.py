"""A worker's side of the parameter server: push the step's gradient, pull the next step's parameters.

Receives are posted before the sends, so a server answering at once never waits on a
worker that is still sending, and one worker talks to all servers in parallel. The
gradient and parameter buffers are flat fp32 CPU tensors (layout.py); the module's own
parameters are refreshed from the pulled vector after all shards have arrived.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import FlatLayout
from .protocol import PUSH_DATA_TAG, PUSH_HEADER_TAG, REPLY_DATA_TAG, REPLY_HEADER_TAG, Push, Reply


@dataclass(frozen=True)
class PullResult:
    """What the servers said with the parameters of the worker's next step."""

    staleness: int  # of the push just made (max over shards)
    versions: tuple[int, ...]  # per shard
    waited: bool  # some shard held the pull back (the staleness bound was binding)


class ServerClient:
    def __init__(self, layout: FlatLayout, server_ranks: list[int], links, *, rank: int):
        self.layout, self.server_ranks, self.links, self.rank = layout, list(server_ranks), links, rank
        self.flat_params = layout.gather_params().cpu()
        self.flat_grad = torch.zeros_like(self.flat_params)

    def push_pull(self, clock: int, lr: float, *, final: bool = False) -> PullResult:
        """Send step `clock`'s gradient (the module's .grad) to every server; load the parameters they serve
        next (for a final push: the parameters after every worker's last update)."""
        self.layout.gather_grads(self.flat_grad)
        replies = [Reply.empty() for _ in self.server_ranks]
        handles = []
        for shard, server in enumerate(self.server_ranks):
            lo, hi = self.layout.shard_range(shard)
            handles.append(self.links.irecv(replies[shard], server, REPLY_HEADER_TAG))
            handles.append(self.links.irecv(self.flat_params[lo:hi], server, REPLY_DATA_TAG))
        header = Push(worker=self.rank, clock=clock, lr=lr, final=final).encode()
        for shard, server in enumerate(self.server_ranks):
            lo, hi = self.layout.shard_range(shard)
            handles.append(self.links.isend(header, server, PUSH_HEADER_TAG))
            handles.append(self.links.isend(self.flat_grad[lo:hi], server, PUSH_DATA_TAG))
        for handle in handles:
            handle.wait()
        self.layout.load_params(self.flat_params)
        decoded = [Reply.decode(r) for r in replies]
        return PullResult(staleness=max(r.staleness for r in decoded), versions=tuple(r.version for r in decoded),
                          waited=any(r.waited for r in decoded))
