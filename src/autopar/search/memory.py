"""Peak memory of one pipeline stage on one rank: the pieces, each in bytes, so a plan can say why it fits.

    parameters + gradients + optimizer states          (fp32 master weights, as the trainer keeps them;
                                                        per ZeRO level and bf16 master weights: zero_memory.py)
  + activations      saved bytes per micro-batch x in-flight micro-batches (from the simulator)
  + stashed inputs   a recomputing stage keeps only its input per in-flight micro-batch
  + transient        one block's activations rebuilt or differentiated at a time during backward
                     (measured per block when the profile is measured: measure_profile.py; under tp its
                     weight gradients split, its residual-stream gradients whole: step_memory.py)
  + buffers          what the pipeline sends: the runtime keeps every sent tensor until the step's
                     last action waits for its send (pipeline/p2p.py wait_sends), so a stage holds all
                     m activations it sent and the input gradients it sent before its last forward,
                     plus the incoming gradient (the data-parallel buckets add nothing: gradients
                     are views into them, grad_sync.py); ZeRO-3's gathered parameters
  + weight pending   zero-bubble schedules: the gradients I keeps for W (at every weight-consuming op)
                     x the micro-batches between an I and its W (from the simulator); their graphs
                     stay alive too, which the in-flight count already holds to the W's end
  or, after the last backward, the update: the model state + clipping's float64 copies or ZeRO-1/2's
                     all-gathered parameters (update_memory.py), when that is more than the walk's peak
  x headroom         allocator slack, fragmentation (Cluster.memory_headroom, calibrate it)

Each piece is a count (micro-batches in flight, tensors sent, ...) x its bytes (StageUnits); the search takes
the counts at the rank's peak action from a walk over its schedule (memory_walk.py), so the pieces are those
alive together at the peak and add up to it, rather than each piece's own maximum.

Without headroom, this is the peak of live tensor bytes, the quantity live_memory.py measures
(benchmarks/strategy_search.py compares the two per rank).

Stage-aware recomputation keeps, for its first k blocks, only each block's input; whole-stage
recomputation (the schedule's R actions) keeps only the stage input and rebuilds the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from .update_memory import BUCKET_BYTES
from .zero_memory import zero_model_state_bytes

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "adagrad": 4}
"""Optimizer bytes per fp32 parameter: AdamW's two moments; plain SGD none; Adagrad one sum."""

__all__ = ["BUCKET_BYTES", "OPTIMIZER_STATE_BYTES", "StageMemory", "StageUnits", "stage_memory", "stage_units"]


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes of one stage on one rank, by piece."""

    params: float
    grads: float
    optimizer: float
    activations: float
    stashed_inputs: float
    transient: float
    buffers: float
    headroom: float  # the factor applied
    weight_pending: float = 0.0  # zero-bubble: gradients kept from I to W
    update: float = 0.0  # clipping's and the optimizer's temporaries, when the update is the peak (update_memory.py)

    @property
    def total(self) -> float:
        return self.headroom * (self.params + self.grads + self.optimizer + self.activations + self.stashed_inputs
                                + self.transient + self.buffers + self.weight_pending + self.update)

    def to_dict(self) -> dict:
        return {k: round(v) for k, v in vars(self).items() if k != "headroom"} | {
            "headroom": self.headroom, "total": round(self.total)}


def kept_bytes(saved: list[float], inputs: list[float], recompute_blocks: int) -> float:
    """Bytes one micro-batch keeps when the first `recompute_blocks` blocks keep only their inputs."""
    k = recompute_blocks
    return sum(inputs[:k]) + sum(saved[k:])


def stage_memory(*, param_elements: int, saved: list[float], inputs: list[float], output_bytes: float,
                 micro_batch_size: int, in_flight: int, stashed: int, recompute_blocks: int, whole_stage: bool,
                 activation_scale: float, optimizer: str, dp: int, headroom: float,
                 transient_bytes: float | None = None, zero: int = 0, bf16_master: bool = False,
                 largest_block_params: float = 0.0, weight_pending: float = 0.0, num_microbatches: int = 1,
                 gathered_units: int = 2) -> StageMemory:
    """Memory of one stage; `saved` and `inputs` are per-block bytes per sequence (fp32).

    `inputs[i]` is the bytes entering block i (what a recomputed block keeps); `activation_scale`
    is 0.5 under bf16 autocast (activations in 16 bits), 1 in fp32. `transient_bytes`, when measured
    (measure_profile.py), is the most bytes one block's forward+backward holds beyond its saved tensors
    for this micro-batch, replacing the estimate of one block's activations twice over.

    `zero` and `bf16_master` choose the model-state bytes (zero_memory.py). Beyond them, ZeRO-2 holds
    the stage's full gradient at the end of each backward, until its reduction, when that micro-batch's
    activations are freed: a backward peaks at its start (activations and one block's transient) or at its
    end (the full gradient), whichever is larger (StageUnits.full_gradient).
    ZeRO-3 (FSDP2) holds, while the activations peak (the start of a
    backward), `gathered_units` x `largest_block_params` gathered (its unit: a block and the prefetched
    next one under dp alone, 2; the whole stage with pp or tp, 1) and, with several micro-batches, the
    stage's unsharded gradient accumulating between them (no-sync), but no sharded gradient yet (the
    step's end makes it; zero_grad drops it). At the end of the backward the activations are gone and
    it holds the unsharded gradient, its reduce-scatter copy and the shard: the larger of the two counts.

    `num_microbatches` sets what the pipeline keeps sent (see buffers above): m outgoing activations,
    and the input gradients of the backwards done before the stage's last forward (m - in_flight; m - stashed
    under whole-stage recomputation, where in_flight counts the one micro-batch rebuilt at a time).

    `weight_pending`: bytes a zero-bubble stage's I keeps for its W, over all micro-batches between the
    two (the caller knows the count from the simulator); pass the split's own transient as `transient_bytes`.

    These counts are each term's own peak; the search takes the peak of their sum instead, from a walk over the
    schedule (stage_units + StageUnits.at with memory_walk.py's counts at the rank's peak action).
    """
    warm_up = stashed if whole_stage else in_flight
    units = stage_units(param_elements=param_elements, saved=saved, inputs=inputs, output_bytes=output_bytes,
                        micro_batch_size=micro_batch_size, recompute_blocks=recompute_blocks, whole_stage=whole_stage,
                        activation_scale=activation_scale, optimizer=optimizer, dp=dp, headroom=headroom,
                        transient_bytes=transient_bytes, zero=zero, bf16_master=bf16_master,
                        largest_block_params=largest_block_params, held_bytes=weight_pending,
                        num_microbatches=num_microbatches, gathered_units=gathered_units)
    m = max(1, num_microbatches)
    # activations, stashed inputs, pending (already a total), outputs sent, input gradients sent, gradient in, transient
    counts = (in_flight, stashed if whole_stage else in_flight, 1, m, max(0, m - warm_up), 1, 1)
    return units.at(counts)


@dataclass(frozen=True)
class StageUnits:
    """The bytes of one stage's model state and of one of each thing a schedule keeps alive (memory_walk.COUNTS:
    one micro-batch's activations, stashed input, pending weight work; one sent output, sent input gradient,
    received gradient; one backward's transient), so any count of them can be priced."""

    params: float
    grads: float
    optimizer: float
    per_count: tuple[float, ...]  # memory_walk.COUNTS order
    headroom: float
    zero3: tuple[float, float, float] | None = None  # (gathered bytes held, bytes held at the backward's end, unit)
    full_gradient: float = 0.0
    """ZeRO-2: the stage's whole gradient, alive at the end of a backward until its reduction lands, when that
    backward's micro-batch has freed its activations: the backward's peak is the larger of the two moments."""
    update: float = 0.0
    """Bytes beyond the model state at the update's peak (clipping, the optimizer's gather: update_memory.py),
    when no activation is alive any more; a rank's peak is the larger of its walk's and its update's."""

    def at_update(self) -> StageMemory:
        """The breakdown while the step updates: the model state and the update's temporaries, nothing else."""
        # (under ZeRO-3 too: its sharded gradient exists from the step's end, which the walk counts as transient)
        return StageMemory(params=self.params, grads=self.grads, optimizer=self.optimizer, activations=0.0,
                           stashed_inputs=0.0, transient=0.0, buffers=0.0, headroom=self.headroom, update=self.update)

    def at(self, counts: tuple[float, ...]) -> StageMemory:
        """The breakdown with `counts` of each (memory_walk.COUNTS order) alive: the terms add up to the total."""
        act, stash, held, sent_out, sent_grad, grad_in, transient = (c * u for c, u in zip(counts, self.per_count))
        buffers = sent_out + sent_grad + grad_in
        grads = self.grads
        if self.full_gradient and counts[-1] > 0:  # during a backward: its start, or its end
            ending = self.full_gradient - min(counts[0], 1) * self.per_count[0]  # that micro-batch's activations go
            transient = max(transient, ending)
        if self.zero3 is not None:
            gathered, end, _ = self.zero3
            buffers += gathered
            during = act + stash + transient + buffers + held
            transient += max(0.0, end - during)
            grads = 0.0
        return StageMemory(params=self.params, grads=grads, optimizer=self.optimizer, activations=act,
                           stashed_inputs=stash, transient=transient, buffers=buffers, headroom=self.headroom,
                           weight_pending=held)


def stage_units(*, param_elements: int, saved: list[float], inputs: list[float], output_bytes: float,
                micro_batch_size: int, recompute_blocks: int, whole_stage: bool, activation_scale: float,
                optimizer: str, dp: int, headroom: float, transient_bytes: float | None = None, zero: int = 0,
                bf16_master: bool = False, largest_block_params: float = 0.0, held_bytes: float = 0.0,
                num_microbatches: int = 1, gathered_units: int = 2, stage_input=None, stage_output=None,
                boundary_scale: float | None = None, update: float = 0.0) -> StageUnits:
    """Bytes per count of one stage (StageUnits), from the same pieces as `stage_memory`; `held_bytes`: what
    one micro-batch's I keeps for its W; `update`: what the update holds beyond the model state
    (update_memory.update_bytes).

    `stage_input`, `stage_output` (profile.Crossing): what enters and leaves the stage, split into bytes that
    grow with the micro-batch and bytes that do not, with the gradients sent back (floating-point tensors only);
    given, they replace inputs[0] and output_bytes for what is stashed, sent and received. `boundary_scale`: the
    bytes of those tensors per fp32 byte (the residual stream stays fp32 under bf16 autocast: 1; bf16 parameters:
    0.5); default `activation_scale`."""
    b = micro_batch_size * activation_scale
    input_bytes = inputs[0] * b if inputs else 0.0
    output_sent = output_bytes * b
    input_grad, output_grad = input_bytes, output_sent
    if stage_input is not None or stage_output is not None:
        scale = activation_scale if boundary_scale is None else boundary_scale
        if stage_input is not None:
            input_bytes = stage_input.at(micro_batch_size) * scale
            input_grad = stage_input.grad_at(micro_batch_size) * scale
        if stage_output is not None:
            output_sent = stage_output.at(micro_batch_size) * scale
            output_grad = stage_output.grad_at(micro_batch_size) * scale
    activations = sum(saved) * b if whole_stage else kept_bytes(saved, inputs, recompute_blocks) * b
    rebuilt = max(saved[:recompute_blocks], default=0.0) if not whole_stage else 0.0
    if transient_bytes is None:
        transient = (max(saved, default=0.0) + rebuilt) * b  # gradients of one block + one block rebuilt
    else:
        transient = transient_bytes + rebuilt * b
    m = max(1, num_microbatches)
    states = zero_model_state_bytes(param_elements, zero=zero, dp=dp, bf16=bf16_master,
                                    optimizer_bytes=float(OPTIMIZER_STATE_BYTES[optimizer]))
    element = 2.0 if bf16_master else 4.0
    zero3 = None
    if zero == 3:
        unit = largest_block_params * element
        gathered = gathered_units * unit + (param_elements * element if m > 1 else 0.0)
        end = (param_elements if m > 1 else largest_block_params) * element + unit + states.grads
        zero3 = (gathered, end, unit)
    # the received input is the stash; every tensor sent stays alive until the step's end (p2p.wait_sends).
    # Data-parallel buckets add nothing: the gradients are views into them (grad_sync.py), counted as grads.
    per_count = (activations, input_bytes, held_bytes, output_sent, input_grad, output_grad, transient)
    return StageUnits(params=states.params, grads=states.grads, optimizer=states.optimizer, per_count=per_count,
                      headroom=headroom, zero3=zero3, full_gradient=param_elements * element if zero == 2 else 0.0,
                      update=update)
