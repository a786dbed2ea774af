"""Preemption: SIGTERM or SIGINT asks every rank to stop after the current step, saved.

The handler only records the request; the trainer all-reduces it with the step's loss (no
extra collective), so all ranks agree to stop after the same step, save a checkpoint and
leave with PREEMPTED_EXIT (errors.py). A second signal leaves at once with 128 + signal
number, as a shell reports a process killed by that signal; a repeat within
DUPLICATE_WINDOW_S is taken as the same request arriving twice (Ctrl-C reaches both the
launcher, which passes it on, and the ranks; Slurm signals every process of a step).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from ..launch import STOP_RECEIVED

SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_WINDOW_S = 2.0  # a repeat within this is one request reaching the rank twice, not a second one


class StopRequest:
    """Context manager installing the handlers on the main thread (elsewhere it does nothing)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.signal: int | None = None
        self._previous: dict[int, object] = {}
        self._first_at = 0.0

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None and time.monotonic() - self._first_at < DUPLICATE_WINDOW_S:
            return  # the same request delivered twice (terminal and launcher, or Slurm to every process)
        if self.signal is not None:
            print(f"autopar: rank {self.rank}: second signal ({name}); exiting now without a checkpoint",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signal, self._first_at = signum, time.monotonic()
        print(f"{STOP_RECEIVED.format(rank=self.rank, signal=name)}; finishing this step, saving a checkpoint, then "
              f"stopping (send it again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
