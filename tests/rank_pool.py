"""A pool of gloo CPU ranks, started once and reused by many tests.

Starting processes and forming a process group costs seconds; tests that pay it each
time make the suite slow. A `RankPool(n)` starts n workers (forked from a server that imported
torch and autopar once, see PRELOAD) that join one gloo group
(with a short timeout) and then run functions sent to them: `pool.run(fn, *args)` runs
`fn(*args)` on every rank and returns the per-rank results, or raises with the failing
rank's traceback. A task that fails or times out makes the pool restart before the next
task, so one broken test cannot poison the next (ranks may be mid-collective).
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from autopar.launch import free_port

GROUP_TIMEOUT_S = 60
STOP_GRACE_S = 5  # how long close() lets workers leave on their own before killing them
# Imported once by the fork server that every worker is forked from, rather than by each new worker: torch,
# autopar's trainer and transformers cost about 4 s of CPU per process, and a run starts about 20 workers (pools
# of 1, 2, 4, 6 and 8 ranks) plus one more pool for every task that fails or tears its groups down.
PRELOAD = ["torch", "torch.distributed", "autopar.trainer", "autopar.distributed", "transformers"]


def _context():
    """Workers forked from a server that imported PRELOAD (the fork server starts with the first pool)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank: int, world: int, port: int, tasks, results, environ: dict, cwd: str) -> None:
    # the environment and folder of the test process when the pool started, as a spawned worker would inherit
    # them (the fork server keeps those of the first pool's start)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            outcome = (True, fn(*args, **kwargs))
        except BaseException as exc:  # report everything, including assertion errors, to the test
            outcome = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        # a failure shared by tearing this rank's groups down (autopar/train/shared_failure.py): restart the pool
        torn_down = not dist.is_initialized()
        results.put((rank, _by_value(outcome), torn_down))
        if torn_down:
            _leave(results)
        _drop_subgroups(dist)
    dist.destroy_process_group()
    _leave(results)


def _leave(results) -> None:
    """Exit without the interpreter's shutdown (about a second per rank with torch loaded, paid by every pool
    restart and, rank after rank, at the end of the run), once this rank's last result has left its queue."""
    import sys

    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _by_value(outcome: tuple) -> bytes:
    """The outcome as bytes (torch.save), not as tensors in shared memory: each shared tensor holds a file
    descriptor in the test process for as long as it lives, and a zoo layout returns thousands of parameters
    (kept in the reference cache), which ran the test process out of descriptors ("received 0 items of
    ancdata") and broke every later pool task."""
    import torch

    buffer = io.BytesIO()
    try:
        torch.save(outcome, buffer)
    except Exception as exc:  # an unpicklable result is the task's failure, reported like one
        buffer = io.BytesIO()
        torch.save((False, f"the task's result cannot be sent back: {type(exc).__name__}: {exc}"), buffer)
    return buffer.getvalue()


def _drop_subgroups(dist) -> None:
    """Destroy the process groups a task left behind (meshes and engines of tests that do not close their
    Trainer, meshes built directly, ...). Each idle gloo group keeps threads of its own; hundreds of tests'
    groups alive in long-lived workers made later tests measurably slower (2 cores). destroy_groups also
    clears DTensor's sharding caches, which would otherwise hand a later task's FSDP2 DTensors an earlier
    task's destroyed mesh groups (its meshes compare equal by shape)."""
    from autopar.distributed import destroy_groups, process_groups
    if dist.is_initialized():
        destroy_groups(process_groups())


class RankPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._start()

    def _start(self) -> None:
        ctx = _context()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        port = free_port()
        environ, cwd = dict(os.environ), os.getcwd()
        self._procs = [ctx.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results,
                                                         environ, cwd), daemon=True) for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 240, **kwargs: Any) -> list[Any]:
        """Run fn(*args, **kwargs) on every rank; results ordered by rank."""
        if self.broken:
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        try:
            for _ in range(self.world_size):
                rank, payload, torn_down = self._results.get(timeout=timeout)
                self.broken |= torn_down
                ok, value = torch.load(io.BytesIO(payload), weights_only=False)
                (results if ok else failures)[rank] = value
        except queue.Empty:
            self.broken = True
            raise TimeoutError(f"{fn.__name__} did not finish on all {self.world_size} ranks within {timeout} s "
                               f"(finished: {sorted(results)}, failed: {sorted(failures)})") from None
        except BaseException:  # results left in the queue would be read by the next task as its own
            self.broken = True
            raise
        if failures:
            self.broken = True
            first = min(failures)
            raise AssertionError(f"{fn.__name__} failed on rank(s) {sorted(failures)}; rank {first}:\n"
                                 f"{failures[first]}")
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        self.ask_to_stop()
        self.wait_stopped()

    def ask_to_stop(self) -> None:
        """Tell every worker to leave its loop; apart from wait_stopped so that many pools stop at once."""
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass

    def wait_stopped(self, deadline: float | None = None) -> None:
        """Join the workers, killing those still alive at `deadline` (time.monotonic(); default 5 s from now),
        one deadline for all: a worker that hangs on its way out must not cost the run seconds per rank."""
        deadline = time.monotonic() + STOP_GRACE_S if deadline is None else deadline
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
