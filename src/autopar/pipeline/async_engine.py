"""PipeDream-2BW: the pipeline engine run without a flush between steps, on two weight versions.

The trainer's loop is unchanged: forward_backward(step t), clip, optimizer step. What differs
is what a step contains on each rank (pipeline/async_schedules.py: the backwards of all of
step t and the forwards that fill the pipe, some of them step t+1's), which weights each
micro-batch runs on (pipeline/weight_versions.py: step t on W(t-1), the look-ahead on W(t)),
and that the runtime's in-flight state carries from one call to the next. The pipeline
drains (a flush) after the last step and after every step followed by an eval or a
checkpoint, so evaluation runs on the newest weights with nothing in flight and a checkpoint
holds exactly the two versions, the optimizer state and the step: resuming continues the
same trajectory.

Transfers: every step's lists come from `async_lowering.lower_calls`: batched send/receive
groups (one `batch_isend_irecv` per group, as the flushing schedules post them), with both ends
of every group in the same step, so NCCL cannot deadlock when two ranks send to each other.

Gradients: step t's gradient is complete on a rank when its segment ends; it is then summed
over data-parallel replicas in one go (a wait among the replicas of one stage, which run the
same lists), not overlapped with the backward. Tied weights are summed over their stages with
an asynchronous all-reduce: the first owner (the lowest stage, the last to finish a step) waits
for it at once (the others posted theirs earlier), the others only before the update.

The update is deferred (train/deferred.py, rule "global"): the trainer posts step t's loss and
squared norm as one asynchronous all-reduce and returns; this engine asks for the update
(`update_hook`) just before the first forward that needs W(t+1), a look-ahead forward of step
t+2 inside step t+1, or at the end of step t+1 on a stage that has none (the last). So no rank
waits for another between steps, and the steady state has no bubble beyond the transfers; the
update, its global norm and its skip decision are those of the synchronous loop, applied later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..dropout import active_scope, dropout_step, micro_batch
from ..errors import ConfigError
from .async_lowering import lower_calls
from .async_schedules import flush_steps, segment
from .engine import PipelineEngine
from .runtime import InFlight
from .weight_versions import StageSlots, TwoWeightVersions

VERSIONS_MODULE = "pipedream_2bw"  # the older versions' buffers live under this name in checkpoints


def check_two_version_checkpoint(path: Path) -> None:
    """A 2BW run resumes only a 2BW checkpoint: it needs the older version, which others lack."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if not any(key.startswith(f"model.{VERSIONS_MODULE}.") for key in keys):
        raise ConfigError(f"--resume {str(path)!r}: this checkpoint was not written by a pipedream-2bw run (it "
                          f"holds one weight version; 2BW's next step needs the one before the last update "
                          f"too); resume it with its own schedule, or start a new 2BW run")


class NoFlushPipelineEngine(PipelineEngine):
    """What the no-flush engines (2BW, weight stashing) share: the pipe must have drained before an eval or a
    checkpoint (the trainer flushes first; micro-batches still in flight here would be a bug), the metrics
    report how many weight storages were alive at the peak, and the deferred update's hooks
    (train/deferred.py): `drains`, `finish_gradients`, `clip_groups`, `update_hook`."""

    label = "no-flush pipeline"  # named in the errors
    update_hook = None  # set by the trainer: applies the oldest outstanding update (rule "global")
    flush_after: frozenset[int] = frozenset()
    _tied_work: list = []

    def drains(self, step: int) -> bool:
        """Whether the pipeline is empty after `step` (before an eval, a checkpoint, the end)."""
        return step in self.flush_after

    def _reduce_tied_async(self) -> None:
        """Tied weights: their stages' gradients summed; the first owner waits now (it needs the sum for the
        norm and, being the lowest stage, is the last to post), the others in `finish_gradients`."""
        self._tied_work = []
        for param, group, first in self._shared:
            work = torch.distributed.all_reduce(param.grad, group=group, async_op=True)
            if first:
                with self.waits.timed("pipeline"):
                    work.wait()
            else:
                self._tied_work.append(work)

    def finish_gradients(self) -> None:
        """Before the update: tied gradients summed everywhere."""
        with self.waits.timed("pipeline"):
            for work in self._tied_work:
                work.wait()
        self._tied_work = []

    def clip_groups(self) -> list[list[torch.nn.Parameter]]:
        """Per-stage clipping (rule "per-stage"): this stage's own parameters, and each parameter tied
        across stages on its own (so every owner scales it alike, by the norm of its summed gradient)."""
        tied = [param for param, _, _ in self._shared]
        own = [p for p in self.sync.params if all(p is not q for q in tied)]
        return [own] + [[p] for p in tied]

    def take_held_gradients(self) -> list[list[torch.nn.Parameter]]:
        """Stopping between drains: gradients computed but not yet applied, set as the only .grad (clip groups);
        none here (PipeDream's delayed tied gradients are, pipeline/async_stash_engine.py)."""
        return []

    def abandon_in_flight(self) -> None:
        """Stopping after a non-draining step: the look-ahead forwards are dropped (a resumed run warms up
        and runs them again on the same weights); posted receives are waited for first."""
        for pending in self.carry.pending.values():
            pending.wait()
        self.carry = InFlight()

    @torch.no_grad()
    def eval_sums(self, batches, eval_loss):
        if not self.carry.empty():
            raise RuntimeError(f"{self.label}: eval with micro-batches in flight; the pipeline must drain first")
        return super().eval_sums(batches, eval_loss)

    def before_checkpoint(self) -> None:
        if not self.carry.empty():
            raise RuntimeError(f"{self.label}: checkpoint with micro-batches in flight; the pipeline must drain first")

    def step_stats(self, elapsed: float, peak_bytes: int) -> dict:
        return {**super().step_stats(elapsed, peak_bytes), "weight_storages": self.peak_storages}


class PipeDream2BWEngine(NoFlushPipelineEngine):
    """This rank's stages run by the no-flush 2BW lists; see the module docstring."""

    label = "2BW"
    deferred_rule = "global"

    def __init__(self, model, mesh, *, num_microbatches: int, steps: int, eval_every: int, checkpoint_every: int,
                 batches_for_step: Callable[[int], list[dict]],
                 samples_for_step: Callable[[int], list[list[int]]] | None = None, **kwargs):
        super().__init__(model, mesh, num_microbatches=num_microbatches, **kwargs)
        self.m, self.steps = num_microbatches, steps
        self.calls: dict[int, list] = {}  # step -> this rank's lowered actions (built at the first step)
        self.flush_after = flush_steps(steps, eval_every=eval_every, checkpoint_every=checkpoint_every)
        self.batches_for_step, self.samples_for_step = batches_for_step, samples_for_step
        params = {}
        for name, p in self.module.named_parameters():
            params.setdefault(name, p)
        self.versions = TwoWeightVersions(params)
        self.module.add_module(VERSIONS_MODULE, self.versions)
        index_of = {id(p): i for i, p in enumerate(params.values())}
        self.slots = {s: StageSlots(stage, index_of) for s, stage in self.stages.items()}
        self.carry = InFlight()
        self.peak_storages = 0

    def banner_lines(self) -> list[str]:
        return super().banner_lines() + [
            f"pipedream-2bw: no flush between steps (drains before eval, checkpoints and the end); two weight "
            f"versions per rank, {self.versions.nbytes() / 2**20:.2f} MiB on this rank; step t computes on W(t-1)"]

    def run_info(self) -> dict:
        return {"weight_versions": 2, "weight_version_bytes_rank0": self.versions.nbytes()}

    def forward_backward(self, batches: list[dict], loss_fn: Callable[[Any, dict], torch.Tensor]) -> torch.Tensor:
        t = int(self.versions.step)
        drain = t in self.flush_after
        self.module.train()
        by_id = {t * self.m + j: b for j, b in enumerate(batches)}
        if not drain:
            by_id.update({(t + 1) * self.m + j: b for j, b in enumerate(self.batches_for_step(t + 1))})
        for batch in by_id.values():  # on every pp rank: an error, never a hang
            self.pipe.first_stage_inputs(batch)
        if not self.calls:
            self._plan(t)
        actions = self.calls[t]
        step = self.runtime.run(actions, by_id, loss_fn=loss_fn, record=True, forward_scope=self._scope(t),
                                carry=self.carry)
        if drain and not self.carry.empty():
            raise RuntimeError(f"2BW: the pipeline did not drain at step {t + 1} on pipeline rank {self.pp_rank}")
        self._newest_needed()  # step t-1's update, if no look-ahead forward asked for it (the last stage)
        self.last_step = step  # timing read on demand (PipelineEngine.last_events)
        self.peak_storages = max(self.peak_storages, len(self.versions.storages()))
        self.versions.gradients_to_parameters()
        with self.waits.timed("data_parallel"):
            self.sync.finish()  # copies into the dp buckets and sums them over replicas
        self._reduce_tied_async()
        self.versions.advance()  # the Parameters now hold the buffer the optimizer will update
        return step.loss if self.tp_rank == 0 else torch.zeros_like(step.loss)

    def _newest_needed(self) -> None:
        """The Parameters must hold the newest weights W(t) now: apply the outstanding update (deferred loop)."""
        if self.update_hook is not None:
            self.update_hook()

    def abandon_in_flight(self) -> None:
        super().abandon_in_flight()
        self.versions.drop_look_ahead()

    def _plan(self, first: int) -> None:
        """The lists of every step from `first` (0, or the resumed step) to the end, lowered into batched
        communication groups with both ends of each in one step (pipeline/async_lowering.py: NCCL-safe)."""
        compute, warm = {}, True
        for u in range(first, self.steps):
            drain = u in self.flush_after
            compute[u] = {s: segment(s, pp=self.pp, m=self.m, step=u, warm=warm, drain=drain) for s in range(self.pp)}
            warm = drain
        lowered = lower_calls(compute, pp=self.pp, flush_after=self.flush_after)
        self.calls = {u: lowered[u][self.pp_rank] for u in compute}

    def _scope(self, t: int) -> Callable[[int, int], contextlib.AbstractContextManager]:
        @contextlib.contextmanager
        def scope(stage: int, microbatch: int) -> Iterator[None]:
            batch_step, j = divmod(microbatch, self.m)
            if batch_step == t + 1:  # a look-ahead forward: it runs on W(t), so step t-1's update is due
                self._newest_needed()
            with self.slots[stage].running_on(self.versions.leaves(batch_step)), self._dropout(t, batch_step, j):
                yield
        return scope

    def _dropout(self, t: int, batch_step: int, j: int) -> contextlib.AbstractContextManager:
        """Micro-batch j of step `batch_step` draws the masks one process draws for it (the trainer
        opened step t's scope; a look-ahead micro-batch gets step t+1's)."""
        scope = active_scope()
        if batch_step == t or scope is None:
            return micro_batch(j)
        if self.samples_for_step is None:
            raise RuntimeError("2BW look-ahead forwards need the next step's sample indices (samples_for_step)")
        stack = contextlib.ExitStack()
        stack.enter_context(dropout_step(scope.seed, batch_step, self.samples_for_step(batch_step)))
        stack.enter_context(micro_batch(j))
        return stack
