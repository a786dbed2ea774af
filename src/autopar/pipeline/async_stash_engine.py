"""PipeDream (weight stashing): the pipeline engine run without a flush, one update per micro-batch.

The paper's semantics (Narayanan et al., SOSP'19), as the trainer runs them: one optimizer
step is one micro-batch per data-parallel replica (global batch = micro-batch size x dp; the
replicas sum their gradients, as PipeDream's replicated stages do), so the learning rate is
the rate of every per-micro-batch update. Stage s's step t runs the forward of micro-batch
t + pp - s - 1 (on the newest weights) and the backward of micro-batch t (on the weights its
forward stashed), then the optimizer updates every stage. The rule this computes, with W_s(k)
stage s's weights after k updates and r the first step of the current pipeline run:

    W(t+1) = opt(W(t), grad f_t(W_0(v_0), ..., W_{pp-1}(v_{pp-1}))),  v_s = max(r, t - (pp-1-s))

and with --vertical-sync v_s = max(r, t - (pp-1)) for every stage. tests/stash_oracle.py runs
it in one process. The pipeline drains (a flush) before each eval and checkpoint and after the
last step; the next step warms up again on the newest weights (so r moves on: an eval or a
checkpoint does change the trajectory, as a restart of PipeDream does). A checkpoint therefore
holds just the newest weights, the optimizer state and the step.

Updates without a meeting (train/deferred.py, rule "per-stage"): each stage updates right after
its backward from what it holds: each clip group (the stage's own parameters; a parameter tied
across stages on its own, by the norm of its summed gradient, so every owner scales it alike) is
clipped by its own norm, and a clip group whose gradient is not finite skips its update (the
others go on). The loss, the global norm (reported, not used) and the skips travel in an
asynchronous all-reduce read pp steps later.

Tied weights (pipeline/async_schedules.py, `tied_steps_due`): a parameter tied across stages
(gpt's embedding and head) takes its summed gradient `tied_delay` steps late (default pp - 1).
Each owner posts step t's sum as an asynchronous all-reduce when its backward is done and waits
for it `tied_delay` steps later, by when the other owner posted it long ago; so its owners do
not meet every step (with tied_delay 0 they do: the last stage's next forward would need stage
0's gradient of the same micro-batch, pp - 1 backwards later). The drain applies what is still
outstanding. Each owner holds up to tied_delay + 1 such gradients.

Memory: stage s holds at most pp - s weight versions (measured: `weight_storages`); with
vertical sync up to pp (every version a later forward will ask for stays, too).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..dropout import active_scope, dropout_step, micro_batch
from .async_lowering import lower_calls
from .async_schedules import flush_steps, runs_of, stash_lists, stash_version, tied_steps_due
from .async_engine import NoFlushPipelineEngine
from .runtime import InFlight
from .weight_versions import StageSlots, StashedVersions


class PipeDreamStashEngine(NoFlushPipelineEngine):
    """This rank's stage runs the no-flush PipeDream lists on stashed weight versions."""

    label = "pipedream"
    deferred_rule = "per-stage"

    def __init__(self, model, mesh, *, steps: int, eval_every: int, checkpoint_every: int, vertical_sync: bool,
                 tied_delay: int | None = None, batches_for_step: Callable[[int], list[dict]],
                 samples_for_step: Callable[[int], list[list[int]]] | None = None, strategy=None, **kwargs):
        # the base pipeline (partition, stages, eval lists) is 1F1B's; the training lists are built here
        super().__init__(model, mesh, num_microbatches=1, strategy=dataclasses.replace(strategy, schedule="1f1b"),
                         **kwargs)
        self.steps, self.vertical_sync = steps, vertical_sync
        self.tied_delay = self.pp - 1 if tied_delay is None else tied_delay
        self.tied_posted: dict[int, deque] = {}  # id(tied parameter) -> (step, its summed gradient, work), oldest first
        self.flush_after = flush_steps(steps, eval_every=eval_every, checkpoint_every=checkpoint_every)
        self.batches_for_step, self.samples_for_step = batches_for_step, samples_for_step
        params = {}
        for name, p in self.module.named_parameters():
            params.setdefault(name, p)
        self.versions = StashedVersions(params)
        index_of = {id(p): i for i, p in enumerate(params.values())}
        self.slots = {s: StageSlots(stage, index_of) for s, stage in self.stages.items()}
        self.carry = InFlight()
        self.calls: dict[int, list] = {}  # step -> this rank's lowered actions (built at the first step)
        self.runs: dict[int, tuple[int, int]] = {}
        self.loaded: dict[int, dict] = {}  # step -> this replica's micro-batch, loaded ahead for stage 0
        self.peak_storages = 0
        self.forwarded = -1  # the last micro-batch this rank has run a forward of, in the current run

    def banner_lines(self) -> list[str]:
        held = "up to pp" if self.vertical_sync else f"up to pp - s = {self.pp - self.pp_rank}"
        return super().banner_lines() + [
            f"pipedream: weight stashing, no flush between steps (drains before eval, checkpoints and the end); "
            f"one micro-batch per replica per optimizer step; {held} weight versions on this rank "
            f"({self.versions.nbytes() / 2**20:.2f} MiB each){'; vertical sync' if self.vertical_sync else ''}"] + (
            [f"pipedream: {len(self._shared)} weight(s) tied across stages on this rank take their summed gradient "
             f"{self.tied_delay} step(s) late (--tied-delay; the drain applies what is held)"] if self._shared else [])

    def run_info(self) -> dict:
        return {"weight_version_bytes_rank0": self.versions.nbytes(), "vertical_sync": self.vertical_sync,
                "tied_delay": self.tied_delay}

    def stages_of_parameters(self) -> dict[str, list[int]]:
        """Parameter name -> the stages that read it (a tied one: several): what the oracle needs."""
        out: dict[str, list[int]] = {}
        for s, spec in enumerate(self.partition.specs):
            for name in spec.params:
                out.setdefault(name, []).append(s)
        return out

    def _plan(self, first: int) -> None:
        steps = range(first, self.steps)
        self.runs = runs_of(steps, self.flush_after)
        lowered = lower_calls(stash_lists(pp=self.pp, steps=steps, flush_after=self.flush_after), pp=self.pp,
                              flush_after=self.flush_after)
        self.calls = {t: lowered[t][self.pp_rank] for t in steps}

    def drains(self, step: int) -> bool:
        return self.runs[step][1] == step

    def _version(self, microbatch: int, stage: int) -> int:
        return stash_version(microbatch, stage, pp=self.pp, run_start=self.runs[microbatch][0],
                             vertical_sync=self.vertical_sync)

    def _batch(self, step: int) -> dict:
        if step not in self.loaded:
            (self.loaded[step],) = self.batches_for_step(step)
        return self.loaded[step]

    def forward_backward(self, batches: list[dict], loss_fn: Callable[[Any, dict], torch.Tensor]) -> torch.Tensor:
        scope = active_scope()
        if scope is None:
            raise RuntimeError("pipedream: forward_backward runs inside the trainer's step scope (dropout_step)")
        t = scope.step
        if not self.calls:
            self._plan(t)
        if t not in self.calls:
            raise RuntimeError(f"pipedream: step {t} is outside the planned steps {min(self.calls)}..{max(self.calls)}")
        start, _ = self.runs[t]
        if t == start:
            self.versions.start(t)
        self.module.train()
        self.loaded[t] = batches[0]
        actions = self.calls[t]
        by_id = {a.microbatch: self._batch(a.microbatch) for a in actions if a.op.is_compute}
        for batch in by_id.values():  # on every pp rank: an error, never a hang
            self.pipe.first_stage_inputs(batch)
        step = self.runtime.run(actions, by_id, loss_fn=loss_fn, record=True, forward_scope=self._scope(t),
                                carry=self.carry)
        if t == self.runs[t][1] and not self.carry.empty():
            raise RuntimeError(f"pipedream: the pipeline did not drain at step {t + 1} on pipeline rank {self.pp_rank}")
        self.last_step = step
        self.peak_storages = max(self.peak_storages, len(self.versions.storages()))
        self.versions.gradients_to_parameters(t)
        with self.waits.timed("data_parallel"):
            self.sync.finish()  # copies into the dp buckets and sums them over replicas
        self._tied_gradients(t)
        self.versions.advance(self._needed_after(t))
        for j in [j for j in self.loaded if j <= t]:
            self.loaded.pop(j)
        return step.loss if self.tp_rank == 0 else torch.zeros_like(step.loss)

    def _tied_gradients(self, t: int) -> None:
        """Tied weights (module docstring): post step t's sum over the owning stages, and give each tied parameter
        the summed gradient the rule makes due at step t (None when none is: the optimizer leaves it as it is)."""
        start, end = self.runs[t]
        due = tied_steps_due(t, run_start=start, run_end=end, delay=self.tied_delay)
        for param, group, _ in self._shared:
            posted = self.tied_posted.setdefault(id(param), deque())
            mine = param.grad.detach().clone()
            posted.append((t, mine, dist.all_reduce(mine, group=group, async_op=True)))
            summed = None
            while posted and posted[0][0] in due:
                _, grad, work = posted.popleft()
                with self.waits.timed("pipeline"):
                    work.wait()
                summed = grad if summed is None else summed + grad
            if posted and (t == end or posted[0][0] < due.start):
                raise RuntimeError(f"pipedream: tied gradients of steps {[u for u, _, _ in posted]} left behind at "
                                   f"step {t + 1}")
            param.grad = summed

    def take_held_gradients(self) -> list[list[torch.nn.Parameter]]:
        """A stop between drains: each tied parameter's gradient becomes the sum of those it has posted and not
        applied yet, every other gradient None, so the trainer applies them as one last update of those parameters
        alone (none is lost). Returns their clip groups."""
        for p in self.sync.params:
            p.grad = None
        groups = []
        for param, _, _ in self._shared:
            posted = self.tied_posted.pop(id(param), deque())
            for _, grad, work in posted:
                with self.waits.timed("pipeline"):
                    work.wait()
                param.grad = grad if param.grad is None else param.grad + grad
            if posted:
                groups.append([param])
        return groups

    def _needed_after(self, t: int) -> range:
        """Versions this rank's forwards after step t still ask for (within the current run): versions grow
        with the micro-batch, so those of the micro-batches after the last forward run so far, a range."""
        start, end = self.runs[t]
        done = max([a.microbatch for a in self.calls[t] if a.op.is_compute] + [t])
        self.forwarded = max(self.forwarded, done) if t > start else done  # a new run starts afresh
        if self.forwarded >= end:
            return range(0)
        return range(min(self._version(self.forwarded + 1, s) for s in self.stages),
                      max(self._version(end, s) for s in self.stages) + 1)

    def _scope(self, t: int) -> Callable[[int, int], contextlib.AbstractContextManager]:
        @contextlib.contextmanager
        def scope(stage: int, microbatch: int) -> Iterator[None]:
            leaves = self.versions.leaves(microbatch, self._version(microbatch, stage))
            with self.slots[stage].running_on(leaves), self._dropout(t, microbatch):
                yield
        return scope

    def _dropout(self, t: int, j: int) -> contextlib.AbstractContextManager:
        """Micro-batch j (step j's only one) draws the masks one process draws for it."""
        scope = active_scope()
        if j == t or scope is None:
            return micro_batch(0)
        if self.samples_for_step is None:
            raise RuntimeError("pipedream look-ahead forwards need the later steps' sample indices (samples_for_step)")
        stack = contextlib.ExitStack()
        stack.enter_context(dropout_step(scope.seed, j, self.samples_for_step(j)))
        stack.enter_context(micro_batch(0))
        return stack
