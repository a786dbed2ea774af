"""Boundary transfers between pipeline stages of different tensor-parallel degrees (--stage-tp).

Every transfer between stages that differ in rank count goes through `HeteroBoundary`, and only
through it: the runtime (runtime.py) calls it exactly as it calls `P2P` (same `exchange`, `send`,
`recv`, `wait_sends`), with peers named by *pipeline rank* (the stage index: --stage-tp has one
stage per rank, no interleaving). This class turns each message into the global-rank messages
of one replica; a planned resharding (another transfer per boundary) replaces `receivers` and
`source` and the two posting methods below, nothing else.

The routing, and why it is correct: a boundary activation (a stage's output) and its gradient
(the next stage's input gradient) are replicated over a stage's tp ranks (the tp plan all-reduces
a block's output, and the column layers' `copy_to_tp` all-reduces input gradients). So any
sender copy is the whole tensor, and the rule is modular: receiver tp rank k of the other stage
takes the message of sender tp rank k mod t_sender. Sender j thus sends the whole tensor to
receivers j, j + t_sender, j + 2 t_sender, ...; when the sender stage is wider (4 -> 2), its tp
ranks >= t_receiver send nothing. This is the simple transfer (each receiver gets one whole copy
from one sender), not Alpa's tiled or scatter-gather one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .p2p import P2P, Pending

FORWARD, GRADIENT = 0, 1  # the runtime's message kinds (runtime.FORWARD_MSG / GRAD_MSG)


class HeteroBoundary:
    """Point-to-point messages between stages of one pipeline replica whose tp degrees differ.

    table: [stage][dp][tp rank] -> global rank (mesh.stage_rank_table); this rank is
    table[stage][dp_index][tp_index]. Messages travel over the world group (stages differ in
    rank count, so no single pp group joins them); tags keep (kind, stage, micro-batch) apart.
    Built collectively (one world all-reduce: NCCL's first group call must join every rank).
    """

    def __init__(self, table: list[list[list[int]]], *, stage: int, dp_index: int, tp_index: int,
                 device: torch.device, num_microbatches: int):
        self.table, self.stage, self.dp_index, self.tp_index = table, stage, dp_index, tp_index
        self.device = device
        self.inner = P2P(dist.group.WORLD, device, len(table), num_microbatches)
        dist.all_reduce(torch.zeros(1, device=device))
        self.inner._joined = True  # the all-reduce above was the world group's joining call

    def degree(self, stage: int) -> int:
        return len(self.table[stage][self.dp_index])

    def receivers(self, to_stage: int) -> list[int]:
        """Global ranks of `to_stage` that take this rank's copy: tp ranks k with k mod t_mine == my tp rank."""
        mine = self.degree(self.stage)
        return [rank for k, rank in enumerate(self.table[to_stage][self.dp_index]) if k % mine == self.tp_index]

    def source(self, from_stage: int) -> int:
        """The global rank of `from_stage` whose copy this rank takes: its tp rank (my tp rank mod its degree)."""
        return self.table[from_stage][self.dp_index][self.tp_index % self.degree(from_stage)]

    # -- the P2P interface the runtime calls (peers are pipeline ranks = stage indices)

    def exchange(self, sends: list[tuple[tuple[torch.Tensor, ...], int, int, int, int]],
                 recvs: list[tuple[int, int, int, int]]) -> list[Pending]:
        """One communication step: each send fans out to its receivers, each receive names its one source.

        The order inside the step stays the runtime's (peer, kind, micro-batch), the same at both ends
        of every global rank pair, so batched groups match (comm_steps.py).
        """
        fanned = [(tensors, rank, kind, stage, mb) for tensors, peer, kind, stage, mb in sends
                  for rank in self.receivers(peer)]
        sources = [(self.source(peer), kind, stage, mb) for peer, kind, stage, mb in recvs]
        return self.inner.exchange(fanned, sources)

    def send(self, tensors: tuple[torch.Tensor, ...], *, peer: int, kind: int, stage: int, microbatch: int) -> None:
        for rank in self.receivers(peer):
            self.inner.send(tensors, peer=rank, kind=kind, stage=stage, microbatch=microbatch)

    def recv(self, *, peer: int, kind: int, stage: int, microbatch: int) -> Pending:
        return self.inner.recv(peer=self.source(peer), kind=kind, stage=stage, microbatch=microbatch)

    def wait_sends(self) -> None:
        self.inner.wait_sends()


def boundary_routes(sender_tp: int, receiver_tp: int) -> str:
    """Who sends to whom across one boundary (tp ranks of each side), for `autopar plan` and docs."""
    pairs = [f"{k % sender_tp}->{k}" for k in range(receiver_tp)]
    idle = sender_tp - min(sender_tp, receiver_tp)
    return (f"tp {sender_tp} -> tp {receiver_tp}: whole tensor, sender tp rank -> receiver tp rank "
            f"{', '.join(pairs)}" + (f" ({idle} sender rank(s) idle)" if idle else ""))
