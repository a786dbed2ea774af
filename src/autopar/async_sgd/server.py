"""One parameter-server shard: applies pushed gradients, serves pulls within the staleness bound.

Consistency model (stale-synchronous parallel, Ho et al. 2013): a worker's clock is the
number of its pushes this server has applied. A pull for step c is served only once every
worker's clock is >= c - S, i.e. the parameters include every worker's gradients of steps
<= c - S - 1. S = 0 is bulk-synchronous, a large S is fully asynchronous.

Why S = 0 is *exactly* synchronous averaged SGD here: a pull request rides on the push of
the previous step, so the server registers it when it applies that push. When the last
push of step c-1 arrives, every worker's request for step c is already waiting, and all
are answered from the same state before any step-c push can exist (a worker cannot push
step c before it has its parameters for step c). Each push is one SGD update with the
worker's share of the global-batch gradient (loss scaled by 1/workers), so the W updates
of a step sum to one step on the averaged gradient.

Every push records its staleness: how many updates this shard applied between the pull
the gradient was computed at and the push itself (0 for one worker; W-1 for W workers in
lockstep; at most (W-1)(2S+1) under the bound).

Round-robin mode applies pushes strictly in worker order 0, 1, ..., W-1, 0, ... (holding
early arrivals back), which makes a run deterministic and equal, bit for bit, to the
single-process delayed-SGD simulator (delayed.py) with the matching delays.

The server runs the same optimizer rule as the trainer would (torch SGD, no momentum,
weight decay on >= 2-D parameters only), on views of its flat shard, with the learning
rate each push carries (the schedule's value at the worker's step).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch
from torch import nn

from .layout import FlatLayout
from .protocol import PUSH_DATA_TAG, PUSH_HEADER_TAG, REPLY_DATA_TAG, REPLY_HEADER_TAG, Push, Reply


class PushRecord(NamedTuple):
    server: int  # shard index
    worker: int  # global rank
    clock: int  # the worker's step
    staleness: int  # updates applied between this gradient's pull and its push
    version: int  # shard version after applying it


class PullRecord(NamedTuple):
    server: int
    worker: int
    clock: int  # the step the parameters are for (FINAL pulls: the number of steps)
    min_clock: int  # slowest worker's clock when served: the SSP bound says >= clock - S
    version: int  # shard version served
    waited: bool  # held back by the bound


class _PendingPull(NamedTuple):
    push: Push
    staleness: int
    registered_min_clock: int


class ParameterServer:
    """Serves shard `shard` of `layout` to the worker ranks until every worker has sent its final push."""

    def __init__(self, layout: FlatLayout, shard: int, *, workers: list[int], staleness: int, links,
                 weight_decay: float = 0.0, round_robin: bool = False, initial: torch.Tensor | None = None):
        lo, hi = layout.shard_range(shard)
        self.shard, self.workers, self.staleness, self.links = shard, list(workers), staleness, links
        self.round_robin = round_robin
        source = initial if initial is not None else layout.gather_params()
        self.params = source[lo:hi].detach().clone().cpu()
        self.grad = torch.zeros_like(self.params)
        decay, no_decay = [], []
        for seg in layout.segments(shard):
            piece = nn.Parameter(self.params[seg.start:seg.stop])  # a view: the optimizer updates the flat shard
            piece.grad = self.grad[seg.start:seg.stop]
            (decay if seg.ndim >= 2 else no_decay).append(piece)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.SGD([g for g in groups if g["params"]], lr=1.0, foreach=True)
        self.version = 0
        self.clocks = {w: 0 for w in self.workers}
        self.pulled_version = {w: 0 for w in self.workers}  # every worker starts from version 0
        self.finished: set[int] = set()
        self.pushes: list[PushRecord] = []
        self.pulls: list[PullRecord] = []

    # ------------------------------------------------------------------ the loop

    def serve(self) -> None:
        """Receive pushes from any worker, apply them, answer pulls; returns when all workers are done."""
        pending: list[_PendingPull] = []
        early: dict[int, tuple[Push, torch.Tensor]] = {}  # round-robin: pushes that arrived before their turn
        turn = 0
        sends: deque = deque()
        header = Push.empty()
        while len(self.finished) < len(self.workers) or pending:
            source = self.links.recv(header, None, PUSH_HEADER_TAG)
            push = Push.decode(header)
            if push.worker != source or push.worker not in self.clocks:
                raise RuntimeError(f"parameter server {self.shard}: a push header from rank {source} names worker "
                                   f"{push.worker}; workers are {self.workers}")
            grad = torch.empty_like(self.params)
            self.links.recv(grad, source, PUSH_DATA_TAG)
            if not self.round_robin:
                pending.append(self._apply(push, grad))
            else:
                early[push.worker] = (push, grad)
                while self.workers[turn] in early:
                    pending.append(self._apply(*early.pop(self.workers[turn])))
                    turn = self._next_turn(turn)
                    pending = self._answer_ready(pending, sends)
            pending = self._answer_ready(pending, sends)
        for handle in sends:
            handle.wait()

    def _next_turn(self, turn: int) -> int:
        for _ in range(len(self.workers)):
            turn = (turn + 1) % len(self.workers)
            if self.workers[turn] not in self.finished:
                return turn
        return turn

    @torch.no_grad()
    def _apply(self, push: Push, grad: torch.Tensor) -> _PendingPull:
        expected = self.clocks[push.worker]
        if push.clock != expected or push.worker in self.finished:
            raise RuntimeError(f"parameter server {self.shard}: worker {push.worker} pushed step {push.clock}, "
                               f"expected step {expected}" + (" (it had finished)" if push.worker in self.finished else ""))
        staleness = self.version - self.pulled_version[push.worker]
        self.grad.copy_(grad)
        for group in self.optimizer.param_groups:
            group["lr"] = push.lr
        self.optimizer.step()
        self.version += 1
        self.clocks[push.worker] += 1
        if push.final:
            self.finished.add(push.worker)
        self.pushes.append(PushRecord(self.shard, push.worker, push.clock, staleness, self.version))
        return _PendingPull(push, staleness, min(self.clocks.values()))

    def _ready(self, request: _PendingPull, min_clock: int) -> bool:
        if request.push.final:
            return len(self.finished) == len(self.workers)
        return min_clock >= request.push.pull_clock - self.staleness

    def _answer_ready(self, pending: list[_PendingPull], sends: deque) -> list[_PendingPull]:
        """Serve every waiting pull the bound now allows, in the order they were registered."""
        min_clock = min(self.clocks.values())
        waiting = []
        for request in pending:
            if not self._ready(request, min_clock):
                waiting.append(request)
                continue
            worker = request.push.worker
            waited = not self._ready(request, request.registered_min_clock)
            reply = Reply(version=self.version, staleness=request.staleness, min_clock=min_clock, waited=waited)
            # snapshots: the delayed transport may post a send later, after further updates
            sends.append(self.links.isend(reply.encode(), worker, REPLY_HEADER_TAG))
            sends.append(self.links.isend(self.params.clone(), worker, REPLY_DATA_TAG))
            self.pulled_version[worker] = self.version
            clock = request.push.clock + 1
            self.pulls.append(PullRecord(self.shard, worker, clock, min_clock, self.version, waited))
        while len(sends) > 4 * len(self.workers):  # bound the snapshots held in flight
            sends.popleft().wait()
        return waiting
