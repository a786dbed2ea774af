"""Variable-size collectives for sparse tables, with a ledger of what each rank receives.

Why our own helpers: the lookups send a different number of rows to each peer (ranks hold
different numbers of tokens, even none), rows of different widths (a column shard's width
depends on the rank), and gloo's all_gather wants equal sizes. Everything here is one
`all_to_all_single` on a flat buffer with explicit split sizes, which gloo supports on CPU
and which sends exactly the payload (no padding), so the ledger counts real bytes.

The ledger (`CommLedger`) records, per category, the elements this rank RECEIVES from other
ranks (its own block is not communication). The cost formulas of the EmbRace analysis are
stated per worker in received elements, so tests and the benchmark compare against them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommLedger:
    """Bytes and elements received from other ranks, per category, since the last `reset`."""

    elements: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, category: str, elements: int, element_size: int) -> None:
        self.elements[category] += int(elements)
        self.bytes[category] += int(elements) * int(element_size)

    def reset(self) -> None:
        self.elements.clear()
        self.bytes.clear()

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> dict[str, int]:
        return {f"{k}_bytes": v for k, v in sorted(self.bytes.items())}


class PendingExchange:
    """An all-to-all in flight; `wait()` returns the received chunks (one per source rank)."""

    def __init__(self, work, output: torch.Tensor, sizes: list[int]):
        self._work, self._output, self._sizes = work, output, sizes

    def wait(self) -> list[torch.Tensor]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return list(torch.split(self._output, self._sizes))


def exchange(chunks: list[torch.Tensor], recv_sizes: list[int], group: dist.ProcessGroup, *,
             ledger: CommLedger | None = None, category: str = "", async_op: bool = False,
             dtype: torch.dtype | None = None) -> PendingExchange | list[torch.Tensor]:
    """Send chunks[k] (any shape, flattened) to rank k; receive recv_sizes[j] elements from rank j.

    Every rank must call it with matching sizes (what j sends me == what I expect from j).
    """
    rank = dist.get_rank(group)
    flat = [c.reshape(-1) for c in chunks]
    dtype = dtype or (flat[0].dtype if flat else torch.float32)
    device = flat[0].device if flat else torch.device("cpu")
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    output = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
    if ledger is not None:
        ledger.add(category, sum(s for j, s in enumerate(recv_sizes) if j != rank), send.element_size())
    if len(recv_sizes) == 1:  # a world of one: nothing to send
        output.copy_(send)
        pending = PendingExchange(None, output, recv_sizes)
    else:
        work = dist.all_to_all_single(output, send, output_split_sizes=list(recv_sizes),
                                      input_split_sizes=[f.numel() for f in flat], group=group, async_op=async_op)
        pending = PendingExchange(work if async_op else None, output, recv_sizes)
    return pending if async_op else pending.wait()


def exchange_counts(counts: list[int], group: dist.ProcessGroup) -> list[int]:
    """counts[k] is what I will send to rank k; returns what each rank will send me (small, int64)."""
    world = dist.get_world_size(group)
    if world == 1:
        return list(counts)
    send = torch.tensor(counts, dtype=torch.int64)
    received = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(received, send, group=group)
    return received.tolist()


def all_gather_varlen(tensor: torch.Tensor, group: dist.ProcessGroup, *, ledger: CommLedger | None = None,
                      category: str = "") -> list[torch.Tensor]:
    """Every rank's `tensor` (dim 0 may differ, trailing dims equal), in rank order; no padding sent."""
    world = dist.get_world_size(group)
    row = int(torch.tensor(tensor.shape[1:]).prod()) if tensor.dim() > 1 else 1
    sizes = exchange_counts([tensor.shape[0]] * world, group)
    received = exchange([tensor] * world, [s * row for s in sizes], group, ledger=ledger, category=category,
                        dtype=tensor.dtype)
    return [r.view(-1, *tensor.shape[1:]) for r in received]
