"""Predicted peak memory per stage and per rank of one candidate: the memory half of StepModel.evaluate.

Builds each stage's StageUnits (memory.py: model state, activations, transient, buffers, weight pending,
update) from the profile at the candidate's tp and micro-batch size, takes the counts alive at each rank's
peak action from the schedule walk (memory_walk.py), and keeps the update's peak where it is larger
(update_memory.py). Stage-aware recomputation picks its blocks here, since it is chosen to fit memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config.schedules import SPLIT_SCHEDULES
from ..pipeline.actions import stage_to_rank
from ..pipeline.schedules import placement
from .candidate import Candidate
from .memory import StageMemory, StageUnits, stage_units
from .memory_walk import rank_peaks
from .profile import Crossing
from .update_memory import update_bytes

if TYPE_CHECKING:
    from .cost import StepModel


@dataclass(frozen=True)
class StepMemory:
    """One candidate's memory: per stage at its rank's peak, per rank, and what the time half reuses."""

    per_stage: list[StageMemory]
    per_rank: list[float]
    fits: bool
    blocks: tuple[int, ...]  # blocks recomputed per stage (stage-aware recomputation's choice)
    local_params: list[float]  # parameters per stage on one rank (with the head's own copy of a split tied weight)
    tied_split: bool  # a pipeline cut separates the tied weights' blocks


def step_memory(model: StepModel, c: Candidate, spans: list[tuple[int, int]], recompute: frozenset[int]) -> StepMemory:
    """Peak bytes of each stage and rank of candidate c (memory.py says what each piece holds)."""
    prof, cl = model.profile.at_tp(c.tp), model.cluster
    stages = c.pp * c.chunks
    mbs = c.micro_batch_size
    whole = c.recompute == "all"
    # inputs[i]: bytes entering block i per sequence (a cut's crossing tensors; block 0: the token ids)
    inputs = [0.0] + list(model.profile.boundary_bytes)
    local_params = [sum(prof.params[a:b]) for a, b in spans]
    shared_first, shared_last = model.profile.shared_blocks
    owner = {s for s, (a, b) in enumerate(spans) if a <= shared_last < b}
    tied_split = model.profile.shared_params and not any(a <= shared_first < b for s, (a, b) in enumerate(spans)
                                                        if s in owner)
    largest = prof.largest_params or (0,) * model.profile.num_blocks
    local_largest = [max(largest[a:b], default=0) for a, b in spans]  # clipping's largest tensor (update_memory)
    if tied_split:  # the stage holding the head keeps its own copy of the tied weight
        for s in owner:
            local_params[s] += model.profile.shared_params // c.tp
            local_largest[s] = max(local_largest[s], model.profile.shared_params // c.tp)
    transient = [None] * stages
    split = c.schedule in SPLIT_SCHEDULES
    if model.profile.measured is not None:  # measured per block at tp = 1, each part scaled as tp splits it
        # (at most 1: a block kept whole or more under tp, the head under --sp, keeps its own temporaries)
        share = [min(mine / whole, 1.0) if whole else 1.0
                 for mine, whole in zip(prof.saved_bytes, model.profile.saved_bytes)]
        use_split = split and all(m.has_split for m in model.profile.measured)
        crossed = model.profile.crossings
        last_block = model.profile.num_blocks - 1

        def weight_share(i: int) -> float:
            """Block i's parameters on one rank over its whole ones (a tied weight counted in the block reading it
            last too: its copy there is split like the owner's)."""
            mine, whole = prof.params[i], model.profile.params[i]
            if model.profile.shared_params and i == shared_last != shared_first:
                mine, whole = mine + model.profile.shared_params // c.tp, whole + model.profile.shared_params
            return min(mine / whole, 1.0) if whole else 1.0

        def edge_bytes(i: int) -> tuple[float, float]:
            """Block i's input gradient, and its output with that output's gradient, at this micro-batch: tensors of
            the residual stream, which tp (without --sp) leaves whole on every rank."""
            if not crossed:
                return 0.0, 0.0
            grad = crossed[i - 1].grad_at(mbs) if i > 0 else 0.0
            out = crossed[i].at(mbs) + crossed[i].grad_at(mbs) if i < last_block else 0.0
            return grad * model.act_scale, out * model.act_scale

        def block_transient(m, i: int, first: bool) -> float:
            """The measured transient on one tp rank: its fixed part (the weight gradients, made before they are
            added into the gradient buffers) split like the parameters, the input gradient and the output with its
            gradient whole, the rest (activation gradients, temporaries) like the saved bytes."""
            if use_split and not first:
                fixed, per_seq = m.split_transient_fixed, m.split_transient_per_seq
            else:
                fixed, per_seq = m.transient_fixed, m.transient_per_seq
            grad, out = edge_bytes(i)
            rest = per_seq * mbs * model.act_scale - grad - out  # may be < 0: saved bytes freed before the peak
            return rest * share[i] + fixed * weight_share(i) + grad + out

        def counted_apart(s: int, i: int, b: int) -> float:
            """What block i's measured transient holds (the measurement keeps the block's output and its gradient
            through the backward) that the stage does not hold there, or the walk prices already: inside a stage the
            output is the next block's input, freed with that block's backward before block i's; a stage's last
            block with a successor sends its output and receives that output's gradient, both priced as buffers."""
            _, out = edge_bytes(i)
            if i == b - 1:
                return out if s < stages - 1 else 0.0
            return crossed[i].at(mbs) * model.act_scale if crossed else 0.0

        transient = [[max(block_transient(m, i, a == 0) - counted_apart(s, i, b), 0.0)
                      for i, m in enumerate(model.profile.measured[a:b], start=a)] for s, (a, b) in enumerate(spans)]
    pending = [0.0] * stages
    if split:  # what one micro-batch's I keeps for its W (the first stage's I keeps nothing: its W is the
        held = model.block_held_bytes(c.tp)  # whole backward); the walk counts the micro-batches between
        pending = [sum(held[a:b]) * mbs * model.act_scale if a > 0 else 0.0 for a, b in spans]
    memory_args = dict(micro_batch_size=mbs, activation_scale=model.act_scale, optimizer=model.optimizer, dp=c.dp,
                       headroom=cl.memory_headroom, zero=c.zero, bf16_master=model.bf16_master,
                       num_microbatches=c.num_microbatches, gathered_units=1 if c.pp > 1 or c.tp > 1 else 2)

    def gathered_unit(s: int, a: int, b: int) -> float:
        """ZeRO-3's unit gathered at once: a block under dp alone, the whole stage with pp or tp (one
        FSDP2 unit per stage, zero/fully_sharded.py)."""
        return local_params[s] if c.zero == 3 and (c.pp > 1 or c.tp > 1) else max(prof.params[a:b])

    saved_bytes = prof.saved_bytes
    measured = model.profile.measured
    if c.pp == 1 and c.tp == 1 and measured and all(m.eager_saved_per_seq is not None for m in measured):
        # no pipeline, no TP: the engine runs the model itself, not traced stages (strategies.py), and keeps
        # what the eager model keeps (measure_profile.BlockCosts.eager_saved_per_seq)
        saved_bytes = tuple(m.eager_saved_per_seq for m in measured)

    def stage_transient(s: int, k: int) -> float | None:
        """The backward's working set at the stage's peak, over the walk's count of every block's activations:
        block i's measured transient less what the blocks after it kept, freed by their backwards before i's."""
        if transient[s] is None:
            return None
        a, b = spans[s]
        kept = [(inputs[j] if j - a < k and not whole else saved_bytes[j]) * mbs * model.act_scale
                for j in range(a, b)]
        return max(max(t - sum(kept[i + 1:]), 0.0) for i, t in enumerate(transient[s]))

    def units_of(s: int, k: int) -> StageUnits:
        a, b = spans[s]
        out = model.profile.boundary_bytes[b - 1] if b < model.profile.num_blocks else 0.0
        crossed = model.profile.crossings  # the stage's input and output, split by batch and gradient
        edges = dict(stage_input=crossed[a - 1] if a > 0 else Crossing(0.0),
                     stage_output=crossed[b - 1] if b < model.profile.num_blocks else Crossing(0.0),
                     boundary_scale=model.boundary_scale) if crossed else {}
        update = update_bytes(local_params[s], local_largest[s], zero=c.zero, dp=c.dp, tp=c.tp,
                              pipelined=c.pp > 1 or c.tp > 1, bf16_master=model.bf16_master, clip=model.clip)
        return stage_units(param_elements=local_params[s], saved=list(saved_bytes[a:b]), inputs=inputs[a:b],
                           output_bytes=out, recompute_blocks=k, whole_stage=whole,
                           transient_bytes=stage_transient(s, k),
                           largest_block_params=gathered_unit(s, a, b), held_bytes=pending[s], **edges,
                           update=update, **memory_args)

    def peaks(units: list[StageUnits], only: int | None = None) -> dict[int, dict[int, tuple[float, ...]]]:
        """Per rank, each stage's counts at the rank's peak action (memory_walk.py): the peak of the sum."""
        return rank_peaks(c.schedule, pp=c.pp, chunks=c.chunks, num_microbatches=c.num_microbatches,
                          recompute=recompute, unit_bytes={s: u.per_count for s, u in enumerate(units)},
                          only=only, cache=model._schedules)

    if c.recompute_blocks is not None:
        blocks = tuple(min(k, b - a) for k, (a, b) in zip(c.recompute_blocks, spans))
    elif c.recompute == "stage-aware":  # the fewest blocks per stage whose own peak fits its share
        budget = cl.memory_bytes / c.chunks

        base = [units_of(t, 0) for t in range(stages)]

        def stage_total(s: int, k: int) -> float:
            units = [*base[:s], units_of(s, k), *base[s + 1:]]  # only stage s's bytes are priced
            at_peak = next(p[s] for p in peaks(units, only=s).values() if s in p)
            return units[s].at(at_peak).total
        blocks = tuple(next((k for k in range(b - a + 1) if stage_total(s, k) <= budget), b - a)
                       for s, (a, b) in enumerate(spans))
    else:
        blocks = (0,) * stages
    units = [units_of(s, k) for s, k in enumerate(blocks)]
    at_peak = {s: counts for p in peaks(units).values() for s, counts in p.items()}
    memory = [units[s].at(at_peak[s]) for s in range(stages)]
    per_rank = [0.0] * c.pp  # the stages of a rank as the schedule places them (zbv: a V), at its peak
    stage_rank = [stage_to_rank(s, c.pp, stages, placement(c.schedule)) for s in range(stages)]
    for r in range(c.pp):  # after the walk's peak, the update's (update_memory.py): the larger is the rank's
        mine = [s for s in range(stages) if stage_rank[s] == r]
        updating = [units[s].at_update() for s in mine]
        if sum(m.total for m in updating) > sum(memory[s].total for s in mine):
            for s, m in zip(mine, updating):
                memory[s] = m
    for s, m in enumerate(memory):
        per_rank[stage_rank[s]] += m.total
    fits = max(per_rank) <= cl.memory_bytes
    return StepMemory(per_stage=memory, per_rank=per_rank, fits=fits, blocks=blocks, local_params=local_params,
                      tied_split=bool(tied_split))
