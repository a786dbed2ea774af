"""Point-to-point transfer of tuples of tensors between pipeline ranks.

Why not torch.distributed.pipelining's stage communication: it is bound to its own stage
and schedule classes; our runtime executes action lists from any generator, so it needs
bare asynchronous sends and receives of arbitrary tensor tuples.

The first transfer on a channel (peer, direction, stage) carries a metadata message
(count, dtypes, shapes) so the receiver can allocate buffers; later transfers reuse it.
Every message has its own tag, so the receiver may post receives in any order and early.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import DistributedError

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


@dataclass
class Pending:
    """A posted receive: the buffers fill in once every work handle has completed."""

    tensors: tuple[torch.Tensor, ...]
    works: list

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self.works:
            work.wait()
        self.works = []
        return self.tensors


class P2P:
    """Asynchronous sends and receives over one process group, with per-channel metadata."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_stages: int, num_microbatches: int):
        self.group, self.device = group, device
        self.num_stages, self.num_microbatches = num_stages, num_microbatches
        self._known: dict[tuple, list[tuple[torch.Size, torch.dtype]]] = {}
        self._sent_meta: set[tuple] = set()
        self._sends: list = []

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
        """Post receives for one message; the first one on a channel first reads its metadata."""
        channel = (peer, kind, stage)
        src = self._global(peer)
        if channel not in self._known:
            meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
            dist.irecv(meta, src, group=self.group, tag=self._meta_tag(kind, stage)).wait()
            self._known[channel] = decode_meta(meta.cpu())
        buffers, works = [], []
        for i, (shape, dtype) in enumerate(self._known[channel]):
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            works.append(dist.irecv(buffer, src, group=self.group, tag=self._data_tag(kind, stage, microbatch, i)))
            buffers.append(buffer)
        return Pending(tuple(buffers), works)

    def wait_sends(self) -> None:
        for work in self._sends:
            work.wait()
        self._sends = []
