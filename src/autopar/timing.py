"""Timing that never stalls a GPU: CUDA events on CUDA devices, `time.perf_counter` on CPU.

Why: reading a host clock around GPU work measures when work was *queued*, and making it
measure the work instead (torch.cuda.synchronize) stalls the pipeline of queued kernels. CUDA
events are recorded in the stream and read later, once the host has to wait anyway (the
step's logged loss), so timing adds no host-device synchronisation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class Clock:
    """Time marks on one device: `mark()` now, `seconds(marks)` later (host seconds on CPU).

    On CUDA a mark is an event recorded on the current stream; `seconds` waits for the last
    one (call it after the step's own host wait) and returns host-clock seconds: the first
    mark's host time plus the GPU time elapsed since it, so marks of different ranks line up
    only approximately (to the host-side lag at the first mark).
    """

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._origin: tuple[float, torch.cuda.Event] | None = None

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._origin is None:
            self._origin = (time.perf_counter(), event)
        return event

    def seconds(self, marks: list) -> list[float]:
        """Each mark as host seconds (perf_counter's scale)."""
        if not self.cuda or not marks:
            return list(marks)
        host, origin = self._origin
        marks[-1].synchronize()
        return [host + origin.elapsed_time(m) / 1000 for m in marks]

    def reset(self) -> None:
        """Forget the origin (one per step keeps GPU and host clocks from drifting apart)."""
        self._origin = None


class StepTimer:
    """Wall time of a region (a training step) measured without a host wait of its own."""

    def __init__(self, device: torch.device | str):
        self._clock = Clock(device)
        self._start = self._end = None

    def start(self) -> None:
        self._clock.reset()
        self._start = self._clock.mark()

    def stop(self) -> None:
        self._end = self._clock.mark()

    def seconds(self) -> float:
        """Seconds from start to stop; on CUDA, waits for the stop event (read it after the step's loss)."""
        start, end = self._clock.seconds([self._start, self._end])
        return end - start


class WaitTally:
    """Time this rank spent blocked waiting for other ranks in the current step, by kind.

    Why: a step's wall time minus its compute is not idle time: it also holds the step's own
    work (the update, loading batches, norms). The pipeline literature's bubble is the time a
    device sits waiting for its peers, so the waits themselves are timed: a mark pair around each
    (on CUDA, events around the stream's wait: the time the device waited, not the host).
    Nested waits count once (the outermost). `WaitTally()` without a device records nothing.
    """

    def __init__(self, device: torch.device | str | None = None):
        self._clock = Clock(device) if device is not None else None
        self._pairs: list[tuple[str, object, object]] = []  # (kind, start mark, end mark) of this step
        self._depth = 0

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Times the block as a wait of `kind` (e.g. "pipeline", "data_parallel")."""
        if self._clock is None or self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._depth = 1
        start = self._clock.mark()
        try:
            yield
        finally:
            self._depth = 0
            self._pairs.append((kind, start, self._clock.mark()))

    def start_step(self) -> None:
        """Forget the waits so far: the trainer calls this where a step's wall time starts."""
        self._pairs = []
        if self._clock is not None:
            self._clock.reset()

    def seconds(self, kind: str) -> float:
        """Seconds waited for `kind` since `start_step` (on CUDA: waits for the last mark)."""
        pairs = [(start, end) for k, start, end in self._pairs if k == kind]
        if not pairs:
            return 0.0
        times = self._clock.seconds([m for pair in pairs for m in pair])
        return sum(times[2 * i + 1] - times[2 * i] for i in range(len(pairs)))
