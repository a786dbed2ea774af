"""Peak memory of one pipeline stage on one rank: the pieces, each in bytes, so a plan can say why it fits.

    parameters + gradients + optimizer states          (fp32 master weights, as the trainer keeps them;
                                                        per ZeRO level and bf16 master weights: zero_memory.py)
  + activations      saved bytes per micro-batch x in-flight micro-batches (from the simulator)
  + stashed inputs   a recomputing stage keeps only its input per in-flight micro-batch
  + transient        one block's activations rebuilt or differentiated at a time during backward
                     (measured per block when the profile is measured: measure_profile.py)
  + buffers          what the pipeline sends: the runtime keeps every sent tensor until the step's
                     last action waits for its send (pipeline/p2p.py wait_sends), so a stage holds all
                     m activations it sent and the input gradients it sent before its last forward,
                     plus the incoming gradient (the data-parallel buckets add nothing: gradients
                     are views into them, grad_sync.py); ZeRO-3's gathered parameters
  + weight pending   zero-bubble schedules: the gradients I keeps for W (at every weight-consuming op)
                     x the micro-batches between an I and its W (from the simulator); their graphs
                     stay alive too, which the in-flight count already holds to the W's end
  x headroom         allocator slack, fragmentation (Cluster.memory_headroom, calibrate it)

Without headroom, this is the peak of live tensor bytes, the quantity live_memory.py measures
(benchmarks/strategy_search.py compares the two per rank).

Stage-aware recomputation keeps, for its first k blocks, only each block's input; whole-stage
recomputation (the schedule's R actions) keeps only the stage input and rebuilds the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from .zero_memory import zero_model_state_bytes

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "adagrad": 4}
"""Optimizer bytes per fp32 parameter: AdamW's two moments; plain SGD none; Adagrad one sum."""

BUCKET_BYTES = 25 * 2**20  # data-parallel gradient bucket (the runtime's default size)


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

    @property
    def total(self) -> float:
        return self.headroom * (self.params + self.grads + self.optimizer + self.activations + self.stashed_inputs
                                + self.transient + self.buffers + self.weight_pending)

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
    the stage's full gradient at the end of each backward, until its reduction (a transient, as the
    activations it replaces are freed). ZeRO-3 (FSDP2) holds, while the activations peak (the start of a
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
    """
    b = micro_batch_size * activation_scale
    input_bytes = inputs[0] * b if inputs else 0.0
    if whole_stage:
        activations = in_flight * sum(saved) * b  # rebuilt by R, alive until the backward ends
        stash = stashed * input_bytes
    else:
        activations = in_flight * kept_bytes(saved, inputs, recompute_blocks) * b
        stash = in_flight * input_bytes  # the received input, kept for the backward
    rebuilt = max(saved[:recompute_blocks], default=0.0) if not whole_stage else 0.0
    if transient_bytes is None:
        transient = (max(saved, default=0.0) + rebuilt) * b  # gradients of one block + one block rebuilt
    else:
        transient = transient_bytes + rebuilt * b
    # the received input is the stash above. Every tensor sent stays alive until the step's end (p2p.wait_sends):
    # m activations out, the input gradients of the backwards done before the last forward, one gradient in.
    # Data-parallel buckets add nothing: the gradients are views into them (grad_sync.py), counted as grads.
    m = max(1, num_microbatches)
    # the forwards before the stage's first backward: its in-flight count, or under whole-stage recomputation
    # (one micro-batch's activations at a time) the stashed inputs, which the schedule's warm-up still sets
    warm_up = stashed if whole_stage else in_flight
    buffers = (m + 1) * output_bytes * b + max(0, m - warm_up) * input_bytes
    states = zero_model_state_bytes(param_elements, zero=zero, dp=dp, bf16=bf16_master,
                                    optimizer_bytes=float(OPTIMIZER_STATE_BYTES[optimizer]))
    grads = states.grads
    element = 2.0 if bf16_master else 4.0
    if zero == 2:
        transient = max(transient, param_elements * element)
    if zero == 3:
        unit = largest_block_params * element
        buffers += gathered_units * unit + (param_elements * element if m > 1 else 0.0)
        during = activations + stash + transient + buffers + weight_pending
        end = (param_elements if m > 1 else largest_block_params) * element + unit + states.grads
        transient += max(0.0, end - during)
        grads = 0.0
    return StageMemory(params=states.params, grads=grads, optimizer=states.optimizer,
                       activations=activations, stashed_inputs=stash, transient=transient, buffers=buffers,
                       headroom=headroom, weight_pending=weight_pending)
