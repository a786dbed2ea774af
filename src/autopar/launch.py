"""Start N local processes as one job: the embedded default when torchrun is not used.

Each process gets the same environment torchrun would give it (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a script written for torchrun
runs unchanged, plus OMP_NUM_THREADS=1 (one thread per rank: on a small machine more
threads oversubscribe the cores and make multi-process runs several times slower).

Why not torch.distributed.run (torchrun's engine) in-process: it is built for elastic
multi-node agents and restarts; locally we only need spawn, wait, and fail fast, with a
message. When one rank exits with an error, the others are stopped after a short grace
period instead of waiting in a collective until their timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, nproc: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(command: Sequence[str], nproc: int, *, grace_s: float = 5.0, poll_s: float = 0.05) -> int:
    """Run `command` as ranks 0..nproc-1; returns 0, or the exit code of the first rank that failed."""
    if nproc < 1:
        print(f"autopar launch: error: --nproc must be >= 1, got {nproc}", file=sys.stderr)
        return 2
    port = free_port()
    procs = [subprocess.Popen(list(command), env=rank_environment(r, nproc, port)) for r in range(nproc)]
    failed: tuple[int, int] | None = None
    deadline = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if failed is None:
                for rank, code in enumerate(codes):
                    if code not in (None, 0):
                        failed = (rank, code)
                        deadline = time.monotonic() + grace_s
                        break
            if all(code is not None for code in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                alive = [r for r, c in enumerate(codes) if c is None]
                print(f"autopar launch: rank {failed[0]} exited with code {failed[1]}; stopping ranks "
                      f"{alive}", file=sys.stderr, flush=True)
                _stop(procs)
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _stop(procs, sig=signal.SIGINT)
        return 130
    if failed is not None:
        print(f"autopar launch: rank {failed[0]} failed (exit code {failed[1]}); see its message above",
              file=sys.stderr, flush=True)
        return failed[1]
    return 0


def _stop(procs: list[subprocess.Popen], sig: int = signal.SIGTERM, wait_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    end = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
