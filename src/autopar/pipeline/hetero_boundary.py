"""Boundary transfers between pipeline stages of different tensor-parallel degrees (--stage-tp), and
planned boundary transfers (--boundary) between any stages, equal degrees included.

Every transfer between stages that differ in rank count goes through `HeteroBoundary`, and only
through it (a uniform pipeline with --boundary other than direct also uses it, in place of P2P on
the pp group, so that Megatron's scatter-gather can move 1/tp of each tensor per link): the runtime (runtime.py) calls it exactly as it calls `P2P` (same `exchange`, `send`,
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

from ..errors import ConfigError
from ..resharding import Layout, Resharder, plan_resharding
from .p2p import P2P, Pending, decode_meta, encode_meta, _META_LEN

FORWARD, GRADIENT = 0, 1  # the runtime's message kinds (runtime.FORWARD_MSG / GRAD_MSG)
PLANNED_METHODS = ("send_recv", "scatter_gather", "broadcast")
MAX_PLANNED_TENSORS = 4  # tensors per boundary message with planned transfers (Resharder slots made at set-up)
_STAND_IN_SHAPE = (240,)  # divisible by every small receiver count: the set-up plans only fix ranks and groups


class HeteroBoundary:
    """Point-to-point messages between stages of one pipeline replica whose tp degrees differ (or, with a
    planned `method`, between equal-degree stages too: the uniform mesh's numbering is the same table).

    table: [stage][dp][tp rank] -> global rank (mesh.stage_rank_table); this rank is
    table[stage][dp_index][tp_index]. Messages travel over the world group (stages differ in
    rank count, so no single pp group joins them); tags keep (kind, stage, micro-batch) apart.
    Built collectively (one world all-reduce: NCCL's first group call must join every rank).
    """

    def __init__(self, table: list[list[list[int]]], *, stage: int, dp_index: int, tp_index: int,
                 device: torch.device, num_microbatches: int, method: str = "direct", timeout_s: float = 300.0,
                 link=None):
        self.table, self.stage, self.dp_index, self.tp_index = table, stage, dp_index, tp_index
        self.device = device
        self.inner = P2P(dist.group.WORLD, device, len(table), num_microbatches)
        dist.all_reduce(torch.zeros(1, device=device))
        self.inner._joined = True  # the all-reduce above was the world group's joining call
        self.method = method
        self.planned = None if method == "direct" else PlannedBoundary(self, method, timeout_s, link)

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
        if self.planned is not None:
            for tensors, peer, kind, stage, mb in sends:
                self.planned.send(tensors, peer=peer, kind=kind, stage=stage)
            return [self.planned.recv(peer=peer, kind=kind, stage=stage) for peer, kind, stage, mb in recvs]
        fanned = [(tensors, rank, kind, stage, mb) for tensors, peer, kind, stage, mb in sends
                  for rank in self.receivers(peer)]
        sources = [(self.source(peer), kind, stage, mb) for peer, kind, stage, mb in recvs]
        return self.inner.exchange(fanned, sources)

    def send(self, tensors: tuple[torch.Tensor, ...], *, peer: int, kind: int, stage: int, microbatch: int) -> None:
        if self.planned is not None:
            return self.planned.send(tensors, peer=peer, kind=kind, stage=stage)
        for rank in self.receivers(peer):
            self.inner.send(tensors, peer=rank, kind=kind, stage=stage, microbatch=microbatch)

    def recv(self, *, peer: int, kind: int, stage: int, microbatch: int) -> Pending:
        if self.planned is not None:
            return self.planned.recv(peer=peer, kind=kind, stage=stage)
        return self.inner.recv(peer=self.source(peer), kind=kind, stage=stage, microbatch=microbatch)

    def wait_sends(self) -> None:
        if self.planned is not None:
            self.planned.wait_sends()
        self.inner.wait_sends()


class _PlannedReceive:
    """A posted planned receive: `wait()` gives the message's tensors (the runtime's Pending interface)."""

    def __init__(self, pendings: list):
        self._pendings = pendings

    def wait(self) -> tuple[torch.Tensor, ...]:
        return tuple(pending.wait() for pending in self._pendings)


class PlannedBoundary:
    """Boundary messages moved by resharding plans (--boundary send_recv|scatter_gather|broadcast|auto).

    A boundary tensor is replicated over the sender stage's tp ranks and wanted replicated over the
    receiver's, so each tensor of a message is one transfer Layout(sender ranks) -> Layout(receiver
    ranks). The Resharder is built at set-up by every rank (its groups are collective) on stand-in
    plans, one slot per (dp replica, kind, sending stage, tensor index, method); the real shape is
    learnt once per channel (the sender posts its message's metadata to its direct receiver, as P2P
    does, and the receiver waits for it when it first posts that channel) and swapped in with
    `Resharder.replan`. Ordering: every rank of a plan calls `start` in the runtime's order for that
    channel (micro-batches in order at both ends), which is what the Resharder asks; all-gathers run
    on the receiving stage's ranks, which all wait their receives in the same order.
    """

    def __init__(self, boundary: HeteroBoundary, method: str, timeout_s: float, link=None):
        """link: what method "auto" prices on (resharding.plan_resharding's `link`: a cluster; None: nominal)."""
        if method not in (*PLANNED_METHODS, "auto"):
            raise ConfigError(f"boundary transfer {method!r} is unknown; use direct or one of "
                              f"{', '.join((*PLANNED_METHODS, 'auto'))}")
        self.boundary, self.method, self.link = boundary, method, link
        self.methods = PLANNED_METHODS if method == "auto" else (method,)
        table = boundary.table
        self.slots: dict[tuple, int] = {}
        stand_ins = []
        for dp in range(len(table[0])):  # every replica's plans, the same list on every rank
            for sender in range(len(table)):
                for kind, receiver in ((FORWARD, sender + 1), (GRADIENT, sender - 1)):
                    if not 0 <= receiver < len(table):
                        continue
                    src, dst = Layout(ranks=tuple(table[sender][dp])), Layout(ranks=tuple(table[receiver][dp]))
                    for index in range(MAX_PLANNED_TENSORS):
                        for m in self.methods:
                            self.slots[(dp, kind, sender, index, m)] = len(stand_ins)
                            stand_ins.append(plan_resharding(_STAND_IN_SHAPE, 4, src, dst, m))
        self.resharder = Resharder(stand_ins, timeout_s, boundary.device)
        self._known: dict[tuple, list] = {}  # channel -> [(slot, plan)] once its shapes are known
        self._sends: list = []

    def _channel(self, kind: int, sender: int, metas: list) -> list:
        """Plan each tensor of a message on (kind, sending stage) once its shapes and dtypes are known."""
        b = self.boundary
        receiver = sender + 1 if kind == FORWARD else sender - 1
        if len(metas) > MAX_PLANNED_TENSORS:
            raise ConfigError(f"a stage {sender} -> {receiver} boundary message has {len(metas)} tensors; planned "
                              f"boundaries (--boundary {self.method}) carry at most {MAX_PLANNED_TENSORS}: use "
                              f"--boundary direct")
        src = Layout(ranks=tuple(b.table[sender][b.dp_index]))
        dst = Layout(ranks=tuple(b.table[receiver][b.dp_index]))
        planned = []
        for index, (shape, dtype) in enumerate(metas):
            itemsize = torch.empty((), dtype=dtype).element_size()
            plan = plan_resharding(tuple(shape), itemsize, src, dst, self.method, self.link, dtype=dtype)
            slot = self.slots[(b.dp_index, kind, sender, index, plan.method)]
            self.resharder.replan(slot, plan)
            planned.append((slot, plan))
        return planned

    def send(self, tensors: tuple[torch.Tensor, ...], *, peer: int, kind: int, stage: int) -> None:
        b = self.boundary
        channel = (kind, b.stage)
        if channel not in self._known:
            meta = encode_meta(tensors).to(b.device)
            for rank in b.receivers(peer):  # the direct route carries the metadata, once per channel
                self._sends.append(dist.isend(meta, rank, tag=b.inner._meta_tag(kind, stage)))
            self._known[channel] = self._channel(kind, b.stage, [(t.shape, t.dtype) for t in tensors])
        for (slot, _), tensor in zip(self._known[channel], tensors):
            self._sends.append(self.resharder.start(slot, tensor.detach().contiguous()))

    def recv(self, *, peer: int, kind: int, stage: int) -> _PlannedReceive:
        b = self.boundary
        channel = (kind, peer)
        if channel not in self._known:
            meta = torch.zeros(_META_LEN, dtype=torch.int64, device=b.device)
            dist.recv(meta, b.source(peer), tag=b.inner._meta_tag(kind, stage))
            self._known[channel] = self._channel(kind, peer, decode_meta(meta.cpu()))
        return _PlannedReceive([self.resharder.start(slot, None) for slot, _ in self._known[channel]])

    def plans(self) -> list:
        """The ReshardPlans in use on this rank's channels, one per channel tensor (after the first step)."""
        return [plan for planned in self._known.values() for _, plan in planned]

    def describe(self) -> list[str]:
        return [plan.describe() for plan in self.plans()]

    def wait_sends(self) -> None:
        for work in self._sends:
            work.wait()
        self._sends = []


def boundary_routes(sender_tp: int, receiver_tp: int) -> str:
    """Who sends to whom across one boundary (tp ranks of each side), for `autopar plan` and docs."""
    pairs = [f"{k % sender_tp}->{k}" for k in range(receiver_tp)]
    idle = sender_tp - min(sender_tp, receiver_tp)
    return (f"tp {sender_tp} -> tp {receiver_tp}: whole tensor, sender tp rank -> receiver tp rank "
            f"{', '.join(pairs)}" + (f" ({idle} sender rank(s) idle)" if idle else ""))
