"""Optimizer steps whose global decisions arrive late: how the no-flush pipelines avoid meeting every step.

The synchronous step (steps.py) ends each step with blocking collectives over all ranks: the
loss, the global gradient norm (to clip) and the skip decision, before the update. On a no-flush
pipeline that meeting is a drain in all but name: the last stage finishes a step (pp-1) backwards
before stage 0 and must wait for it. The rules do not need it:

- PipeDream-2BW ("global" rule): step t's update W(t+1) is first read by step t+2's look-ahead
  forwards inside step t+1 (step t+1 computes on W(t)). So at the end of step t every rank posts
  one asynchronous all-reduce (loss, squared norms, stop flag, statistics) and goes on; the update
  is applied, with the same global norm and skip decision, when the engine first needs W(t+1)
  (`DeferredSteps.apply_oldest`, called by the engine), or at the end of step t+1 at the latest.
- PipeDream ("per-stage" rule): each stage updates after every micro-batch with what it knows
  locally: each clip group (the stage's own parameters; each parameter tied across stages on its
  own) is clipped by its own norm, and a group whose gradient is not finite is left out of the update.
  The all-reduce only reports (loss, global norm, skips) and is read `lag` steps later, by which
  time stage 0 has long contributed.

Before an eval, a checkpoint and at the end (the engine's drain steps) every outstanding step is
settled at once, so those see the newest weights and the loop's order of events is unchanged.
Results (`Finished`) are therefore reported up to one step (2BW) or `lag` steps late, in order,
each with its own step's loss, norm, learning rate, time and statistics.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from ..timing import WaitTally
from .metrics import peak_memory_bytes

HEAD = 3  # [loss share, stop flag, skipped flag] before the slots


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step gives, the same on every rank."""

    loss: float
    grad_norm: float | None  # None: the engine does not compute one (scheduled sparse exchanges)
    tokens: int  # in the global batch
    skipped: bool = False  # loss or gradient norm not finite: no update (per-stage rule: on some stage)
    stop: bool = False  # some rank was asked to stop (SIGTERM/SIGINT)
    peak_bytes: int = 0  # the largest peak memory of any rank, after this step's backward


@dataclass(frozen=True)
class Finished:
    """A step whose result is known: its 1-based number, the result, the rate it used and engine statistics."""

    number: int
    result: StepResult
    lr: float
    stats: dict | None = None


class DeferredEngine(Protocol):
    """What an engine whose update may wait provides, beyond `Engine` (train/base.py): the pipeline's
    PipeDream-2BW and PipeDream engines (pipeline/async_engine.py, pipeline/async_stash_engine.py)."""

    deferred_rule: str  # "global" (one update from the global norm) or "per-stage" (each stage on its own)
    update_hook: Callable[[], None] | None  # set here: the engine calls it when it first needs the next weights
    waits: WaitTally

    def local_squares(self) -> torch.Tensor:
        """This rank's sum of squared gradients (unclipped), on the device."""

    def finish_gradients(self) -> None:
        """Gradients still being summed (tied weights) are complete after this."""

    def scale_to_norm(self, norm: float, max_norm: float, params: list[torch.nn.Parameter] | None = None) -> None:
        """Clip `params` (default: all this rank's) whose joint norm is `norm` to `max_norm`."""

    def clip_groups(self) -> list[list[torch.nn.Parameter]]:
        """Per-stage rule: the groups clipped by their own norm (the stage's own; each tied weight alone)."""

    def take_held_gradients(self) -> list[list[torch.nn.Parameter]]:
        """Per-stage rule: clip groups whose gradients the engine held back for a last update (tied weights)."""

    def drains(self, step: int) -> bool:
        """True when step `step` (0-based) ends in a drain: every outstanding step is settled after it."""

    def stats_slots(self, elapsed: float, peak_bytes: int) -> torch.Tensor:
        """This rank's step statistics as slots of a tensor summed over all ranks."""

    def stats_from_slots(self, slots: torch.Tensor) -> dict:
        """The summed slots back as the metrics record's statistics (with `peak_mem_bytes_per_stage`)."""

    def zero_grad(self) -> None: ...

    def abandon_in_flight(self) -> None:
        """Stopping mid-run: drop work started for steps not run yet (the look-ahead)."""


@dataclass
class _Pending:
    step: int
    vector: torch.Tensor
    work: Any
    tokens: int
    lr: float | None  # per-stage rule: the rate of the update already applied
    applied: bool  # per-stage rule: the update is done, only the report is outstanding


class DeferredSteps:
    """The trainer's side of a deferred-update engine (see the module docstring)."""

    def __init__(self, *, engine: DeferredEngine, optimizer: Any, scheduler: Any, grad_clip: float,
                 device: torch.device, pp: int, slot: int, slots: int):
        self.engine, self.optimizer, self.scheduler = engine, optimizer, scheduler
        self.max_norm = grad_clip if grad_clip > 0 else float("inf")
        self.device, self.pp = device, pp
        self.slot, self.slots = slot, slots  # this rank's squared-norm slot (pp rank * replicas + replica)
        self.rule = engine.deferred_rule
        self.lag = pp  # per-stage rule: a report is read this many steps after its own (stage 0 is long done)
        self.pending: deque[_Pending] = deque()
        self.last_rates: list[float] = []  # per-stage rule: each group's rate in the last update
        self.finished: list[Finished] = []
        engine.update_hook = self.apply_oldest

    def step(self, step: int, forward_backward: Callable[[], torch.Tensor], *, tokens: int, stop_requested: bool,
             began: float) -> list[Finished]:
        """Run step `step` (forward_backward), post its all-reduce, settle what is due; returns what finished.
        `began`: perf_counter at the step's start (the step's time on this rank ends after the update)."""
        total = forward_backward()
        squares = self.engine.local_squares()  # before any clipping: the reported norm is the unclipped one
        lr, skipped, applied = None, False, False
        if self.rule == "per-stage":
            lr, skipped, applied = self.scheduler.get_last_lr()[0], self._update_per_stage(), True
        elapsed = time.perf_counter() - began
        stats = self.engine.stats_slots(elapsed, peak_memory_bytes(self.device)).flatten()
        head = torch.zeros(HEAD + self.slots, dtype=torch.float64, device=self.device)
        head[0] = total.detach().to(torch.float64).reshape(())  # on the device: no host read here
        head[1], head[2] = float(stop_requested), float(skipped)
        head[HEAD + self.slot] = squares.detach().to(torch.float64).reshape(())
        vector = torch.cat([head, stats.to(self.device)])
        work = dist.all_reduce(vector, async_op=True)
        self.pending.append(_Pending(step, vector, work, tokens, lr, applied))
        if self.engine.drains(step):
            self._settle_all()
        elif self.rule == "per-stage":
            while self.pending and self.pending[0].step <= step - self.lag:
                self._finish(self.pending.popleft())
        out, self.finished = self.finished, []
        return out

    def settle(self) -> list[Finished]:
        """Apply (2BW) or collect every outstanding step: the weights are then the newest. Returns them."""
        self._settle_all()
        held = self.engine.take_held_gradients()
        if held:  # per-stage rule: gradients the engine delayed (tied weights) as one last update of their own,
            # at the rate of the last step (the scheduler has moved on to the next one's)
            rates = [group["lr"] for group in self.optimizer.param_groups]
            for group, rate in zip(self.optimizer.param_groups, self.last_rates):
                group["lr"] = rate
            self._clipped_update(held)
            for group, rate in zip(self.optimizer.param_groups, rates):
                group["lr"] = rate
            self.engine.zero_grad()
        out, self.finished = self.finished, []
        return out

    def _settle_all(self) -> None:
        while self.pending:
            if self.pending[0].applied:
                self._finish(self.pending.popleft())
            else:
                self.apply_oldest()

    def apply_oldest(self) -> None:
        """The global rule: the oldest step's update, with its global norm and skip decision (the engine
        calls this when it first needs the next weights; a no-op when nothing is outstanding)."""
        if not self.pending or self.pending[0].applied:
            return
        pending = self.pending.popleft()
        with self.engine.waits.timed("pipeline"):  # for the stage that posted step t last (stage 0)
            pending.work.wait()
        loss, norm = self._loss_and_norm(pending.vector)
        self.engine.finish_gradients()  # e.g. tied gradients still being summed
        skipped = not math.isfinite(loss) or not math.isfinite(norm)
        self.engine.scale_to_norm(norm, self.max_norm)
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:
            self.optimizer.step()
        self.scheduler.step()  # the schedule follows the step number, skipped steps included
        self.engine.zero_grad()
        pending.lr, pending.applied = lr, True
        self._finish(pending, skipped=skipped)

    def _update_per_stage(self) -> bool:
        """The per-stage rule's update, now, from this rank's gradients only; True if some clip group was left out."""
        self.engine.finish_gradients()
        skipped = self._clipped_update(self.engine.clip_groups())
        self.last_rates = [group["lr"] for group in self.optimizer.param_groups]
        self.scheduler.step()
        self.engine.zero_grad()
        return skipped

    def _clipped_update(self, groups: list[list[torch.nn.Parameter]]) -> bool:
        """Each clip group scaled by its own norm; a group whose gradient is not finite is left out of the update
        (its gradients set to None; so the owners of a tied weight, which see the same gradient, decide alike).
        True if some group was left out."""
        skipped = False
        for params in groups:
            norm = math.sqrt(float(sum(p.grad.double().square().sum() for p in params if p.grad is not None)))
            if not math.isfinite(norm):
                skipped = True
                for p in params:
                    p.grad = None
                continue
            self.engine.scale_to_norm(norm, self.max_norm, params)
        self.optimizer.step()
        return skipped

    def _loss_and_norm(self, vector: torch.Tensor) -> tuple[float, float]:
        """The step's summed loss and this replica's global norm (its pp ranks' slots, in pp order)."""
        values = vector.cpu()
        replicas = self.slots // self.pp
        mine = self.slot % replicas
        squares = sum(float(values[HEAD + s * replicas + mine]) for s in range(self.pp))
        return float(values[0]), math.sqrt(squares)

    def _finish(self, pending: _Pending, skipped: bool | None = None) -> None:
        with self.engine.waits.timed("pipeline"):
            pending.work.wait()
        values = pending.vector.cpu()
        loss, norm = self._loss_and_norm(pending.vector)
        skipped = bool(values[2] > 0) or not math.isfinite(loss) if skipped is None else skipped
        stats = self.engine.stats_from_slots(values[HEAD + self.slots:])
        result = StepResult(loss, norm, pending.tokens, skipped=skipped, stop=bool(values[1] > 0),
                            peak_bytes=int(max(stats["peak_mem_bytes_per_stage"])))
        self.finished.append(Finished(pending.step + 1, result, pending.lr, stats))
