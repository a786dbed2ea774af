"""The messages between parameter-server workers and servers (point-to-point, tagged).

A worker's step ends with one PUSH to every server: a small float64 header, then its
gradient slice for that server's shard. The push also asks for the parameters of the
worker's next step (a push and a pull travel together, so a server learns of the pull
request at the same moment it applies the push; that is what makes the synchronous S=0
case exact, see server.py). The server answers, when the staleness bound allows, with a
REPLY header and the shard's parameters.

Tags keep the two streams apart on one process group; the header is float64 so that the
learning rate rides with the integers (clocks below 2**53 are exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PUSH_HEADER_TAG = 7101
PUSH_DATA_TAG = 7102
REPLY_HEADER_TAG = 7103
REPLY_DATA_TAG = 7104

FINAL = 1  # flag: the worker's last push; its reply carries the final parameters (every worker finished)


@dataclass(frozen=True)
class Push:
    """Worker `worker` sends the gradient of its step `clock` (computed at the parameters it pulled for that
    step) with learning rate `lr`; it asks for the parameters of step `pull_clock` = clock + 1."""

    worker: int  # global rank
    clock: int
    lr: float
    final: bool

    @property
    def pull_clock(self) -> int:
        return self.clock + 1

    def encode(self) -> torch.Tensor:
        return torch.tensor([self.worker, self.clock, self.lr, FINAL if self.final else 0], dtype=torch.float64)

    @staticmethod
    def empty() -> torch.Tensor:
        return torch.empty(4, dtype=torch.float64)

    @classmethod
    def decode(cls, header: torch.Tensor) -> Push:
        worker, clock, lr, flags = header.tolist()
        return cls(worker=int(worker), clock=int(clock), lr=float(lr), final=bool(int(flags) & FINAL))


@dataclass(frozen=True)
class Reply:
    """What a server says with the parameters it serves."""

    version: int  # updates applied to this shard so far
    staleness: int  # of the push that carried this pull request: updates applied between its pull and it
    min_clock: int  # the slowest worker's clock (pushes applied) when the pull was served
    waited: bool  # the pull was held back by the staleness bound

    def encode(self) -> torch.Tensor:
        return torch.tensor([self.version, self.staleness, self.min_clock, float(self.waited)], dtype=torch.float64)

    @staticmethod
    def empty() -> torch.Tensor:
        return torch.empty(4, dtype=torch.float64)

    @classmethod
    def decode(cls, header: torch.Tensor) -> Reply:
        version, staleness, min_clock, waited = header.tolist()
        return cls(version=int(version), staleness=int(staleness), min_clock=int(min_clock), waited=bool(waited))
