"""Point-to-point transfer of tuples of tensors between pipeline ranks.

Why not torch.distributed.pipelining's stage communication: it is bound to its own stage
and schedule classes; our runtime executes action lists from any generator, so it needs
bare asynchronous sends and receives of arbitrary tensor tuples.

The first transfer on a channel (peer, direction, stage) carries a metadata message
(count, dtypes, shapes) so the receiver can allocate buffers; later transfers reuse it.
Every message has its own tag, so the receiver may post receives in any order and early.

`exchange` posts one communication step (comm_steps.py) as one `batch_isend_irecv` group, the
form NCCL needs; `send` / `recv` post single operations (gloo tolerates any order of them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..timing import WaitTally

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int16, torch.int8]
MAX_TENSORS = 32
MAX_DIMS = 8
_DATA_TAGS = 1 << 16  # metadata tags stay below this
_META_LEN = 1 + MAX_TENSORS * (2 + MAX_DIMS)


def encode_meta(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if len(tensors) > MAX_TENSORS:
        raise DistributedError(f"a stage sends {len(tensors)} tensors; at most {MAX_TENSORS} are supported")
    meta = torch.zeros(_META_LEN, dtype=torch.int64)
    meta[0] = len(tensors)
    for i, t in enumerate(tensors):
        if t.dtype not in _DTYPES or t.dim() > MAX_DIMS:
            raise DistributedError(f"cannot send a {t.dtype} tensor with {t.dim()} dims between stages")
        base = 1 + i * (2 + MAX_DIMS)
        meta[base] = _DTYPES.index(t.dtype)
        meta[base + 1] = t.dim()
        meta[base + 2:base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return meta


def decode_meta(meta: torch.Tensor) -> list[tuple[torch.Size, torch.dtype]]:
    out = []
    for i in range(int(meta[0])):
        base = 1 + i * (2 + MAX_DIMS)
        ndim = int(meta[base + 1])
        out.append((torch.Size(meta[base + 2:base + 2 + ndim].tolist()), _DTYPES[int(meta[base])]))
    return out


class Pending:
    """A posted receive. If the channel's metadata had not arrived when it was posted, the data
    receives are posted on `wait()` instead (so posting never blocks, however early)."""

    def __init__(self, p2p: P2P, channel: tuple, src: int, tags: list[int] | None, tensors=(), works=()):
        self._p2p, self._channel, self._src, self._tags = p2p, channel, src, tags
        self.tensors, self.works = tuple(tensors), list(works)

    def wait(self) -> tuple[torch.Tensor, ...]:
        if self._tags is not None:  # metadata was still in flight when this receive was posted
            self.tensors, self.works = self._p2p._post_data(self._channel, self._src, self._tags)
            self._tags = None
        for work in self.works:
            work.wait()
        self.works = []
        return self.tensors


class P2P:
    """Asynchronous sends and receives over one process group, with per-channel metadata."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_stages: int, num_microbatches: int,
                 waits: WaitTally | None = None):
        """waits: where the time blocked on a channel's metadata is added (kind "pipeline")."""
        self.group, self.device = group, device
        self.waits = waits if waits is not None else WaitTally()
        self.num_stages, self.num_microbatches = num_stages, num_microbatches
        self._known: dict[tuple, list[tuple[torch.Size, torch.dtype]]] = {}
        self._sent_meta: set[tuple] = set()
        self._meta_pending: dict[tuple, tuple] = {}
        self._sends: list = []
        self._joined = False  # whether this group has had its first, all-rank call (see exchange)

    def _meta_tag(self, kind: int, stage: int) -> int:
        return kind * self.num_stages + stage

    def _data_tag(self, kind: int, stage: int, microbatch: int, index: int) -> int:
        message = (kind * self.num_stages + stage) * self.num_microbatches + microbatch
        return _DATA_TAGS + message * MAX_TENSORS + index

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer)

    def send(self, tensors: tuple[torch.Tensor, ...], *, peer: int, kind: int, stage: int, microbatch: int) -> None:
        """Post the sends; they complete in the background (see `wait_sends`)."""
        channel = (peer, kind, stage)
        dst = self._global(peer)
        if channel not in self._sent_meta:
            meta = encode_meta(tensors).to(self.device)
            self._sends.append(dist.isend(meta, dst, group=self.group, tag=self._meta_tag(kind, stage)))
            self._sent_meta.add(channel)
        for i, t in enumerate(tensors):
            self._sends.append(dist.isend(t.detach().contiguous(), dst, group=self.group,
                                          tag=self._data_tag(kind, stage, microbatch, i)))

    def recv(self, *, peer: int, kind: int, stage: int, microbatch: int) -> Pending:
        """Post receives for one message (never blocks)."""
        channel = (peer, kind, stage)
        src = self._global(peer)
        tags = [self._data_tag(kind, stage, microbatch, i) for i in range(MAX_TENSORS)]
        if channel not in self._known:
            if channel not in self._meta_pending:
                meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
                work = dist.irecv(meta, src, group=self.group, tag=self._meta_tag(kind, stage))
                self._meta_pending[channel] = (work, meta)
            return Pending(self, channel, src, tags)
        tensors, works = self._post_data(channel, src, tags)
        return Pending(self, channel, src, None, tensors, works)

    def exchange(self, sends: list[tuple[tuple[torch.Tensor, ...], int, int, int, int]],
                 recvs: list[tuple[int, int, int, int]]) -> list[Pending]:
        """Post one communication step as one batched group; returns the receives, in `recvs` order.

        sends: (tensors, peer, kind, stage, micro-batch); recvs: (peer, kind, stage, micro-batch),
        each in the order the step lists them (the same order at both ends of a rank pair).
        A channel's first message needs its metadata first: both ends know it is the first
        (they post the same messages in the same order), so both post a metadata group and
        wait for it (once per channel, the only host wait here) before the data group.
        """
        if not self._joined:  # NCCL: a group's first call must include every rank, and a step may not
            with self.waits.timed("pipeline"):
                dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)  # (every rank exchanges)
            self._joined = True
        meta_ops, new = [], []
        for tensors, peer, kind, stage, _ in sends:
            if (peer, kind, stage) not in self._sent_meta:
                self._sent_meta.add((peer, kind, stage))
                meta = encode_meta(tensors).to(self.device)
                meta_ops.append(dist.P2POp(dist.isend, meta, self._global(peer), self.group, self._meta_tag(kind, stage)))
        for peer, kind, stage, _ in recvs:
            channel = (peer, kind, stage)
            if channel not in self._known and channel not in (c for c, _ in new):
                meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
                meta_ops.append(dist.P2POp(dist.irecv, meta, self._global(peer), self.group,
                                           self._meta_tag(kind, stage)))
                new.append((channel, meta))
        if meta_ops:
            works = dist.batch_isend_irecv(meta_ops)
            with self.waits.timed("pipeline"):
                for work in works:
                    work.wait()
            for channel, meta in new:
                self._known[channel] = decode_meta(meta.cpu())
        ops, kept, buffers = [], [], []
        for tensors, peer, kind, stage, mb in sends:
            for i, t in enumerate(tensors):
                t = t.detach().contiguous()
                kept.append(t)
                ops.append(dist.P2POp(dist.isend, t, self._global(peer), self.group, self._data_tag(kind, stage, mb, i)))
        for peer, kind, stage, mb in recvs:
            mine = tuple(torch.empty(shape, dtype=dtype, device=self.device)
                         for shape, dtype in self._known[(peer, kind, stage)])
            buffers.append(mine)
            ops += [dist.P2POp(dist.irecv, b, self._global(peer), self.group, self._data_tag(kind, stage, mb, i))
                    for i, b in enumerate(mine)]
        works = dist.batch_isend_irecv(ops) if ops else []
        if sends:
            self._sends.append((works, kept))  # the tensors stay alive until the sends complete
        # NCCL returns one work for the whole group, gloo one per operation: every receive waits
        # on the group (its sends included), which on both is what completes the step
        return [Pending(self, (peer, kind, stage), self._global(peer), None, mine, works)
                for (peer, kind, stage, _), mine in zip(recvs, buffers)]

    def _post_data(self, channel: tuple, src: int, tags: list[int]) -> tuple[tuple, list]:
        if channel not in self._known:
            work, meta = self._meta_pending.pop(channel)
            with self.waits.timed("pipeline"):
                work.wait()
            self._known[channel] = decode_meta(meta.cpu())
        buffers, works = [], []
        for (shape, dtype), tag in zip(self._known[channel], tags):
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            works.append(dist.irecv(buffer, src, group=self.group, tag=tag))
            buffers.append(buffer)
        return tuple(buffers), works

    def wait_sends(self) -> None:
        for entry in self._sends:
            works = entry[0] if isinstance(entry, tuple) else [entry]
            for work in works:
                work.wait()
        self._sends = []
