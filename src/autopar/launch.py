"""Start N local processes as one job: the embedded default when torchrun is not used.

Each process gets the same environment torchrun would give it (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a script written for torchrun
runs unchanged, plus OMP_NUM_THREADS=1 (one thread per rank: on a small machine more
threads oversubscribe the cores and make multi-process runs several times slower).

Why not torch.distributed.run (torchrun's engine) in-process: it is built for elastic
multi-node agents and restarts; locally we only need spawn, wait, and fail fast, with a
message. When one rank exits with an error, the others are stopped after a short grace
period instead of waiting in a collective until their timeout; with max_restarts the job is
then started again (the trainer resumes from the run's latest complete checkpoint).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from .errors import HANG_EXIT, PREEMPTED_EXIT


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


ATTEMPT_ENV = "AUTOPAR_RESTART_COUNT"  # 0 on the first run of a job, k on its k-th restart (torchrun's own:
TORCHRUN_ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun --max-restarts)
RESTARTS_LOG = "restarts.jsonl"
# A failed rank with one of these statuses is not restarted: bad input (2) fails the same way again, and
# preemption (errors.PREEMPTED_EXIT) or an interrupt (130) means the job was asked to stop.
NO_RESTART = (2, PREEMPTED_EXIT, 130)


def restart_attempt() -> int:
    """0 on a job's first run; k on its k-th restart (by autopar launch, or by torchrun --max-restarts)."""
    value = os.environ.get(ATTEMPT_ENV) or os.environ.get(TORCHRUN_ATTEMPT_ENV) or "0"
    return int(value) if value.isdigit() else 0


def launch(command: Sequence[str], nproc: int, *, grace_s: float = 5.0, poll_s: float = 0.05,
           max_restarts: int = 0, run_dir: str | None = None) -> int:
    """Run `command` as ranks 0..nproc-1; returns 0, or the exit code of the first rank that failed.

    max_restarts > 0: when a rank fails (other than with a status in NO_RESTART), every rank is stopped
    and the job started again, at most that many times, with ATTEMPT_ENV set to the restart number (the
    trainer then resumes from `run_dir`'s latest complete checkpoint); each restart is appended, with its
    cause, to run_dir/restarts.jsonl. SIGTERM/SIGINT sent to the launcher is passed on to every rank.
    """
    if nproc < 1:
        print(f"autopar launch: error: --nproc must be >= 1, got {nproc}", file=sys.stderr)
        return 2
    forwarding = _SignalForwarder()
    with forwarding:
        for attempt in range(max_restarts + 1):
            code, cause = _run_once(command, nproc, {ATTEMPT_ENV: str(attempt)}, forwarding, grace_s, poll_s)
            if code == 0 or code in NO_RESTART or forwarding.signal is not None or attempt == max_restarts:
                if code not in (0, PREEMPTED_EXIT) and cause:
                    print(f"autopar launch: {cause}; see its message above", file=sys.stderr, flush=True)
                if code not in (0, *NO_RESTART) and max_restarts:
                    print(f"autopar launch: giving up after {attempt} restart(s) (--max-restarts {max_restarts})",
                          file=sys.stderr, flush=True)
                return code
            resumes = _latest_checkpoint(run_dir)
            print(f"autopar launch: {cause}; restart {attempt + 1} of {max_restarts}, from "
                  f"{resumes or 'the beginning (no checkpoint yet)'}", file=sys.stderr, flush=True)
            if run_dir is not None and Path(run_dir).is_dir():
                record = {"restart": attempt + 1, "time": datetime.now().isoformat(timespec="seconds"),
                          "cause": cause, "exit_code": code, "resumes_from": resumes, "by": "autopar launch"}
                with open(Path(run_dir) / RESTARTS_LOG, "a") as f:
                    f.write(json.dumps(record) + "\n")
    return code


def _run_once(command: Sequence[str], nproc: int, extra_env: dict[str, str], forwarding: _SignalForwarder,
              grace_s: float, poll_s: float) -> tuple[int, str | None]:
    """One start of the job: (exit code, cause of the failure or None)."""
    port = free_port()
    procs = [subprocess.Popen(list(command), env={**rank_environment(r, nproc, port), **extra_env})
             for r in range(nproc)]
    forwarding.procs = procs
    failed: tuple[int, int] | None = None
    deadline = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failing = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)
                       and not (code == PREEMPTED_EXIT and forwarding.signal is not None)]
            # a rank killed by a signal is the cause; a peer's error exit is usually its consequence
            killed = next(((rank, code) for rank, code in failing if code < 0), None)
            if failing and (failed is None or (failed[1] > 0 and killed is not None)):
                failed = killed or failing[0]
                deadline = deadline or time.monotonic() + grace_s
            if all(code is not None for code in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                alive = [r for r, c in enumerate(codes) if c is None]
                print(f"autopar launch: rank {failed[0]} exited with code {failed[1]}; stopping ranks "
                      f"{alive}", file=sys.stderr, flush=True)
                _stop(procs)
                break
            time.sleep(poll_s)
    finally:
        forwarding.procs = []
    if failed is not None:
        return failed[1], f"rank {failed[0]} {_describe_exit(failed[1])}"
    codes = [p.returncode for p in procs]
    return (PREEMPTED_EXIT, None) if PREEMPTED_EXIT in codes else (0, None)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == HANG_EXIT:
        return "was stopped by the hang watchdog (exit code 124; its report is above and in hang_rank*.txt)"
    return f"failed (exit code {code})"


def _latest_checkpoint(run_dir: str | None) -> str | None:
    latest = Path(run_dir) / "checkpoints" / "latest" if run_dir else None
    return latest.read_text().strip() if latest is not None and latest.is_file() else None


class _SignalForwarder:
    """While a job runs, SIGTERM/SIGINT to the launcher goes to every rank (each saves and stops)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        self.signal = signum
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def __enter__(self) -> _SignalForwarder:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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
