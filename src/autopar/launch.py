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

The launcher owns the console when a rank fails. Every rank's stderr passes through it and is
kept whole in a per-rank log (RUN/logs/rank_N.log). Once a rank has failed, the launcher says so
first, in one line naming the rank and its cause; from then on the other ranks' tracebacks and
torch's connection errors (consequences of the first failure) go to their logs only, and just
their own one-line "autopar: ..." reports still reach the console, unless they only say that a
peer was lost. Exit statuses (`EXIT_STATUSES`): the first failed rank's, with a rank killed by
signal N reported as 128 + N, as shells do (not Python's 256 - N: 247 for SIGKILL).

A rank that is lost (killed by a signal, or stopped by a SIGTERM that reached it alone: preempted) may
instead shrink the job: with `on_rank_loss`, the caller decides the smaller world (rank_loss.py) and the
launcher starts that one, each new rank on a surviving device (LOCAL_RANK is the device's slot).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from .checkpoint_names import step_of
from .errors import HANG_EXIT, PREEMPTED_EXIT, AutoparError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, nproc: int, port: int, base: dict[str, str] | None = None, *,
                     device: int | None = None) -> dict[str, str]:
    """torchrun's variables for `rank`; `device`: the device slot it runs on (LOCAL_RANK; default the rank)."""
    env = dict(os.environ if base is None else base)
    local = rank if device is None else device
    env.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


ATTEMPT_ENV = "AUTOPAR_RESTART_COUNT"  # 0 on the first run of a job, k on its k-th restart (torchrun's own:
TORCHRUN_ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun --max-restarts)
RESTARTS_LOG = "restarts.jsonl"
# A failed rank with one of these statuses is not restarted: bad input (2) fails the same way again, and
# preemption (errors.PREEMPTED_EXIT) or an interrupt (130) means the job was asked to stop.
NO_RESTART = (2, PREEMPTED_EXIT, 130)
# What a rank prints when a stop signal reaches it (train/interrupt.py); the launcher reads it to tell a preempted
# rank (the signal reached it alone) from its peers, which stop with it after the same step.
STOP_RECEIVED = "autopar: rank {rank}: {signal} received"
STDERR_TTY_ENV = "AUTOPAR_STDERR_TTY"  # "1": the launcher's stderr is a terminal (the ranks' is a pipe to it)
LOGS_DIR = "logs"
EXIT_STATUSES = {  # what `autopar train` and `autopar launch` exit with (docs/features/command-line.md)
    "0": "the job finished",
    "1": "a failure: a bug (its traceback is shown) or a rank that failed unexpectedly",
    "2": "bad input or a refused combination: one line says what and what would work",
    str(PREEMPTED_EXIT): "stopped on SIGTERM/SIGINT after saving a checkpoint: continue with --resume RUN",
    str(HANG_EXIT): "stopped by the hang watchdog (--hang-timeout-s); its report is in RUN/hang_rank*.txt",
    "130": "interrupted (Ctrl-C) before a checkpoint could be saved",
    "128+N": "a rank was killed by signal N: 137 SIGKILL (often the out-of-memory killer), 134 SIGABRT, "
             "139 SIGSEGV, 143 SIGTERM",
}


def restart_attempt() -> int:
    """0 on a job's first run; k on its k-th restart (by autopar launch, or by torchrun --max-restarts)."""
    value = os.environ.get(ATTEMPT_ENV) or os.environ.get(TORCHRUN_ATTEMPT_ENV) or "0"
    return int(value) if value.isdigit() else 0


@dataclass(frozen=True)
class RankLoss:
    """Ranks lost by a start of the job: killed by a signal, or preempted (a stop signal reached them alone)."""

    lost: tuple[int, ...]  # ranks of the world that ended
    world: int
    devices: tuple[int, ...]  # the device slot each rank of that world ran on
    cause: str
    exit_code: int
    resumes_from: str | None  # the run's latest complete checkpoint (its folder name), if any


@dataclass(frozen=True)
class Relaunch:
    """What to start instead after a rank loss: the ranks' command, their count and their device slots."""

    command: list[str]
    devices: tuple[int, ...]
    record: dict = field(default_factory=dict)  # what restarts.jsonl notes about the change (layout, plan)
    says: str = ""  # the end of the console line, e.g. "dp=1 tp=1 pp=2"


def launch(command: Sequence[str], nproc: int, *, grace_s: float = 5.0, poll_s: float = 0.05,
           max_restarts: int = 0, run_dir: str | None = None,
           on_rank_loss: Callable[[RankLoss], Relaunch] | None = None) -> int:
    """Run `command` as ranks 0..nproc-1; returns 0, or the exit code of the first rank that failed.

    max_restarts > 0: when a rank fails (other than with a status in NO_RESTART), every rank is stopped
    and the job started again, at most that many times, with ATTEMPT_ENV set to the restart number (the
    trainer then resumes from `run_dir`'s latest complete checkpoint); each restart is appended, with its
    cause, to run_dir/restarts.jsonl. SIGTERM/SIGINT sent to the launcher is passed on to every rank.
    on_rank_loss: when ranks were lost (killed by a signal, or preempted alone) and some survive, it says
    what to start instead (a smaller world; an AutoparError: the job stops with its message); counted
    against max_restarts like a restart.
    """
    if nproc < 1:
        print(f"autopar launch: error: --nproc must be >= 1, got {nproc}", file=sys.stderr)
        return 2
    forwarding = _SignalForwarder()
    devices = tuple(range(nproc))
    command = list(command)
    with forwarding:
        for attempt in range(max_restarts + 1):
            output = RankOutput(len(devices), attempt, run_dir)
            code, cause, lost = _run_once(command, devices, {ATTEMPT_ENV: str(attempt)}, forwarding, grace_s,
                                          poll_s, output)
            logs = output.keep(run_dir, failed=code not in (0, PREEMPTED_EXIT))
            shrinks = (on_rank_loss is not None and code != 0 and forwarding.signal is None and
                       attempt < max_restarts and 0 < len(lost) < len(devices))
            if shrinks:
                loss = RankLoss(lost=lost, world=len(devices), devices=devices, cause=cause or "",
                                exit_code=code, resumes_from=_latest_checkpoint(run_dir))
                relaunch = _shrink(loss, on_rank_loss, attempt, max_restarts, run_dir)
                if relaunch is None:
                    return exit_status(code)
                command, devices = relaunch.command, relaunch.devices
                continue
            if code == 0 or code in NO_RESTART or forwarding.signal is not None or attempt == max_restarts:
                if code not in (0, PREEMPTED_EXIT) and cause:
                    said = "; see its message above" if code > 0 else ""  # a killed rank says nothing
                    where = f"; every rank's whole output: {logs}" if logs else ""
                    print(f"autopar launch: {cause}{said}{where}", file=sys.stderr, flush=True)
                if code not in (0, *NO_RESTART) and max_restarts:
                    print(f"autopar launch: giving up after {attempt} restart(s) (--max-restarts {max_restarts})",
                          file=sys.stderr, flush=True)
                return exit_status(code)
            resumes = _latest_checkpoint(run_dir)
            print(f"autopar launch: {cause}; restart {attempt + 1} of {max_restarts}, from "
                  f"{resumes or 'the beginning (no checkpoint yet)'}", file=sys.stderr, flush=True)
            _log_restart(run_dir, {"restart": attempt + 1, "cause": cause, "exit_code": code, "resumes_from": resumes,
                                   "by": "autopar launch"})
    return code


def _shrink(loss: RankLoss, on_rank_loss: Callable[[RankLoss], Relaunch], attempt: int, max_restarts: int,
            run_dir: str | None) -> Relaunch | None:
    """Ask `on_rank_loss` for the smaller world, say it in one line and log it; None: it cannot go on (said)."""
    lost = ", ".join(map(str, loss.lost))
    try:
        relaunch = on_rank_loss(loss)
    except AutoparError as exc:
        print(f"autopar launch: {loss.cause}; cannot go on without rank(s) {lost}: {exc}", file=sys.stderr,
              flush=True)
        return None
    new_world = len(relaunch.devices)
    print(f"autopar launch: {loss.cause}; lost rank(s) {lost}: going on with {new_world} of {loss.world} ranks "
          f"(devices {', '.join(map(str, relaunch.devices))}) from {loss.resumes_from or 'the beginning'}"
          f"{': ' + relaunch.says if relaunch.says else ''} (change {attempt + 1} of {max_restarts}, "
          f"--on-rank-loss shrink)", file=sys.stderr, flush=True)
    step = (step_of(loss.resumes_from) or 0) if loss.resumes_from else 0
    _log_restart(run_dir, {"restart": attempt + 1, "cause": loss.cause, "exit_code": loss.exit_code,
                           "resumes_from": loss.resumes_from, "resumed_step": step, "by": "autopar launch",
                           "change": "shrink", "lost_ranks": list(loss.lost), "old_world": loss.world,
                           "new_world": new_world, "old_devices": list(loss.devices),
                           "new_devices": list(relaunch.devices), **relaunch.record})
    return relaunch


def _log_restart(run_dir: str | None, record: dict) -> None:
    if run_dir is not None and Path(run_dir).is_dir():
        record = {**record, "time": datetime.now().isoformat(timespec="seconds")}
        with open(Path(run_dir) / RESTARTS_LOG, "a") as f:
            f.write(json.dumps(record) + "\n")


def exit_status(code: int) -> int:
    """A rank's return code as the launcher's exit status: killed by signal N (Popen's -N) is 128 + N."""
    return 128 - code if code < 0 else code


def _run_once(command: Sequence[str], devices: Sequence[int], extra_env: dict[str, str],
              forwarding: _SignalForwarder, grace_s: float, poll_s: float,
              output: RankOutput) -> tuple[int, str | None, tuple[int, ...]]:
    """One start of the job, rank r on device slot devices[r]: (exit code, cause of the failure or None, the
    ranks lost: killed by a signal before the launcher stopped anyone, or preempted alone)."""
    port = free_port()
    nproc = len(devices)
    tty = {STDERR_TTY_ENV: "1"} if sys.stderr.isatty() else {}
    procs = [subprocess.Popen(list(command), env={**rank_environment(r, nproc, port, device=devices[r]), **extra_env,
                                                  **tty},
                              stderr=subprocess.PIPE) for r in range(nproc)]
    output.follow(procs)
    forwarding.procs = procs
    failed: tuple[int, int] | None = None
    deadline = None
    killed_by_signal: set[int] = set()
    try:
        while True:
            codes = [p.poll() for p in procs]
            killed_by_signal.update(r for r, code in enumerate(codes) if code is not None and code < 0)
            failing = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)
                       and not (code == PREEMPTED_EXIT and forwarding.signal is not None)]
            # a rank killed by a signal is the cause; a peer's error exit is usually its consequence
            killed = next(((rank, code) for rank, code in failing if code < 0), None)
            if failing and (failed is None or (failed[1] > 0 and killed is not None)):
                first = failed is None
                failed = killed or failing[0]
                deadline = deadline or time.monotonic() + grace_s
                if first:  # the cause, first; what the others print about it goes to their logs
                    output.collapse(cause_rank=failed[0])
                    print(f"autopar launch: rank {failed[0]} {_describe_exit(failed[1])} (exit status "
                          f"{exit_status(failed[1])}); stopping the other ranks (their whole output: "
                          f"{output.where()})", file=sys.stderr, flush=True)
            if all(code is not None for code in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                alive = [r for r, c in enumerate(codes) if c is None]
                print(f"autopar launch: rank {failed[0]} exited with code {failed[1]}; stopping ranks "
                      f"{alive}", file=sys.stderr, flush=True)
                output.stopping = True  # the stop signals from here on are the launcher's own
                _stop(procs)
                break
            time.sleep(poll_s)
    finally:
        forwarding.procs = []
        output.finish()
    preempted = tuple(sorted(output.stop_received)) if forwarding.signal is None else ()
    if failed is not None:
        cause = f"rank {failed[0]} {_describe_exit(failed[1])}"
        if failed[1] == PREEMPTED_EXIT and preempted:
            cause = f"rank(s) {', '.join(map(str, preempted))} preempted (a stop signal; saved and stopped)"
        return failed[1], cause, tuple(sorted(killed_by_signal | set(preempted)))
    codes = [p.returncode for p in procs]
    return ((PREEMPTED_EXIT, None, preempted) if PREEMPTED_EXIT in codes else (0, None, ()))


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == HANG_EXIT:
        return "was stopped by the hang watchdog (exit code 124; its report is above and in hang_rank*.txt)"
    return f"failed (exit code {code})"


class RankOutput:
    """Every rank's stderr, passed to the console as it comes and kept whole in a log file per rank.

    After `collapse`, the cause rank's output still reaches the console whole; the others' only as their
    "autopar: ..." one-line reports (a report that a peer was lost, which the launcher's line explains,
    not even that). Written to a temporary folder while the ranks run (the trainer removes a run folder
    that fails before its first step, and must find none it did not make); `keep` moves the logs into
    RUN/logs/ when the run folder exists."""

    CONSEQUENCE = b"lost contact with another rank"

    def __init__(self, nproc: int, attempt: int, run_dir: str | None = None):
        self.folder = Path(tempfile.mkdtemp(prefix="autopar-ranks-"))
        self.nproc, self.attempt, self.run_dir = nproc, attempt, run_dir
        self.cause_rank: int | None = None
        self.stop_received: set[int] = set()  # ranks that said a stop signal reached them (STOP_RECEIVED)
        self.stopping = False  # True once the launcher stops the ranks itself
        self._decided = threading.Event()  # set once the cause is known
        self._procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        self._console = threading.Lock()

    def where(self) -> str:
        """Where the logs will be: the run folder's logs/ (if the run got as far as making it), else here."""
        return str(Path(self.run_dir) / LOGS_DIR / "rank_N.log") if self.run_dir else str(self.folder / "rank_N.log")

    def follow(self, procs: list[subprocess.Popen]) -> None:
        self._procs = procs
        for rank, proc in enumerate(procs):
            thread = threading.Thread(target=self._pump, args=(rank, proc.stderr), daemon=True)
            thread.start()
            self._threads.append(thread)

    def collapse(self, cause_rank: int, drain_s: float = 1.0) -> None:
        """From now on only `cause_rank` speaks in full; first let its last words (a traceback) through."""
        self.cause_rank = cause_rank
        self._decided.set()
        self._threads[cause_rank].join(timeout=drain_s)

    def _pump(self, rank: int, pipe) -> None:
        pending = b""
        before, _, after = STOP_RECEIVED.format(rank=rank, signal="\n").partition("\n")
        announcement = re.compile(re.escape(before.encode()) + rb"SIG[A-Z]+" + re.escape(after.encode()))
        with open(self.folder / f"rank_{rank}.log", "wb") as log:
            while chunk := os.read(pipe.fileno(), 65536):
                log.write(chunk)
                log.flush()
                if not self.stopping and announcement.search(chunk):  # (the line is written in one piece)
                    self.stop_received.add(rank)
                if self.cause_rank is None and self._another_failed(rank):
                    self._decided.wait(timeout=1.0)  # a peer's death reached us before the launcher's poll did
                if self.cause_rank is None or rank == self.cause_rank:
                    self._show(pending + chunk)  # as it comes: a progress bar's carriage returns included
                    pending = b""
                    continue
                *lines, pending = (pending + chunk).split(b"\n")
                self._show(b"".join(line + b"\n" for line in lines
                                    if line.startswith(b"autopar: ") and self.CONSEQUENCE not in line))
        pipe.close()

    def _another_failed(self, rank: int) -> bool:
        return any(r != rank and proc.poll() not in (None, 0, PREEMPTED_EXIT) for r, proc in enumerate(self._procs))

    def _show(self, data: bytes) -> None:
        if data:
            with self._console:
                sys.stderr.buffer.write(data)
                sys.stderr.buffer.flush()

    def finish(self) -> None:
        for thread in self._threads:
            thread.join(timeout=5.0)

    def keep(self, run_dir: str | None, *, failed: bool) -> str | None:
        """Move the non-empty logs into RUN/logs (appended, after a header, on a restart or resume); without a
        run folder keep them where they are if the job failed. Returns where they are, or None."""
        logs = [p for p in sorted(self.folder.glob("rank_*.log")) if p.stat().st_size]
        target = Path(run_dir) / LOGS_DIR if run_dir is not None and Path(run_dir).is_dir() else None
        if target is None or not logs:
            if not (failed and logs):
                shutil.rmtree(self.folder, ignore_errors=True)
                return None
            return str(self.folder)
        target.mkdir(exist_ok=True)
        stamp = datetime.now().isoformat(timespec="seconds")
        for path in logs:
            with open(target / path.name, "ab") as out:
                out.write(f"--- {stamp}, start {self.attempt} of this job, {self.nproc} ranks ---\n".encode())
                out.write(path.read_bytes())
        shutil.rmtree(self.folder, ignore_errors=True)
        return str(target)


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
