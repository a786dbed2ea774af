"""2D communication scheduling of a sharded table's row gradients, and the staleness check.

The relaxed dependency (EmbRace's "horizontal" dimension): step t+1's lookups need only the
rows R_{t+1} that step t+1 reads to carry step t's update; every other row may land later.
So each row's gradient gets a priority key, the step at which it is next read, and the
backward exchange is cut into chunks popped from a priority queue: the urgent chunk (key
t+1) is exchanged and applied at once, then step t+1's lookup exchange is launched (it
overlaps the dense all-reduce still in flight), and the deferred chunks stream in the
background and are applied before the next update of the table (the latest point at
which a row can be read again: step t+1 reads none of them, by construction).

We look one step ahead (the sampler is deterministic, so R_{t+1} is known during step t);
rows not in R_{t+1} get key "later" and are split into a few chunks by id range.

`RowVersions` is the proof obligation: for every row it records the last step whose
gradient touched it (`produced`) and the last step whose update has landed (`applied`).
A lookup that reads a row with produced > applied is a stale read and raises at once.
For row-separable optimizers (SGD, Adagrad, SparseAdam) landing each row's update late but
before its next read or update leaves the trained parameters exactly those of
synchronous SGD: scheduled and unscheduled runs are compared bit for bit in the tests.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

LATER = float("inf")


class StaleRowError(RuntimeError):
    """A lookup read a row whose latest update had not landed (a scheduling bug)."""


class RowVersions:
    """Per-row produced/applied step counters of one shard (local row numbering)."""

    def __init__(self, num_rows: int):
        self.produced = torch.full((num_rows,), -1, dtype=torch.int64)
        self.applied = torch.full((num_rows,), -1, dtype=torch.int64)
        self.reads_checked = 0

    def mark_produced(self, rows: torch.Tensor, step: int) -> None:
        self.produced[rows] = step

    def mark_applied(self, rows: torch.Tensor, step: int) -> None:
        self.applied[rows] = step

    def is_stale(self, rows: torch.Tensor) -> bool:
        self.reads_checked += int(rows.numel())
        return bool((self.produced[rows] > self.applied[rows]).any())

    def check_read(self, rows: torch.Tensor, *, table: str, step: int, peer_found: bool = False) -> None:
        stale = self.produced[rows] > self.applied[rows]
        self.reads_checked += 0 if peer_found else int(rows.numel())
        if peer_found and not bool(stale.any()):
            raise StaleRowError(f"{table}: step {step}: another rank's shard was read before a pending update "
                                f"landed (see that rank's error); the schedule must flush such rows first")
        if bool(stale.any()):
            bad = rows[stale][:5].tolist()
            raise StaleRowError(f"{table}: step {step} read row(s) {bad} (local numbering) before the update of step "
                                f"{int(self.produced[rows][stale].max())} landed (applied up to "
                                f"{int(self.applied[rows][stale].min())}); the schedule must flush them first")

    def pending(self) -> int:
        return int((self.produced > self.applied).sum())


@dataclass(order=True)
class Chunk:
    """The rows of one step's gradient that share a priority key (the step they are next read).

    A chunk is a rule on global row ids, not a list, so that sender and receiver (who see
    different positions) pick the same rows without another exchange: the urgent chunk is
    "in R_{t+1}", deferred chunk i is "not in R_{t+1}, id in the i-th of `deferred_chunks`
    equal id ranges".
    """

    key: float
    order: int
    next_read: torch.Tensor = field(compare=False)
    id_range: tuple[int, int] | None = field(compare=False, default=None)  # None: the urgent chunk

    def select(self, ids: torch.Tensor) -> torch.Tensor:
        needed = torch.isin(ids, self.next_read)
        if self.id_range is None:
            return needed
        low, high = self.id_range
        return ~needed & (ids >= low) & (ids < high)


class RowPriorityQueue:
    """One step's row gradients as chunks, popped in the order their rows are next needed."""

    def __init__(self, next_read: torch.Tensor, *, num_rows: int, step: int, deferred_chunks: int = 2):
        self._heap: list[Chunk] = []
        heapq.heappush(self._heap, Chunk(step + 1, 0, next_read))
        bounds = [num_rows * i // deferred_chunks for i in range(deferred_chunks + 1)]
        for i in range(deferred_chunks):
            heapq.heappush(self._heap, Chunk(LATER, i + 1, next_read, (bounds[i], bounds[i + 1])))

    def pop(self) -> Chunk:
        return heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._heap)
