"""The hang watchdog: one thread per rank that notices when no step has finished for too long.

The trainer marks progress (a step, an evaluation or a save finished) and names what it is
doing next. When nothing has finished for `timeout_s`, the thread reads the main thread's
Python stack to say where this rank is (the pipeline action being run, the torch.distributed
call it waits in, the innermost autopar line), prints that, writes it and every thread's
stack (faulthandler) to `hang_rank{R}.txt` in the run folder, and ends the process with
HANG_EXIT so a launcher with --max-restarts can restart the job. Reading the stack costs
nothing until a hang, so no code on the hot path has to keep an "operation" string current.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from ..errors import HANG_EXIT

_SEP = os.sep


def where_is(frame: FrameType | None) -> str:
    """Where a thread stands: pipeline action, torch.distributed call, innermost autopar line."""
    action = collective = autopar_line = None
    while frame is not None:
        code, path = frame.f_code, frame.f_code.co_filename
        if collective is None and f"torch{_SEP}distributed" in path and code.co_name not in ("wrapper", "_wrapper"):
            collective = f"torch.distributed {code.co_name}"
        if f"autopar{_SEP}" in path:
            if autopar_line is None:
                short = path[path.rindex(f"autopar{_SEP}"):]
                autopar_line = f"{short}:{frame.f_lineno} ({code.co_name})"
            if action is None and path.endswith(f"pipeline{_SEP}runtime.py") and "action" in frame.f_locals:
                action = f"pipeline action {frame.f_locals['action']}"
        frame = frame.f_back
    parts = [p for p in (action, collective, f"at {autopar_line}" if autopar_line else None) if p]
    return "; ".join(parts) or "outside autopar's code"


class Watchdog:
    """Context manager: starts the thread on enter (timeout_s > 0), stops it on exit."""

    def __init__(self, timeout_s: float, *, rank: int, run_dir: Path):
        self.timeout_s, self.rank, self.run_dir = timeout_s, rank, Path(run_dir)
        self._phase = "starting"
        self._last = time.monotonic()
        self._main = threading.main_thread().ident if threading.current_thread() is threading.main_thread() \
            else threading.get_ident()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def progress(self, phase: str) -> None:
        """Something finished; `phase` is what this rank does next (e.g. 'step 7')."""
        self._phase = phase
        self._last = time.monotonic()

    @property
    def phase(self) -> str:
        """What this rank is doing now ('step 7'), for messages."""
        return self._phase

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="autopar-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._report(idle)

    def _report(self, idle: float) -> None:
        where = where_is(sys._current_frames().get(self._main))
        path = self.run_dir / f"hang_rank{self.rank}.txt"
        line = (f"autopar: hang on rank {self.rank}: no step finished for {idle:.0f} s (--hang-timeout-s "
                f"{self.timeout_s:g}); rank {self.rank} is in {self._phase}: {where}")
        try:
            with open(path, "w") as f:
                f.write(line + "\n\nstacks of every thread of this rank:\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            line += f"; stacks in {path}"
        except OSError as exc:
            line += f"; could not write {path} ({exc})"
        print(line, file=sys.stderr, flush=True)
        os._exit(HANG_EXIT)
