"""Ring attention: each rank keeps its queries; key/value blocks travel around the cp ranks.

At step s rank r attends with the block of rank r - s while the next block is already on its way
(the exchange is posted before the compute, so they overlap). Partial results merge by the online
softmax (running row maximum, running sum, rescaled accumulator), so the result is exact, not an
approximation; the backward pass sends the blocks around once more, with their key/value gradient
accumulators following them home. Memory: one rank's queries and two key/value blocks at a time,
never the whole sequence.

Chunk pairs under a causal mask (layout.py: rank r holds chunks r and 2cp-1-r): a query chunk
after a key chunk attends to all of it, the same chunk attends causally, an earlier one not at
all and is skipped, which is where the load balancing saves its work. A causal sliding window hides
keys `window` or more positions back: a chunk pair wholly outside it is skipped too, one it cuts is masked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import chunk_indices


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None, *,
                   causal: bool, scale: float, group: dist.ProcessGroup, window: int | None = None) -> torch.Tensor:
    """Attention of this rank's queries (B, H, T/cp, D) over the whole sequence's keys and values.
    `key_valid`: (B, T/cp) bool, False for padding keys (None: all valid). `window` (causal only): a query
    sees keys fewer than `window` positions back."""
    if key_valid is not None:  # tiny: every rank's padding flags at once, indexed by the block's owner
        gathered = [torch.empty_like(key_valid) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, key_valid.contiguous(), group=group)
        key_valid = torch.stack(gathered)
    return _RingAttention.apply(q, k, v, key_valid, causal, scale, _Ring(group), window)


def loopback_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                            cp: int, rank: int, window: int | None = None) -> torch.Tensor:
    """The attention work of rank `rank` of a cp group, in one process with no group: every block "sent" comes
    back as the one received. The values are not the whole sequence's attention, but every pass, pair, skip and
    merge is the rank's own, so its CPU time is what the rank computes: the search prices ring attention from
    it (search/ring_cost.py), as it prices blocks from their measured times."""
    return _RingAttention.apply(q, k, v, None, causal, scale, _LoopbackRing(cp, rank), window)


class _Ring:
    """Point-to-point exchange with the ring neighbours of one cp group."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensor: torch.Tensor) -> tuple[list, torch.Tensor]:
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, received, self.prev, self.group)]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def finish(pending: tuple[list, torch.Tensor]) -> torch.Tensor:
        works, received = pending
        for work in works:
            work.wait()
        return received


class _LoopbackRing(_Ring):
    """Rank `rank` of a ring of `size` with no neighbours: what it sends is what it receives (a copy, as a
    received buffer is)."""

    def __init__(self, size: int, rank: int):  # no group: nothing is exchanged
        self.group, self.size, self.rank = None, size, rank

    def start(self, tensor: torch.Tensor) -> tuple[list, torch.Tensor]:
        return [], tensor.clone()


def _pairs(rank: int, source: int, cp: int):
    """(query half, key half, chunk distance) of every pair: halves index the two chunks a rank holds."""
    mine, theirs = chunk_indices(rank, cp), chunk_indices(source, cp)
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            yield i, j, a - b


class _BlockMasks:
    """Which keys of a chunk `distance` chunks back each query sees: None (all), SKIP (none) or a mask."""

    SKIP = False

    def __init__(self, size: int, causal: bool, window: int | None, device: torch.device):
        self.size, self.causal, self.window, self.device = size, causal, window, device
        self.cache: dict[int, torch.Tensor] = {}  # the masks of pairs the diagonal or the window cuts

    def __call__(self, distance: int) -> torch.Tensor | bool | None:
        if not self.causal:
            return None
        nearest, farthest = distance * self.size - (self.size - 1), distance * self.size + self.size - 1
        if farthest < 0 or (self.window is not None and nearest >= self.window):
            return self.SKIP  # every key after every query, or every key out of the window
        if nearest >= 0 and (self.window is None or farthest < self.window):
            return None  # (decided without a tensor: no mask to build, no device sync)
        if distance not in self.cache:
            index = torch.arange(self.size, device=self.device)
            back = distance * self.size + index[:, None] - index[None, :]  # how far back each key lies
            seen = back >= 0
            if self.window is not None:
                seen = seen & (back < self.window)
            self.cache[distance] = seen
        return self.cache[distance]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, seen: torch.Tensor | None, valid: torch.Tensor | None):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if seen is not None:
        s = s.masked_fill(~seen, float("-inf"))
    if valid is not None:
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, key_valid, causal, scale, ring, window):
        half = q.shape[2] // 2
        masks = _BlockMasks(half, causal, window, q.device)
        shape = q.shape[:3]
        row_max = torch.full(shape, float("-inf"), device=q.device)
        row_sum = torch.zeros(shape, device=q.device)
        acc = torch.zeros(q.shape, device=q.device)
        block = torch.stack([k, v])
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            pending = ring.start(block) if step < ring.size - 1 else None
            for i, j, distance in _pairs(ring.rank, source, ring.size):
                seen = masks(distance)
                if seen is _BlockMasks.SKIP:
                    continue
                rows = slice(i * half, (i + 1) * half)
                cols = slice(j * half, (j + 1) * half)
                valid = key_valid[source][:, cols] if key_valid is not None else None
                s = _scores(q[:, :, rows], block[0][:, :, cols], scale, seen, valid)
                new_max = torch.maximum(row_max[:, :, rows], s.amax(-1))
                safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
                p = torch.exp(s - safe[..., None])
                keep = torch.exp(row_max[:, :, rows] - safe)
                row_sum[:, :, rows] = row_sum[:, :, rows] * keep + p.sum(-1)
                acc[:, :, rows] = acc[:, :, rows] * keep[..., None] + torch.matmul(p, block[1][:, :, cols].float())
                row_max[:, :, rows] = new_max
            if pending is not None:
                block = _Ring.finish(pending)
        empty = row_sum == 0  # a query with no key to attend (all masked): output 0, no gradient
        out = (acc / torch.where(empty, torch.ones_like(row_sum), row_sum)[..., None]).to(q.dtype)
        lse = torch.where(empty, torch.full_like(row_max, float("inf")), row_max + torch.log(row_sum))
        ctx.save_for_backward(q, k, v, out, lse, key_valid)
        ctx.causal, ctx.scale, ctx.ring, ctx.window = causal, scale, ring, window
        ctx.has_valid = key_valid is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, key_valid = ctx.saved_tensors
        key_valid = key_valid if ctx.has_valid else None
        ring, scale = ctx.ring, ctx.scale
        half = q.shape[2] // 2
        masks = _BlockMasks(half, ctx.causal, ctx.window, q.device)
        grad_out = grad_out.float()
        delta = (grad_out * out.float()).sum(-1)
        grad_q = torch.zeros(q.shape, device=q.device)
        block = torch.stack([k, v])
        grads = torch.zeros((2, *k.shape), device=k.device)  # [dk, dv] of the block held, travelling with it
        qf = q.float()
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            pending = ring.start(block) if step < ring.size - 1 else None
            for i, j, distance in _pairs(ring.rank, source, ring.size):
                seen = masks(distance)
                if seen is _BlockMasks.SKIP:
                    continue
                rows = slice(i * half, (i + 1) * half)
                cols = slice(j * half, (j + 1) * half)
                valid = key_valid[source][:, cols] if key_valid is not None else None
                kj, vj = block[0][:, :, cols].float(), block[1][:, :, cols].float()
                s = _scores(qf[:, :, rows], kj, scale, seen, valid)
                p = torch.exp(s - lse[:, :, rows][..., None])
                g = grad_out[:, :, rows]
                grads[1][:, :, cols] += torch.matmul(p.transpose(-1, -2), g)
                ds = p * (torch.matmul(g, vj.transpose(-1, -2)) - delta[:, :, rows][..., None])
                grad_q[:, :, rows] += torch.matmul(ds, kj) * scale
                grads[0][:, :, cols] += torch.matmul(ds.transpose(-1, -2), qf[:, :, rows]) * scale
            grads = _Ring.finish(ring.start(grads))  # to the next rank: after the last step, home
            if pending is not None:
                block = _Ring.finish(pending)
        return grad_q.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None, None
