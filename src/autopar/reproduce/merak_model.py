"""The step model with Merak's three runtime techniques, and the baselines as their frameworks run them.

The search's StepModel (search/cost.py) already prices 1F1B, interleaving, whole-stage and
block-level recomputation and every partition method. Merak's techniques need three terms it
does not have; they are added here as a subclass, so baselines and Merak are priced by the same
arithmetic everywhere else (compute rate, p2p, data-parallel all-reduce, optimizer, memory):

  scp            the schedule `scp` (pipeline/schedules.py): the last stage does not recompute,
                 each recompute R runs before its gradient arrives, recomputing stages run one
                 more forward ahead. With whole-stage recomputation this is cost.py's `all`.
  stage-aware    per stage, the fewest leading blocks whose recomputation makes the stage fit
                 (cost.py's `stage-aware` chooser), but played as an R action before the
                 gradient wait (not inside the backward), and with the memory of that R: the
                 k rebuilt blocks are alive together for one micro-batch (MerakStepModel.evaluate).
  tp overlap     sub-pipelined tensor parallelism with K sub-batches: a stage's compute is cut
                 at each TP all-reduce into segments; the K copies of segment s run before
                 segment s+1, and copy j's all-reduce runs on a second stream while later copies
                 compute (overlap_time). autopar's runtime (tensor_parallel/subpipeline.py)
                 overlaps the forward only, across layers; its backward all-reduces stay
                 synchronous. Merak's hand-written GPT-2 blocks also overlap the backward:
                 `overlap_backward` models that design.

The compute of a GPT layer is split between its two all-reduces by the standard FLOP counts
(attention 8sh^2 + 4s^2h, MLP 16sh^2); every sub-batch copy of a segment pays KERNEL_OVERHEAD_S
for its extra kernel launches (an assumption, printed by the study).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..search.cost import Candidate, Estimate, StepModel
from ..search.search import divisors
from ..search.timeline import StageCosts

KERNEL_OVERHEAD_S = 10e-6  # launch cost of one sub-batch copy of one segment (assumed, GPU-typical)


@dataclass(frozen=True)
class Techniques:
    """Which of Merak's runtime techniques a MerakStepModel prices (all off = the plain StepModel)."""

    stage_aware_before_wait: bool = False  # stage-aware recompute as R before the gradient wait (needs scp)
    tp_subbatches: int = 1  # K sub-batches for sub-pipelined TP (1: off)
    overlap_backward: bool = False  # also overlap the backward all-reduces (Merak's design, not autopar's)


def overlap_time(segments: list[tuple[float, float]], k: int, reduce_of, kernel_s: float = KERNEL_OVERHEAD_S) -> float:
    """Time of `segments` [(compute_s, reduce_bytes)] run as K sub-batch copies on two streams.

    Copy j of segment s computes compute_s / k (+ kernel_s) once copy j's reduce of segment s-1
    is done; its reduce `reduce_of(bytes / k)` starts when the compute stream has produced it
    and the communication stream is free. With k = 1 and no kernel cost this is the serial sum.
    """
    compute_free = comm_free = 0.0
    previous = [0.0] * k
    for compute, nbytes in segments:
        reduce_s = reduce_of(nbytes / k) if nbytes else 0.0
        for j in range(k):
            compute_free = max(compute_free, previous[j]) + compute / k + (kernel_s if k > 1 else 0.0)
            if reduce_s:
                comm_free = max(comm_free, compute_free) + reduce_s
                previous[j] = comm_free
            else:
                previous[j] = compute_free
    return max(compute_free, comm_free)


class MerakStepModel(StepModel):
    """StepModel plus Merak's three terms (see the module docstring); `Techniques()` prices like StepModel."""

    def __init__(self, profile, cluster, *, global_batch_size: int, dtype: str = "fp32",
                 techniques: Techniques = Techniques(), hidden: int, optimizer: str = "adamw"):
        super().__init__(profile, cluster, global_batch_size=global_batch_size, dtype=dtype, optimizer=optimizer)
        self.techniques = techniques
        s = profile.seq_len
        attention, mlp = 8 * s * hidden ** 2 + 4 * s * s * hidden, 16 * s * hidden ** 2
        self.attention_share = attention / (attention + mlp)

    # ------------------------------------------------------------------ sub-pipelined TP

    def segments(self, tp: int, mbs: int, a: int, b: int, backward: bool) -> list[tuple[float, float]]:
        """(compute seconds, all-reduce bytes) per segment of blocks a..b-1, in execution order."""
        prof = self.profile.at_tp(tp)
        scale = 2.0 if backward else 1.0
        out = []
        for i in range(a, b):
            compute = prof.flops[i] * mbs * scale / self.rate
            count, nbytes = prof.allreduce_count[i], prof.allreduce_bytes[i] * mbs * self.act_scale
            if count == 2:  # a transformer layer: attention then MLP, each ending in one all-reduce
                shares = (self.attention_share, 1 - self.attention_share)
            else:
                shares = (1.0 / count,) * count if count else ()
            if not count:
                out.append((compute, 0.0))
            for share in shares:
                out.append((compute * share, nbytes / count))
        return out[::-1] if backward else out

    def subbatches(self, tp: int, mbs: int) -> int:
        """K where sub-pipelining applies: the micro-batch splits into K whole sub-batches along the batch
        (as Merak's and autopar's runtimes split it) and there is a TP all-reduce to hide; else 1."""
        k = self.techniques.tp_subbatches
        return k if tp > 1 and k > 1 and mbs % k == 0 else 1

    def stage_pass(self, tp: int, mbs: int, a: int, b: int, backward: bool) -> float:
        """Seconds of one forward (or backward) of blocks a..b-1 with the configured overlap."""
        k = self.subbatches(tp, mbs)
        overlap = k > 1 and (self.techniques.overlap_backward or not backward)
        reduce_of = (lambda nbytes: self.cluster.all_reduce(nbytes, tp)) if tp > 1 else (lambda nbytes: 0.0)
        segments = self.segments(tp, mbs, a, b, backward)
        if overlap:
            return overlap_time(segments, k, reduce_of)
        # serial: autopar's backward with K copies pays K all-reduces of 1/K the bytes each
        copies = k
        kernels = copies * KERNEL_OVERHEAD_S * len(segments) if copies > 1 else 0.0
        return sum(c + copies * (reduce_of(n / copies) if n else 0.0) for c, n in segments) + kernels

    # ------------------------------------------------------------------ hooks into StepModel

    def stage_costs(self, c: Candidate, spans: list[tuple[int, int]], blocks: tuple[int, ...]) -> StageCosts:
        base = super().stage_costs(c, spans, blocks)
        t = self.techniques
        if t.tp_subbatches == 1 and not t.stage_aware_before_wait:
            return base
        overhead = self.cluster.per_action_overhead_s
        forward = [self.stage_pass(c.tp, c.micro_batch_size, a, b, False) + overhead for a, b in spans]
        backward = [self.stage_pass(c.tp, c.micro_batch_size, a, b, True) + overhead for a, b in spans]
        prefix = [self.stage_pass(c.tp, c.micro_batch_size, a, a + k, False) if k else 0.0
                  for (a, b), k in zip(spans, blocks)]
        if t.stage_aware_before_wait and c.schedule == "scp":
            recompute = [p + overhead if p else 0.0 for p in prefix]  # an R action before the gradient wait
        else:
            backward = [bw + p for bw, p in zip(backward, prefix)]
            recompute = forward
        if c.recompute == "all":
            recompute = forward
        return StageCosts(tuple(forward), tuple(backward), tuple(recompute), base.send_activation, base.send_gradient)

    def timeline(self, c: Candidate, recompute: frozenset[int], costs: StageCosts):
        if self.techniques.stage_aware_before_wait and c.schedule == "scp" and c.recompute != "all":
            stages = c.pp * c.chunks
            chosen = frozenset(s for s in range(stages) if costs.recompute[s] > 0)
            if not chosen:
                # before the blocks are chosen (all R costs 0): the deepest scp schedule, so the memory check
                # counts the extra micro-batch a recomputing stage holds; every micro-batch the stage holds
                # keeps its partly recomputed activations (the simulator counts those as stashed inputs)
                times = super().timeline(c, frozenset(range(stages - 1)), costs)
                held = tuple(a + b for a, b in zip(times.in_flight, times.stashed))
                return dataclasses.replace(times, in_flight=held, stashed=(0,) * len(held))
            recompute = chosen
        return super().timeline(c, recompute, costs)

    def evaluate(self, c: Candidate) -> Estimate:
        """As StepModel, plus the memory of an R before the wait: its k rebuilt blocks live together."""
        estimate = super().evaluate(c)
        if not (self.techniques.stage_aware_before_wait and c.schedule == "scp" and c.recompute != "all"):
            return estimate
        for _ in range(4):  # the extra transient can push a stage over: recompute one more block there
            extra = self._rebuild_extra(c, estimate)
            per_rank = [m.total + x for m, x in zip(estimate.memory_per_stage, extra)]
            over = [s for s, total in enumerate(per_rank) if total > self.cluster.memory_bytes]
            if not over:
                break
            blocks = list(estimate.recompute_blocks)
            sizes = [b - a for a, b in zip(estimate.bounds, estimate.bounds[1:])]
            if all(blocks[s] >= sizes[s] for s in over):
                break
            for s in over:
                blocks[s] = min(sizes[s], blocks[s] + 1)
            estimate = super().evaluate(dataclasses.replace(c, bounds=estimate.bounds, recompute_blocks=tuple(blocks)))
        extra = self._rebuild_extra(c, estimate)
        estimate.memory_per_rank = [m.total + x for m, x in zip(estimate.memory_per_stage, extra)]
        estimate.fits = max(estimate.memory_per_rank) <= self.cluster.memory_bytes
        return estimate

    def _rebuild_extra(self, c: Candidate, e: Estimate) -> list[float]:
        saved = self.profile.at_tp(c.tp).saved_bytes
        scale = c.micro_batch_size * self.act_scale * self.cluster.memory_headroom
        out = []
        for (a, b), k in zip(zip(e.bounds, e.bounds[1:]), e.recompute_blocks):
            rebuilt = saved[a:a + k]
            out.append((sum(rebuilt) - max(rebuilt, default=0.0)) * scale)
        return out


# ------------------------------------------------------------------------------ configurations


@dataclass(frozen=True)
class Degrees:
    """What a baseline hand-tunes and Merak keeps: the parallel degrees and the micro-batching."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int


MAX_PP = 16
"""Deepest pipeline priced: deeper ones cost O(pp^2) to simulate (the study's run time bound); the
picks often sit at this bound, see docs/benchmarks.md."""
MAX_MBS = 8
"""Largest micro-batch priced: the step model's compute is linear in the micro-batch, so larger ones only
lengthen the pipeline's fill and drain; they matter only where memory forces a choice, and smaller ones fit."""


def degree_choices(model: StepModel, nproc: int, max_pp: int = MAX_PP, max_mbs: int = MAX_MBS,
                   min_mbs: int = 1) -> list[Degrees]:
    """Every (dp, tp, pp, mbs) with tp inside a node (a degree the TP planner accepts), dp dividing the batch,
    pp <= max_pp, min_mbs <= mbs <= max_mbs, and at least pp micro-batches."""
    out = []
    for tp in divisors(model.cluster.devices_per_node):
        if tp not in model.profile.tp or nproc % tp:
            continue
        for pp in divisors(nproc // tp):
            dp = nproc // (tp * pp)
            if model.global_batch_size % dp or pp > min(max_pp, model.profile.num_blocks - 2):
                continue
            per_replica = model.global_batch_size // dp
            out += [Degrees(dp, tp, pp, mbs, per_replica // mbs) for mbs in divisors(per_replica)
                    if per_replica // mbs >= pp and min_mbs <= mbs <= max_mbs]  # fewer micro-batches than stages: idle
    return out


def candidate(d: Degrees, **fields) -> Candidate:
    return Candidate(dp=d.dp, tp=d.tp, pp=d.pp, micro_batch_size=d.micro_batch_size,
                     num_microbatches=d.num_microbatches, **fields)


def megatron_candidates(d: Degrees) -> list[Candidate]:
    """Megatron-LM: uniform layer split, 1F1B or interleaved (2 chunks), full recomputation or none."""
    out = []
    for schedule, chunks in (("1f1b", 1), ("interleaved-1f1b", 2)):
        if chunks > 1 and (d.pp == 1 or d.num_microbatches % d.pp):
            continue
        for recompute in ("none", "all"):
            out.append(candidate(d, schedule=schedule, chunks=chunks, recompute=recompute, partition="uniform"))
    return out


def deepspeed_candidates(d: Degrees) -> list[Candidate]:
    """DeepSpeed pipeline: 1F1B, parameter-count partition, full activation checkpointing."""
    return [candidate(d, schedule="1f1b", recompute="all", partition="parameters")]


def best_of(model: StepModel, candidates) -> Estimate | None:
    """The fastest fitting estimate, or None if nothing fits."""
    best = None
    for c in candidates:
        if c.pp * c.chunks > model.profile.num_blocks:
            continue
        e = model.evaluate(c)
        if e.fits and (best is None or e.step_time_s < best.step_time_s):
            best = e
    return best


ABLATION = (
    ("DeepSpeed-style at these degrees", "1f1b", "all", "parameters", Techniques()),
    ("+ time-balanced partition", "1f1b", "all", "time", Techniques()),
    ("+ shifted critical path (scp)", "scp", "all", "time", Techniques()),
    ("+ stage-aware recomputation", "scp", "stage-aware", "time", Techniques(stage_aware_before_wait=True)),
    ("+ sub-pipelined TP, K=2 (= Merak config)", "scp", "stage-aware", "time",
     Techniques(stage_aware_before_wait=True, tp_subbatches=2)),
    ("  (+ backward overlap too: Merak's blocks)", "scp", "stage-aware", "time",
     Techniques(stage_aware_before_wait=True, tp_subbatches=2, overlap_backward=True)),
)
"""Rows of the ablation: one technique added per row; the fifth is the configuration called Merak."""
MERAK_ROW = 4
