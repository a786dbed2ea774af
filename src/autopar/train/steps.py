"""One optimizer step, as the training loop sees it: `Steps.run` returns every step whose result is known.

Two kinds implement it, and the loop does not ask which it holds:

- `SynchronousSteps`: every rank agrees on the loss, the gradient norm and the skip decision at
  the end of the step, then updates; each call reports its own step.
- `DeferredEngineSteps`: the no-flush pipelines (train/deferred.py), whose update may wait for a
  later step; a call reports the steps settled during it (none, one or several, in order).

`steps_for` picks the kind from the engine (its `deferred_rule`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from ..dropout import dropout_step
from .deferred import DeferredEngine, DeferredSteps, Finished, StepResult
from .inputs import BatchLoader, Losses
from .loss import Batch, main_input, tokens_in
from .metrics import peak_memory_bytes

HOST_SYNCS_PER_STEP = ("clip_gradients", "train_step")
"""Where a training step makes the host wait for the device, once each: the engine's gradient
norm (to clip and to log) and one read of the summed loss with the peak memory (to log), in
`SynchronousSteps.train_step`. Steps that write metrics add the engine's `step_stats` (one read on
a pipeline); a pipeline's first step reads the shapes of its transfers (p2p metadata).
tests/test_host_syncs.py counts."""


class StopFlag(Protocol):
    requested: bool  # this rank was asked to stop (SIGTERM/SIGINT; train/interrupt.py)


class Steps(Protocol):
    """What the training loop runs each step."""

    def run(self, step: int, stop: StopFlag) -> list[Finished]:
        """Run step `step` (0-based); returns every step whose result is now known, in step order.
        `stop.requested` is read as the step starts and travels with its loss to every rank."""

    def settle_for_stop(self) -> list[Finished]:
        """Stopping mid-run: settle the steps already run and drop work started for later ones."""


@dataclass(frozen=True)
class StepInputs:
    """This rank's micro-batches of a step, their global sample positions, the loss and the step's tokens."""

    batches: list[Batch]
    samples: list[list[int]]
    loss_fn: Callable[[Any, Batch], torch.Tensor]
    tokens: int  # in the global batch


class StepsBase:
    """What both kinds share: a step's inputs, and its forward and backward with one process's dropout masks."""

    def __init__(self, *, engine: Any, loader: BatchLoader, losses: Losses, train_data: Any, seed: int,
                 dp_size: int):
        self.engine, self.loader, self.losses, self.train_data = engine, loader, losses, train_data
        self.seed, self.dp_size = seed, dp_size
        self.random_ops_checked = False  # the first step scans a model run whole for random draws (dropout/eager.py)

    def inputs(self, step: int) -> StepInputs:
        batches = self.loader.local_batches(step, self.train_data)
        global_count = self.losses.global_target_count(batches)
        return StepInputs(batches, self.loader.local_positions(step),
                          lambda output, batch: self.losses.train(output, batch, global_count),
                          self._global_tokens(batches))

    def _global_tokens(self, batches: list[Batch]) -> int:
        """Tokens in the global batch, from this replica's share of it (shares may be uneven: data/shares.py)."""
        local_samples = sum(len(main_input(b)) for b in batches)
        return sum(tokens_in(b) for b in batches) * self.loader.config.global_batch_size // max(1, local_samples)

    def forward_backward(self, step: int, inputs: StepInputs) -> torch.Tensor:
        with dropout_step(self.seed, step, inputs.samples, scan_random_ops=self._first_scan()):  # as one process
            return self.engine.forward_backward(inputs.batches, inputs.loss_fn)

    def _first_scan(self) -> bool:
        """True on the first step only: it checks every operation for random draws (~20% of a small model's
        step on the whole-model engines); later steps check only the torch calls the model makes."""
        first, self.random_ops_checked = not self.random_ops_checked, True
        return first

    def settle_for_stop(self) -> list[Finished]:
        return []


class SynchronousSteps(StepsBase):
    """Every rank meets at the end of each step (loss, norm, skip, stop), then updates."""

    def __init__(self, *, optimizer: Any, scheduler: Any, grad_clip: float, device: torch.device, **common: Any):
        super().__init__(**common)
        self.optimizer, self.scheduler, self.grad_clip, self.device = optimizer, scheduler, grad_clip, device

    def run(self, step: int, stop: StopFlag) -> list[Finished]:
        self.engine.waits.start_step()  # where the step's time starts
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
        return [Finished(step + 1, self.train_step(step, stop_requested=stop.requested), lr)]

    def train_step(self, step: int, *, stop_requested: bool = False) -> StepResult:
        """One optimizer step, with the peak memory over all ranks (bytes). A step whose loss or gradient norm
        is not finite on any rank is skipped on every rank (no update). `stop_requested` travels in the same
        all-reduce as the loss, so every rank learns whether any rank asked to stop.

        Its host waits (HOST_SYNCS_PER_STEP): the engine's gradient norm, and one read of the
        summed loss, the skip and stop flags and the peak memory, before the update they decide.
        """
        inputs = self.inputs(step)
        total = self.forward_backward(step, inputs)
        grad_norm = self.engine.clip_gradients(self.grad_clip if self.grad_clip > 0 else float("inf"))
        # [loss share, bad gradient norm, stop requested], summed over every rank that holds a loss share
        # (replicas; the last pipeline stage), and the peak memory: read once, before the update they decide
        bad_norm = grad_norm is not None and not math.isfinite(grad_norm)  # None: the engine has no norm here
        flags = torch.tensor([0.0, float(bad_norm), float(stop_requested)], device=self.device)
        flags[0] = total.detach().float().reshape(())
        with self.engine.waits.timed("pipeline"):  # every rank meets here (a pipeline's flush ends here)
            dist.all_reduce(flags)
        peak = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.float64, device=self.device)
        with self.engine.waits.timed("pipeline"):
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        loss, bad_norm, stop, peak_bytes = torch.cat([flags.double(), peak]).tolist()  # one host read; exact
        skipped = not math.isfinite(loss) or bad_norm > 0
        if not skipped:
            self.optimizer.step()
        self.scheduler.step()  # the schedule follows the step number, skipped steps included
        self.engine.zero_grad()
        return StepResult(loss, grad_norm, inputs.tokens, skipped=skipped, stop=stop > 0, peak_bytes=int(peak_bytes))


class DeferredEngineSteps(StepsBase):
    """Steps of an engine whose update may wait for later steps: DeferredSteps decides when each lands."""

    def __init__(self, *, deferred: DeferredSteps, **common: Any):
        super().__init__(**common)
        self.deferred = deferred

    def run(self, step: int, stop: StopFlag) -> list[Finished]:
        self.engine.waits.start_step()  # where the step's time starts (and `began`, for the statistics)
        began = time.perf_counter()
        inputs = self.inputs(step)
        return self.deferred.step(step, lambda: self.forward_backward(step, inputs), tokens=inputs.tokens,
                                  stop_requested=stop.requested, began=began)

    def settle_for_stop(self) -> list[Finished]:
        settled = self.deferred.settle()  # later steps already ran: settle them, drop the rest
        self.engine.abandon_in_flight()
        return settled


def steps_for(engine: Any, *, mesh: Any, pp: int, optimizer: Any, scheduler: Any, grad_clip: float,
              device: torch.device, **common: Any) -> SynchronousSteps | DeferredEngineSteps:
    """The kind of steps `engine` runs: deferred when it declares a `deferred_rule`, else synchronous."""
    if getattr(engine, "deferred_rule", None) is None:
        return SynchronousSteps(engine=engine, optimizer=optimizer, scheduler=scheduler, grad_clip=grad_clip,
                                device=device, **common)
    deferred_engine: DeferredEngine = engine
    dp = mesh.dp_size  # this rank's squared-norm slot: pp rank * replicas + replica
    deferred = DeferredSteps(engine=deferred_engine, optimizer=optimizer, scheduler=scheduler, grad_clip=grad_clip,
                             device=device, pp=pp, slot=mesh.local_rank("pp") * dp + mesh.local_rank("dp"),
                             slots=pp * dp)
    return DeferredEngineSteps(engine=engine, deferred=deferred, **common)
