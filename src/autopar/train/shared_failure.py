"""One failure, told on every rank, as one autopar error naming the rank it happened on.

When one rank's set-up (tracing, partitioning, building and materialising its stages,
tensor-parallel planning) or one of its steps fails, its peers are left waiting in a
collective it never joins: they see "Connection closed by peer" when its process ends, or
wait for the timeout, and the cause is printed on one rank only, often as a bare torch
traceback. Here instead:

- the failing rank writes its error, as one line, to the job's store (the key-value store the
  process group was formed on: reading and writing it needs no collective);
- set-up ends with an agreement through that store: each rank writes "ok" or its error and
  reads the others' before any step runs, so every rank raises the same error before step 1;
- a failing rank waits a moment for every peer to answer; a peer that does not (it is blocked
  in a collective) is released by tearing this rank's process groups down: its collective
  then fails at once, and it raises the error found in the store instead of the connection
  error. A failure every rank meets alike (a refusal) tears nothing down.

A rank killed outright writes nothing: its peers report the lost connection, and the
launcher names the rank. Errors raised by the model's own code, or by torch ops on it,
during set-up become a ModelError saying where (the original stays chained as __cause__).
"""

from __future__ import annotations

import gc
import itertools
import json
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed as dist
from torch import nn

from .. import errors
from .._torch_internals import default_store
from ..distributed import destroy_groups, process_groups
from ..errors import AutoparError, DistributedError, ModelError, Preempted
from ..trace.failure import describe_node, describe_user_frame, failing_node

ANSWER_S = 3.0  # a failing rank waits this long for every peer's answer before tearing its groups down,
RELEASED_S = 15.0  # ... then this long more, for the peers it released
CAUSE_S = 2.0  # a rank whose collective failed looks this long for the error of the rank that failed (written
# before that rank released it: the wait covers the store's latency only)
HEAD_START_S = 1.0  # a rank raising another's error waits this long, so the failing rank is seen (and reported
# by the launcher) first
POLL_S = 0.02
_PREFIX = "autopar/outcome"
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
              "Timed out", "timed out", "Timeout", "NCCL communicator was aborted")
_sections = itertools.count()  # every rank passes the same guarded sections in the same order
_kept_stores: list = []  # stores kept alive after a teardown (rank 0 serves one; its peers still read it)


def run_set_up(set_up: Callable[[], Any], *, model: nn.Module, timeout_s: float,
               forget: Callable[[], None] = lambda: None) -> None:
    """`set_up()` on this rank, then the agreement: returns when every rank's set-up succeeded; otherwise
    raises, on every rank, the same AutoparError naming the rank that failed and what failed. `forget()` drops
    the caller's references to what set-up built (its process groups among them), before they are torn down."""
    section = next(_sections)
    try:
        set_up()
    except Preempted:
        raise
    except Exception as exc:
        _raise_shared(exc, section, "in set-up", convert=lambda e: as_model_error(e, model), forget=forget)
    board = _Board.open(section)
    if board is not None:
        board.write(board.rank, {"kind": "ok"})
        board.agree(timeout_s)


@contextmanager
def failures_shared(where: Callable[[], str], forget: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Around the steps: a failure on this rank is written for its peers (and they are released if blocked);
    a collective that failed because a peer went away raises that peer's error. `where()` names what this
    rank was doing ('step 3'). An error that is not an autopar error is raised again as it is on the failing
    rank (its traceback is the report) and as a DistributedError naming it on the others."""
    section = next(_sections)
    try:
        yield
    except Preempted:
        raise
    except Exception as exc:
        _raise_shared(exc, section, f"in {where()}", convert=lambda e: e, forget=forget)


def as_model_error(exc: BaseException, model: nn.Module | None) -> AutoparError:
    """An error raised while autopar worked on the user's model, as one line saying where."""
    if isinstance(exc, AutoparError):
        return exc
    name = type(model).__name__ if model is not None else "the model"
    what = f"{type(exc).__name__}: {_first_line(exc)}"
    node = failing_node(exc)
    if node is not None:
        return ModelError(f"{name} failed in {describe_node(node)}: {what}; the traced graph of this op failed "
                          f"on this rank's values: reproduce it by running the model in one process")
    frame = describe_user_frame(exc, model)
    if frame is not None:
        return ModelError(f"{name}'s own code failed in {frame}: {what}; it fails the same way in one process "
                          f"on this rank's host: fix it there")
    return ModelError(f"autopar could not set up {name}: {what} (inside autopar or torch, not in the model's "
                      f"code; the full traceback is chained to this error): please report it")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else "(no message)"


def lost_peer(exc: BaseException) -> bool:
    """True for the errors a collective raises when a peer went away or never came (gloo, NCCL, timeouts)."""
    if isinstance(exc, (dist.DistError, TimeoutError, ConnectionError, DistributedError)):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _LOST_PEER)


def _raise_shared(exc: Exception, section: int, phase: str, convert: Callable[[Exception], BaseException],
                  forget: Callable[[], None]):
    board = _Board.open(section)
    if board is None:  # a world of one, or before the process group exists: nobody waits for this rank
        error = convert(exc)
        if error is exc:
            raise exc
        raise error from exc
    if lost_peer(exc):
        cause = board.first_failure(CAUSE_S)
        if cause is not None:
            board.write(board.rank, {"kind": "followed", "rank": cause[0]})
            board.release_peers(exc, forget)  # a peer blocked on this rank (a chain of stages) is released in turn
            time.sleep(HEAD_START_S)
            raise board.error_of(*cause) from None  # the lost connection is a consequence: the cause is above
        if not isinstance(exc, AutoparError):  # a peer went away without a word (killed, out of memory)
            message = (f"rank {board.rank} of {board.world} lost contact with another rank {phase} "
                       f"({type(exc).__name__}: {_first_line(exc)}); that rank stopped without a message "
                       f"(killed, out of memory) or did not answer within the timeout: the launcher names it")
            board.write(board.rank, {"kind": "DistributedError", "message": message, "own": message})
            board.release_peers(exc, forget)
            raise DistributedError(message) from None  # (the message quotes the connection error)
    error = convert(exc)
    kind = type(error).__name__ if isinstance(error, AutoparError) else "DistributedError"
    line = str(error) if isinstance(error, AutoparError) else (
        f"{type(exc).__name__}: {_first_line(exc)} (its traceback is printed by that rank)")
    message = f"rank {board.rank} of {board.world} failed {phase}: {line}"
    board.write(board.rank, {"kind": kind, "message": message, "own": line})
    answers = board.answers(ANSWER_S)
    if len(answers) < board.world:  # some peer is blocked in a collective: release it, give it time to read
        board.release_peers(exc, forget)
        answers = board.answers(RELEASED_S)
    if error is exc and not isinstance(exc, AutoparError):
        raise exc  # a bug: its traceback is the report; the peers raise its one line
    if len(answers) == board.world and all(a["kind"] not in ("ok", "followed") for a in answers.values()):
        if error is exc:
            raise exc  # every rank failed on its own (a refusal each found): each says it as it is
        raise error from exc
    raise type(error)(message) from exc  # the others raise this same line


class _Board:
    """This section's outcomes in the job's store: one key per rank."""

    def __init__(self, store, section: int):
        self.store, self.section = store, section
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.lost = False  # the store's server (rank 0's process) went away: nothing more will be read

    @classmethod
    def open(cls, section: int) -> _Board | None:
        store = _job_store()
        return None if store is None else cls(store, section)

    def key(self, rank: int) -> str:
        return f"{_PREFIX}/{self.section}/{rank}"

    def write(self, rank: int, outcome: dict) -> None:
        self.store.set(self.key(rank), json.dumps(outcome))

    def read(self, rank: int) -> dict | None:
        if self.lost:
            return None
        try:
            if not self.store.check([self.key(rank)]):
                return None
            return json.loads(self.store.get(self.key(rank)))
        except (RuntimeError, ValueError):  # the store's server went away with its rank: waiting cannot help,
            self.lost = True  # and the launcher stops this rank a few seconds after that one ended
            return None

    def answers(self, wait_s: float) -> dict[int, dict]:
        """Every rank's outcome written so far, waiting up to `wait_s` for all of them."""
        deadline = time.monotonic() + wait_s
        found: dict[int, dict] = {}
        while True:
            for r in range(self.world):
                if r not in found and (outcome := self.read(r)) is not None:
                    found[r] = outcome
            if len(found) == self.world or self.lost or time.monotonic() > deadline:
                return found
            time.sleep(POLL_S)

    def first_failure(self, wait_s: float) -> tuple[int, dict] | None:
        """(rank, outcome) of a rank that failed on its own, waiting up to `wait_s` for one to be written."""
        deadline = time.monotonic() + wait_s
        while True:
            for r in range(self.world):
                outcome = self.read(r) if r != self.rank else None
                if outcome is not None and outcome["kind"] not in ("ok", "followed"):
                    return r, outcome
            if self.lost or time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)

    def agree(self, timeout_s: float) -> None:
        """Set-up's end on a rank that succeeded: returns when every rank succeeded, raises the first failure."""
        deadline = time.monotonic() + timeout_s
        while True:
            answers = self.answers(0)
            failed = next(((r, a) for r, a in sorted(answers.items()) if a["kind"] not in ("ok", "followed")), None)
            if failed is not None:
                time.sleep(HEAD_START_S)
                raise self.error_of(*failed)
            if len(answers) == self.world:
                return
            if self.lost:
                raise DistributedError(f"rank 0, which keeps the job's key-value store, ended during set-up (rank "
                                       f"{self.rank} had finished its own): see rank 0's message")
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - set(answers))
                raise DistributedError(f"rank(s) {missing} did not finish set-up within the timeout of "
                                       f"{timeout_s:g} s (rank {self.rank} did); raise --timeout-s if their set-up "
                                       f"is slow, or see their messages")
            time.sleep(POLL_S)

    @staticmethod
    def error_of(rank: int, outcome: dict) -> AutoparError:
        kind = getattr(errors, outcome.get("kind", ""), None)
        kind = kind if isinstance(kind, type) and issubclass(kind, AutoparError) else DistributedError
        return kind(outcome.get("message") or f"rank {rank} failed")

    def release_peers(self, exc: BaseException, forget: Callable[[], None]) -> None:
        """Tear this process's groups down (the default one too): peers blocked in a collective with it fail at
        once instead of at the timeout. A group closes its connections when its last reference goes, so the
        caller's references (`forget`) and the failed frames' local variables go first. The store stays alive
        (rank 0 serves it to the others)."""
        _kept_stores.append(self.store)
        if not dist.is_initialized():
            return
        forget()
        traceback.clear_frames(exc.__traceback__)
        destroy_groups(process_groups())
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):
            pass
        gc.collect()  # the groups close their connections when the last reference goes


def _job_store():
    """The store of the default process group; None without one, or in a world of one.

    Without it (a torch lacking the private accessor) failures are raised on their rank only.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return default_store()
