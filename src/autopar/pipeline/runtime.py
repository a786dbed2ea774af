"""Execute one rank's pipeline action list on its stage modules.

The runtime decides nothing: the order of work comes from the schedule (schedules.py),
already checked by the simulator. It keeps, per (stage, micro-batch), the stage's inputs
and outputs until that micro-batch's backward is done, then frees them.

Conventions with the other ranks:
- forward messages carry a stage's outputs, as a tuple of tensors;
- gradient messages carry one tensor per *floating-point* boundary tensor, in order
  (zeros where a value got no gradient); integer and boolean values (masks, ids) cross
  forward only;
- stages on the same rank hand values over directly, without messages.

Recomputation: on a stage listed in `recompute`, F runs without keeping the autograd
graph (only the inputs are kept) and the R action re-runs it with grad before backward.
Zero-bubble I/W (split_backward.py): I computes input gradients and keeps the gradients arriving
at the operations that read weights; W computes only the weight gradients from them, without
running the activation chain again: I + W does the arithmetic of one fused B, plus one autograd
call for all weight branches (measured in benchmarks/pipeline/zero_bubble.py). The runtime keeps
the split's boundary analysis per graph structure (SplitPlanCache), so micro-batches of one shape
pay one graph walk each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..dropout import micro_batch
from ..errors import AutoparError, ModelError
from ..trace.failure import describe_node, failing_node
from ..train.shared_failure import lost_peer
from ..timing import Clock, WaitTally
from .actions import Action, Op, stage_to_rank
from .p2p import P2P, Pending
from .split_backward import backward_input, backward_weight
from .split_plan import SplitPlanCache

FORWARD_MSG, GRAD_MSG = 0, 1


@dataclass
class StepRecord:
    """What one step did on this rank: losses of the micro-batches that ended here, and timing."""

    loss: torch.Tensor  # summed over the micro-batches whose last stage ran here (zeros elsewhere)
    marks: list[tuple[Any, Any, Action]] = field(default_factory=list)  # (start, end, action) as `clock` marks
    clock: Clock | None = None

    @property
    def events(self) -> list[tuple[float, float, Action]]:
        """(start, end, action) in seconds; on CUDA this waits for the step's last event, so read it
        only where the host waits anyway (after the logged loss)."""
        if not self.marks:
            return []
        times = self.clock.seconds([m for start, end, _ in self.marks for m in (start, end)])
        return [(times[2 * i], times[2 * i + 1], action) for i, (_, _, action) in enumerate(self.marks)]


@dataclass
class InFlight:
    """Per (stage, micro-batch) state a step leaves for the next when the pipeline is not drained."""

    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    pending: dict[tuple[str, int, int], Pending] = field(default_factory=dict)  # posted receives
    local: dict = field(default_factory=dict)  # same-rank handoffs
    grads_out: dict = field(default_factory=dict)
    split: dict = field(default_factory=dict)  # after I: the WeightWork W finishes

    def empty(self) -> bool:
        return not any((self.inputs, self.outputs, self.pending, self.local, self.grads_out, self.split))


def _float_positions(values: tuple) -> list[int]:
    return [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.is_floating_point()]


class PipelineRuntime:
    def __init__(self, *, stages: dict[int, nn.Module], num_stages: int, pp: int, pp_rank: int, p2p: P2P,
                 recompute: frozenset[int] = frozenset(),
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 placement: str = "loop", first_input: Callable[[dict], tuple] = lambda b: (b["input_ids"],),
                 waits: WaitTally | None = None):
        """waits: where the time blocked on receives and on sends completing is added (kind "pipeline")."""
        self.stages, self.num_stages, self.pp, self.pp_rank = stages, num_stages, pp, pp_rank
        self.waits = waits if waits is not None else WaitTally()
        self.first_input = first_input
        self.p2p, self.recompute, self.autocast = p2p, recompute, autocast
        self.placement = placement
        self.clock = Clock(p2p.device)  # CUDA events on GPU: timing without host waits
        self.split_plans = SplitPlanCache()  # the I/W split's analysis, per stage graph structure

    def _rank(self, stage: int) -> int:
        return stage_to_rank(stage, self.pp, self.num_stages, self.placement)

    def run(self, actions: list[Action], batches: list[dict], *, loss_fn: Callable[[Any, dict], torch.Tensor],
            record: bool = False,
            sync_context: Callable[[bool], contextlib.AbstractContextManager] | None = None,
            forward_scope: Callable[[int, int], contextlib.AbstractContextManager] | None = None,
            carry: InFlight | None = None) -> StepRecord:
        """Execute `actions` for one step on micro-batches `batches` (every rank gets the same list).

        loss_fn(output, micro-batch) turns the last stage's output into what it returns and
        backward starts from (training's loss, or eval's [loss sum, target count]).

        sync_context(last) wraps each backward; `last` is True for this rank's final one, so a
        gradient synchroniser can overlap its reduction with that backward only.

        forward_scope(stage, micro-batch) wraps each forward and recompute (default: the
        micro-batch's dropout scope); an asynchronous schedule uses it to run the micro-batch
        on the weight version it belongs to. `carry`: the work in flight between calls, for
        schedules that do not drain at the end of a step (pipeline/async_schedules.py); it is
        then updated in place and may be left non-empty.
        """
        state = carry if carry is not None else InFlight()
        inputs, outputs, pending = state.inputs, state.outputs, state.pending
        local, grads_out, split = state.local, state.grads_out, state.split
        forward_scope = forward_scope or (lambda stage, mb: micro_batch(mb))
        loss: torch.Tensor | None = None  # sum of what the last stage's loss_fn returned
        events = []
        backward_ops = (Op.BACKWARD, Op.BACKWARD_WEIGHT)
        last_backward = max((i for i, a in enumerate(actions) if a.op in backward_ops), default=-1)
        sync_context = sync_context or (lambda last: contextlib.nullcontext())
        training = torch.is_grad_enabled()  # False: a forward-only (eval) pass; nothing is kept
        clock = self.clock if record else None
        now = clock.mark if record else (lambda: None)
        if record:
            clock.reset()

        def take(kind: str, stage: int, mb: int) -> tuple:
            key = (kind, stage, mb)
            if key in local:
                return local.pop(key)
            with self.waits.timed("pipeline"):  # blocked until the peer's message is here
                return pending.pop(key).wait()

        def post_step(group: list[Action]) -> None:
            """One communication step (actions carrying the same `step`) as one batched group."""
            sends = [(outputs[(a.stage, a.microbatch)], a.peer, FORWARD_MSG, a.stage + 1, a.microbatch)
                     if a.op == Op.SEND_ACT else
                     (grads_out.pop((a.stage, a.microbatch)), a.peer, GRAD_MSG, a.stage - 1, a.microbatch)
                     for a in group if a.op in (Op.SEND_ACT, Op.SEND_GRAD)]
            receives = [a for a in group if a.op in (Op.RECV_ACT, Op.RECV_GRAD)]
            got = self.p2p.exchange(sends, [(a.peer, FORWARD_MSG if a.op == Op.RECV_ACT else GRAD_MSG, a.stage,
                                             a.microbatch) for a in receives])  # channels: the receiving stage
            for a, received in zip(receives, got):  # gradients keyed by the sending stage, like same-rank handoffs
                pending[("F", a.stage, a.microbatch) if a.op == Op.RECV_ACT else ("B", a.stage + 1, a.microbatch)] = \
                    received

        posted_through = -1  # index of the last action already posted with its step
        for index, action in enumerate(actions):
            s, mb, op = action.stage, action.microbatch, action.op
            began = now()
            if op.is_comm and action.step is not None:
                if index > posted_through:
                    end = index
                    while end + 1 < len(actions) and actions[end + 1].op.is_comm and \
                            actions[end + 1].step == action.step:
                        end += 1
                    post_step(actions[index:end + 1])
                    posted_through = end
                continue
            if op == Op.RECV_ACT:
                pending[("F", s, mb)] = self.p2p.recv(peer=action.peer, kind=FORWARD_MSG, stage=s, microbatch=mb)
                continue
            if op == Op.RECV_GRAD:
                # keyed by the sending stage, like same-rank handoffs
                pending[("B", s + 1, mb)] = self.p2p.recv(peer=action.peer, kind=GRAD_MSG, stage=s, microbatch=mb)
                continue
            if op == Op.SEND_ACT:
                self.p2p.send(outputs[(s, mb)], peer=action.peer, kind=FORWARD_MSG, stage=s + 1, microbatch=mb)
                continue
            if op == Op.SEND_GRAD:
                self.p2p.send(grads_out.pop((s, mb)), peer=action.peer, kind=GRAD_MSG, stage=s - 1, microbatch=mb)
                continue
            if op == Op.FORWARD:
                x = self.first_input(batches[mb]) if s == 0 else take("F", s, mb)
                if s > 0:
                    x = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in x)
                inputs[(s, mb)] = x
                keep_graph = s not in self.recompute and torch.is_grad_enabled()
                with torch.set_grad_enabled(keep_graph), forward_scope(s, mb):
                    # timed from here: waiting for the input, and what the scope does on entry (2BW applies a
                    # deferred optimizer update there), are not this forward's compute
                    began = now()
                    out = self._forward(s, x, batches[mb], loss_fn)
                if s == self.num_stages - 1:
                    loss = out[0].detach() if loss is None else loss + out[0].detach()
                elif self._rank(s + 1) == self.pp_rank:
                    local[("F", s + 1, mb)] = out
                outputs[(s, mb)] = out if keep_graph or s == self.num_stages - 1 else tuple(v.detach() for v in out)
            elif op == Op.RECOMPUTE:
                with forward_scope(s, mb):  # the same masks (and weights) as its forward
                    began = now()
                    outputs[(s, mb)] = self._forward(s, inputs[(s, mb)], batches[mb], loss_fn)
            elif op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                out = outputs.pop((s, mb))
                grads = None if s == self.num_stages - 1 else take("B", s + 1, mb)
                began = now()
                pairs = self._pairs(out, grads)
                x = inputs[(s, mb)]
                wanted = [v for v in x if isinstance(v, torch.Tensor) and v.requires_grad]
                if op == Op.BACKWARD:
                    with sync_context(index == last_backward):
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                    got = [v.grad for v in wanted]
                    inputs.pop((s, mb))
                else:
                    got, split[(s, mb)] = backward_input([o for o, _ in pairs], [g for _, g in pairs], wanted,
                                                         self._trained_params(s), self.split_plans)
                if s > 0:
                    by_input = dict(zip([id(v) for v in wanted], got))
                    message = tuple(by_input.get(id(v)) if by_input.get(id(v)) is not None else torch.zeros_like(v)
                                    for v in x if isinstance(v, torch.Tensor) and v.is_floating_point())
                    if self._rank(s - 1) == self.pp_rank:
                        local[("B", s, mb)] = message
                    else:
                        grads_out[(s, mb)] = message
                # an I keeps its graph for W: these names must not keep it past W (until the next I: one more
                # micro-batch's activations alive under zero-bubble schedules, found by the search's memory model)
                del out, pairs
            elif op == Op.BACKWARD_WEIGHT:
                work = split.pop((s, mb))
                with sync_context(index == last_backward):
                    backward_weight(work)
                inputs.pop((s, mb))
                del work  # the graph goes with it now, not at the next W
            if record:
                events.append((began, now(), action))
        with self.waits.timed("pipeline"):
            self.p2p.wait_sends()
        leftovers = [k for k in (*inputs, *outputs, *pending, *split)]
        if leftovers and training and carry is None:
            raise RuntimeError(f"pipeline step ended with unfinished work on rank {self.pp_rank}: {leftovers[:5]}")
        if loss is None:
            loss = torch.zeros((), device=self.p2p.device)
        return StepRecord(loss=loss, marks=events, clock=clock)

    def _trained_params(self, stage: int) -> list[nn.Parameter]:
        return [p for p in self.stages[stage].parameters() if p.requires_grad]

    def _forward(self, stage: int, x: tuple, batch: dict, loss_fn: Callable[[Any, dict], torch.Tensor]) -> tuple:
        try:
            with self.autocast():
                out = self.stages[stage](*x)
        except Exception as exc:
            node = None if isinstance(exc, AutoparError) or lost_peer(exc) else failing_node(exc)
            if node is None:  # not an op of the model's graph (a peer went away, an autopar check): as it is
                raise
            raise ModelError(f"stage {stage} of {self.num_stages} failed at run time in {describe_node(node)}: "
                             f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                             f"; the op traced on fake values and fails on real ones: run the model on the same "
                             f"batch in one process to reproduce it, and fix it in the model") from exc
        if stage == self.num_stages - 1:
            return (loss_fn(out, batch),)
        return out

    @staticmethod
    def _pairs(out: tuple, grads: tuple | None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(output, its gradient) for every output that needs one; the loss gets None (= 1)."""
        if grads is None:
            return [(out[0], None)]
        floats = [out[i] for i in _float_positions(out)]
        if len(floats) != len(grads):
            raise RuntimeError(f"received {len(grads)} gradients for {len(floats)} floating-point outputs")
        return [(o, g) for o, g in zip(floats, grads) if o.requires_grad]
