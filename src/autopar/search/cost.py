"""Predicted time and memory of one training step for (model profile, strategy, cluster).

    per block    forward  = FLOPs / rate + TP all-reduces;  backward = 2 x FLOPs / rate + TP all-reduces
                 (or, with a measured profile (measure_profile.py), fixed + per-sequence x micro-batch
                 seconds measured on this machine, the per-sequence part divided by tp's FLOP share)
    per stage    sums over its blocks, + the per-action overhead; stage-aware recomputation adds its
                 blocks' forward to the backward; whole-stage recomputation is the schedule's R action
    zero-bubble  (SPLIT_SCHEDULES) the backward is two actions, I and W, each with its own overhead:
                 measured per block from the runtime's own split (measure_profile.py); from FLOPs, W
                 is the weight ops' FLOPs (their gradient GEMMs), I the rest of the backward with the
                 TP all-reduces, both x (1 + SPLIT_OVERHEAD). Memory: what I keeps for W x the
                 micro-batches between an I and its W (memory_walk.py's count), and the split's transient
    pipeline     the project's simulator (timeline.py) with each cut's boundary bytes as transfer time
    after it     the data-parallel gradient all-reduce in buckets, overlapped with the last backward
                 (only what outlasts it, or the last bucket, shows), or the ZeRO level's reduce-scatter
                 and all-gathers (zero_cost.py), the tied-weight gradient sum between first and last
                 stage, and the update: gradient norm, clip and optimizer step (measured per block with a
                 measured profile, else memory-bandwidth bound; over the shard under ZeRO)
    time-sharing when a node runs more ranks than it has cores (Cluster.cores_per_node, CPU): the
                 CPU seconds of every rank's step, summed, / the cores the ranks really get (less the
                 cores their idle gloo threads burn, Cluster.background_cores) bounds the
                 step from below; the step is the larger of that and the timeline above. The CPU of a
                 step: compute actions (without the wall time their TP collectives wait), the update,
                 and every collective and transfer's own CPU (gloo copies and wakes in its threads,
                 calibrated per group size: Cluster.all_reduce_cpu, p2p_cpu_s) -- none of it overlaps
                 when the cores are oversubscribed, whatever the timeline hides; x the level a real
                 reference step measured (Cluster.time_shared_scale, search/step_probe.py; 1 if not)

Memory (each stage's pieces at its rank's peak) is step_memory.py's half of `evaluate`.

Everything a candidate needs that does not depend on its schedule (block times per tp and
micro-batch size, partitions, in-flight counts) is cached on the StepModel instance, so
scoring a candidate is arithmetic plus one simulation of a short schedule.
"""

from __future__ import annotations

from ..config.schedules import SPLIT_SCHEDULES  # noqa: F401 (the schedules whose backward is I + W)
from ..errors import ConfigError, choices
from ..partition import algorithms
from .candidate import Candidate, Estimate  # noqa: F401 (imported from here by the search's modules)
from . import dimensions
from .cluster import Cluster
from .memory import OPTIMIZER_STATE_BYTES
from .tp_fixed import fixed_shares
from .profile import ModelProfile
from .step_memory import step_memory
from .timeline import PipelineTimes, StageCosts, normalised, pipeline_times, scaled, shared_pipeline_makespan
from .zero_cost import copy_bytes_per_param, data_parallel_cpu_s, data_parallel_exposed_s

RECOMPUTE = ("none", "stage-aware", "all")
PARTITIONS = ("uniform", "parameters", "time")
ADAM_BYTES_PER_PARAM = 28.0  # AdamW step: reads weight, grad, two moments; writes weight, two moments (fp32)
SPLIT_OVERHEAD = 0.15
"""I + W over a fused backward, where not measured: the runtime's split on CPU measured ~1.15x B (the zero-bubble
benchmark: a second autograd call, the kept gradients read back from memory); a stated estimate, not a datasheet."""


class StepModel:
    """Scores candidates for one model on one cluster at one global batch size."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, *, global_batch_size: int, dtype: str = "fp32",
                 optimizer: str = "adamw", clip_gradients: bool = True):
        if optimizer not in OPTIMIZER_STATE_BYTES:
            raise ConfigError(f"optimizer must be one of {choices(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}")
        self.profile, self.cluster, self.global_batch_size = profile, cluster, global_batch_size
        self.dtype, self.optimizer = dtype, optimizer
        self.clip = clip_gradients  # --grad-clip > 0 (the default): clipping's temporaries count (update_memory.py)
        half = dtype in ("bf16", "bf16-autocast")  # both compute in bf16; only "bf16" stores bf16 parameters
        self.rate = cluster.rate("bf16" if half else dtype)
        self.act_scale = 0.5 if half else 1.0
        self.bf16_master = dtype == "bf16"  # --dtype bf16: bf16 parameters and gradients, fp32 master weights
        self.param_bytes = 2.0 if self.bf16_master else 4.0  # a parameter or its gradient, stored and communicated
        # between stages: under autocast the residual stream stays fp32 (fp32 + a bf16 op's output is fp32)
        self.boundary_scale = 0.5 if self.bf16_master else 1.0
        self._blocks: dict = {}
        self._bounds: dict = {}
        self._timelines: dict = {}
        self._schedules: dict = {}

    # ------------------------------------------------------------------ per-block costs

    def block_times(self, tp: int, mbs: int) -> tuple[list[float], list[float], list[float]]:
        """Forward seconds, backward seconds and TP all-reduce seconds (one direction) per block."""
        key = (tp, mbs)
        if key not in self._blocks:
            prof = self.profile.at_tp(tp)
            comm = [count * self.cluster.all_reduce(nbytes / max(count, 1) * mbs * self.act_scale, tp) if count else 0.0
                    for nbytes, count in zip(prof.allreduce_bytes, prof.allreduce_count)]
            measured = self.profile.measured
            if measured is None:
                forward = [f * mbs / self.rate + c for f, c in zip(prof.flops, comm)]
                backward = [2 * f * mbs / self.rate + c for f, c in zip(prof.flops, comm)]
            else:  # measured fixed + per-sequence seconds; under tp the fixed part per tp_fixed.py, the rest by FLOPs
                share = [mine / whole if whole else 1.0 for mine, whole in zip(prof.flops, self.profile.flops)]
                kept = fixed_shares(self.profile, self.cluster, tp)
                forward = [m.forward_fixed_s * k + m.forward_per_seq_s * mbs * r + c
                           for m, k, r, c in zip(measured, kept, share, comm)]
                backward = [m.backward_fixed_s * k + m.backward_per_seq_s * mbs * r + c
                            for m, k, r, c in zip(measured, kept, share, comm)]
            exchange_f, exchange_b = self.profile.exchange_seconds(mbs)  # expert all-to-alls, cp's attention
            forward = [f + x for f, x in zip(forward, exchange_f)]
            backward = [b + x for b, x in zip(backward, exchange_b)]
            self._blocks[key] = (forward, backward, comm)
        return self._blocks[key]

    def block_split_times(self, tp: int, mbs: int) -> tuple[list[float], list[float]]:
        """I seconds (with the backward's TP all-reduces) and W seconds per block, for zero-bubble schedules.

        Measured: the runtime's own I and W on each block (fixed + per-sequence, as the backward). Else
        W = the FLOPs of the ops that read a weight (their weight-gradient GEMMs; under tp scaled by the
        block's FLOP share), I = the rest of the backward's 2x forward FLOPs, both x (1 + SPLIT_OVERHEAD);
        without those FLOPs (an old profile) or measured without the split, half the backward each, same
        overhead."""
        key = ("split", tp, mbs)
        if key not in self._blocks:
            forward, backward, comm = self.block_times(tp, mbs)
            prof, measured, extra = self.profile.at_tp(tp), self.profile.measured, 1.0 + SPLIT_OVERHEAD
            share = [mine / whole if whole else 1.0 for mine, whole in zip(prof.flops, self.profile.flops)]
            if measured is not None and all(m.has_split for m in measured):
                kept = fixed_shares(self.profile, self.cluster, tp)
                inputs = [m.input_fixed_s * k + m.input_per_seq_s * mbs * r + c
                          for m, k, r, c in zip(measured, kept, share, comm)]
                weights = [m.weight_fixed_s * k + m.weight_per_seq_s * mbs * r
                           for m, k, r in zip(measured, kept, share)]
            elif measured is None and self.profile.weight_flops:
                weights = [w * r * mbs / self.rate * extra for w, r in zip(self.profile.weight_flops, share)]
                inputs = [(b - c) * extra - w + c for b, c, w in zip(backward, comm, weights)]
            else:
                weights = [(b - c) / 2 * extra for b, c in zip(backward, comm)]
                inputs = [w + c for w, c in zip(weights, comm)]
            self._blocks[key] = (inputs, weights)
        return self._blocks[key]

    def block_held_bytes(self, tp: int) -> list[float]:
        """Bytes per sequence I keeps for W in each block (measured, else the traced outputs of the ops that read
        a weight), scaled under tp like the saved activations."""
        prof = self.profile.at_tp(tp)
        share = [mine / whole if whole else 1.0 for mine, whole in zip(prof.saved_bytes, self.profile.saved_bytes)]
        measured = self.profile.measured
        if measured is not None and all(m.has_split for m in measured):
            held = [m.held_per_seq for m in measured]
        else:
            held = list(self.profile.weight_out_bytes) or [0.0] * self.profile.num_blocks
        return [h * r for h, r in zip(held, share)]

    def block_tp_cpu(self, tp: int, mbs: int) -> list[float]:
        """CPU seconds, summed over the tp ranks, of one block's TP all-reduces in one direction (time-sharing)."""
        key = ("cpu", tp, mbs)
        if key not in self._blocks:
            prof = self.profile.at_tp(tp)
            self._blocks[key] = [count * self.cluster.all_reduce_cpu(nbytes / max(count, 1) * mbs * self.act_scale, tp)
                                 if count else 0.0 for nbytes, count in zip(prof.allreduce_bytes, prof.allreduce_count)]
        return self._blocks[key]

    def host_sync_cpu(self, c: Candidate, spans: list[tuple[int, int]]) -> float:
        """CPU seconds, summed over all ranks, of the small collectives every step makes besides the model's
        (train/steps.py, pipeline/engine.py): the target count over each dp group, the loss-and-flags and the peak
        memory over every rank, the gradient norm's squares over each pp group (a pipeline) and each tp group,
        and, when a pipeline splits tied weights, their gradient sum between the two stages that hold them.
        A few bytes each, but on gloo each costs a latency per ring step in every rank's CPU, and every rank
        waits in it (Cluster.sync_cpu_s), as it does once more for the data-parallel gradients' last bucket."""
        cl, world = self.cluster, c.dp * c.tp * c.pp
        tiny = 16.0
        total = 2 * cl.all_reduce_cpu(tiny, world) + c.pp * c.tp * cl.all_reduce_cpu(tiny, c.dp)
        if c.pp > 1:
            total += c.dp * c.tp * cl.all_reduce_cpu(tiny, c.pp)
            shared_first, shared_last = self.profile.shared_blocks
            if self.profile.shared_params and not any(a <= shared_first < b and a <= shared_last < b for a, b in spans):
                total += c.dp * c.tp * cl.all_reduce_cpu(self.profile.shared_params / c.tp * self.param_bytes, 2)
        if c.tp > 1:
            total += c.dp * c.pp * cl.all_reduce_cpu(tiny, c.tp)
        waits = 2 + (c.dp > 1) + (c.pp > 1) + (c.tp > 1) + (c.dp > 1)  # per rank; the last: gradients' final wait
        return total + world * waits * cl.sync_cpu_s

    def tp_waits_per_rank(self, c: Candidate, spans: list[tuple[int, int]], blocks: tuple[int, ...]) -> float:
        """The TP all-reduces one rank of the busiest stage waits in per step: per micro-batch, its blocks' forward,
        backward and recomputed forward (step_cpu_terms counts the same, summed over the ranks)."""
        counts = self.profile.at_tp(c.tp).allreduce_count
        passes = 3 if c.recompute == "all" else 2
        return max(c.num_microbatches * (passes * sum(counts[a:b]) + sum(counts[a:a + k]))
                   for (a, b), k in zip(spans, blocks))

    def exchange_waits_per_rank(self, c: Candidate, spans: list[tuple[int, int]], blocks: tuple[int, ...]) -> float:
        """The exchange waits (profile.exchange_waits) one rank of the busiest stage makes per step: per micro-batch
        its blocks' forward and backward, and the forward again where recomputed."""
        waits = self.profile.exchange_waits
        forward = [f for f, _ in waits]
        backward = [b for _, b in waits]
        again = 1 if c.recompute == "all" else 0
        return max(c.num_microbatches * ((1 + again) * sum(forward[a:b]) + sum(backward[a:b])
                                         + (0 if again else sum(forward[a:a + k])))
                   for (a, b), k in zip(spans, blocks))

    def step_cpu(self, c: Candidate, spans: list[tuple[int, int]], blocks: tuple[int, ...], times: PipelineTimes,
                 rank_of: list[int], update: list[float], local_params: list[float]) -> float:
        """CPU seconds of one step summed over all dp x tp x pp ranks (what time-sharing ranks must fit in the cores)."""
        return sum(self.step_cpu_terms(c, spans, blocks, times, rank_of, update, local_params).values())

    def step_cpu_terms(self, c: Candidate, spans: list[tuple[int, int]], blocks: tuple[int, ...],
                       times: PipelineTimes, rank_of: list[int], update: list[float],
                       local_params: list[float]) -> dict[str, float]:
        """`step_cpu` by term (seconds summed over all ranks), so a benchmark can set each beside its measurement.

        compute: each pipeline rank's busy time less the wall its TP all-reduces take inside the actions (their
        CPU is counted apart). Per micro-batch and stage, the TP all-reduces run once forward, once backward and
        once more in a recomputed forward (tp_collectives; each is also a blocking wait, in waits); every boundary
        sends one activation and one gradient (each tp rank its own copy; transfers, and each received one waits).
        update: the gradient norm, clip and optimizer step; dp_collectives: zero_cost.data_parallel_cpu_s;
        host_syncs: the step's small collectives and their waits (host_sync_cpu)."""
        cl, m, mbs = self.cluster, c.num_microbatches, c.micro_batch_size
        _, _, tp_comm = self.block_times(c.tp, mbs)
        tp_cpu = self.block_tp_cpu(c.tp, mbs)
        counts = self.profile.at_tp(c.tp).allreduce_count
        whole = c.recompute == "all"
        measured = self.profile.measured
        cpu_per_wall = measured[0].cpu_per_wall if measured else 1.0  # blocks timed while others held the core
        terms = dict.fromkeys(("compute", "update", "tp_collectives", "transfers", "waits", "dp_collectives",
                               "host_syncs"), 0.0)
        for s, ((a, b), k) in enumerate(zip(spans, blocks)):
            passes = 3 if whole else 2
            wall = m * (passes * sum(tp_comm[a:b]) + sum(tp_comm[a:a + k]))
            cpu = m * (passes * sum(tp_cpu[a:b]) + sum(tp_cpu[a:a + k]))
            terms["compute"] -= wall * c.dp * c.tp * cpu_per_wall
            terms["tp_collectives"] += cpu * c.dp
            if c.tp > 1:  # every rank of the group waits in each all-reduce
                count = sum(counts[a:b])
                terms["waits"] += m * (passes * count + sum(counts[a:a + k])) * c.tp * c.dp * cl.sync_cpu_s
            if b < self.profile.num_blocks:  # this stage's output forward, its gradient back; each received waits
                nbytes = self.profile.boundary_bytes[b - 1] * mbs * self.boundary_scale
                terms["transfers"] += 2 * m * cl.p2p_cpu_s(nbytes) * c.dp * c.tp
                terms["waits"] += 2 * m * cl.sync_cpu_s * c.dp * c.tp
        terms["host_syncs"] = self.host_sync_cpu(c, spans)
        element = 2.0 if self.bf16_master else 4.0
        params = self.profile.at_tp(c.tp).params
        for r in range(c.pp):
            mine = [s for s in range(len(spans)) if rank_of[s] == r]
            terms["compute"] += times.busy[r] * c.dp * c.tp * cpu_per_wall
            terms["update"] += update[r] * c.dp * c.tp * cpu_per_wall
            units = self.fsdp_unit_params(c, spans, mine, params) if c.zero == 3 and c.dp > 1 else []
            terms["dp_collectives"] += c.tp * data_parallel_cpu_s(
                cl, zero=c.zero, dp=c.dp, nbytes=sum(local_params[s] for s in mine) * element, num_microbatches=m,
                per_micro_batch=c.pp == 1, unit_bytes=[u * element for u in units], element_bytes=element)
            # each unit's collectives (two all-gathers a micro-batch, one reduce-scatter) are blocking waits
            terms["waits"] += (2 * m + 1) * len(units) * c.dp * c.tp * cl.sync_cpu_s
        return terms

    def idle_cores_s(self, c: Candidate, recompute: frozenset[int], costs: StageCosts, times: PipelineTimes,
                     cores: float) -> float:
        """Seconds the time-shared bound misses because the cores idle: while a pipeline warms up and drains,
        fewer ranks have work ready than there are cores. The pipeline played with processor sharing (each of
        k ready pipeline ranks, with its dp x tp copies, gets min(1, cores / (k dp tp)) of a core: timeline.py
        shared_pipeline_makespan) less its compute perfectly packed on the cores."""
        copies = c.dp * c.tp

        def rate(k: int) -> float:
            return min(1.0, cores / (k * copies))
        key = ("shared", c.schedule, c.pp, c.chunks, c.num_microbatches, recompute, costs, cores, copies)
        makespan = self._timelines.get(key)
        if makespan is None:
            makespan = shared_pipeline_makespan(c.schedule, pp=c.pp, chunks=c.chunks,
                                                num_microbatches=c.num_microbatches, recompute=recompute,
                                                costs=costs, rate=rate, cache=self._schedules)
            self._timelines[key] = makespan
        return max(0.0, makespan - sum(times.busy) * copies / cores)

    @staticmethod
    def fsdp_unit_params(c: Candidate, spans: list[tuple[int, int]], mine: list[int],
                         params: list[float]) -> list[float]:
        """Parameters of each ZeRO-3 (FSDP2) unit on one pipeline rank. Under dp alone (train/fsdp_engine.py)
        each repeated layer is a unit and the root holds the rest (the embedding and head blocks); with pp or tp
        each stage is one unit (zero/fully_sharded.py; the memory model's `gathered_unit` says the same). Any other
        per-block figure (forward, backward seconds) sums per unit the same way."""
        if c.pp == 1 and c.tp == 1:
            whole = [float(p) for s in mine for p in params[spans[s][0]:spans[s][1]]]
            return [whole[0] + whole[-1], *whole[1:-1]] if len(whole) > 2 else [sum(whole)]
        return [float(sum(params[spans[s][0]:spans[s][1]])) for s in mine]

    def bounds(self, method: str, tp: int, mbs: int, stages: int) -> tuple[int, ...]:
        key = (method, tp, mbs, stages)
        if key not in self._bounds:
            n = self.profile.num_blocks
            if method == "uniform":
                repeated = [0 < i < n - 1 for i in range(n)]
                cut = algorithms.uniform(n, stages, weights=repeated) if sum(repeated) >= stages else \
                    algorithms.uniform(n, stages)
            elif method == "parameters":
                cut = algorithms.balanced([float(p) for p in self.profile.at_tp(tp).params], stages)
            elif method == "time":
                forward, backward, _ = self.block_times(tp, mbs)
                compute = [f + b for f, b in zip(forward, backward)]
                link = self.cluster.intra_node
                transfer = [2 * link.p2p(c * mbs * self.boundary_scale) for c in self.profile.boundary_bytes] + [0.0]
                cut = algorithms.min_max_time(compute, stages, transfer=transfer)
            else:
                raise ConfigError(f"partition method must be one of {choices(PARTITIONS)}, got {method!r}")
            self._bounds[key] = tuple(cut)
        return self._bounds[key]

    def timeline(self, c: Candidate, recompute: frozenset[int], costs: StageCosts) -> PipelineTimes:
        """The simulated pipeline, shared by candidates whose normalised stage costs agree (timeline.py)."""
        scale, shape = normalised(costs)
        key = (c.schedule, c.pp, c.chunks, c.num_microbatches, recompute, shape)
        times = self._timelines.get(key)
        if times is None:
            times = pipeline_times(c.schedule, pp=c.pp, chunks=c.chunks, num_microbatches=c.num_microbatches,
                                   recompute=recompute, costs=shape, cache=self._schedules)
            self._timelines[key] = times
        return scaled(times, scale)

    def stage_costs(self, c: Candidate, spans: list[tuple[int, int]], blocks: tuple[int, ...]) -> StageCosts:
        forward, backward, _ = self.block_times(c.tp, c.micro_batch_size)
        cl, overhead = self.cluster, self.cluster.per_action_overhead_s
        f_stage = [sum(forward[a:b]) + overhead for a, b in spans]
        b_stage = [sum(backward[a:b]) + sum(forward[a:a + k]) + overhead for (a, b), k in zip(spans, blocks)]
        inter = c.dp * c.tp >= cl.devices_per_node and c.pp > 1
        send = [cl.p2p(self.profile.boundary_bytes[b - 1] * c.micro_batch_size * self.boundary_scale, inter_node=inter)
                if b < self.profile.num_blocks else 0.0 for a, b in spans]
        send_back = [0.0] + send[:-1]  # the gradient of stage s's input is as big as stage s-1's output
        i_stage, w_stage = (), ()
        if c.schedule in SPLIT_SCHEDULES:  # I carries the stage-aware recomputation (checkpoints unpack in it)
            inputs, weights = self.block_split_times(c.tp, c.micro_batch_size)
            # the first stage's input (token ids) wants no gradient: its I does nothing, its W the whole backward
            i_stage = tuple(overhead if a == 0 else sum(inputs[a:b]) + sum(forward[a:a + k]) + overhead
                            for (a, b), k in zip(spans, blocks))
            w_stage = tuple(bs if a == 0 else sum(weights[a:b]) + overhead for (a, b), bs in zip(spans, b_stage))
        # whole-stage recomputation (R) reruns the stage's forward
        return StageCosts(tuple(f_stage), tuple(b_stage), tuple(f_stage), tuple(send), tuple(send_back), i_stage,
                          w_stage)

    def update_time(self, spans: list[tuple[int, int]], param_elements: float, *, zero: int = 0, dp: int = 1,
                    tp: int = 1, foreach_norm: bool = False) -> float:
        """Seconds of the step after the backward on one rank's parameters: gradient norm, clip, optimizer.

        Measured per block where the profile is measured (per-tensor overhead dominates small models), x the
        block's parameter share on one rank of a `tp` group (a width-768 block's update measured 54 ms whole, 11
        and 4.9 ms for one rank's half and quarter; the per-tensor part a split keeps, ~25 us a tensor here, is
        left out); otherwise the AdamW step's memory traffic at the device's bandwidth. Under ZeRO the update runs
        on this replica's 1/dp shard, then the gathered parameters are copied back in (zero_cost.py).
        `foreach_norm`: the data-parallel engine's norm (BlockCosts.update_foreach_norm_s), where measured."""
        shard = dp if zero else 1
        copy = param_elements * copy_bytes_per_param(zero, 2.0 if self.bf16_master else 4.0)
        if self.profile.measured is not None:  # one call over all the rank's blocks: its fixed part paid once
            held, whole = self.profile.at_tp(tp).params, self.profile.params
            mine = [(m, held[i] / whole[i] if whole[i] else 1.0) for a, b in spans for i, m in
                    enumerate(self.profile.measured[a:b], start=a) if m.update_s > 0]
            call = max((m.update_call_s for m, _ in mine), default=0.0)
            def seconds(m) -> float:
                return m.update_foreach_norm_s if foreach_norm and m.update_foreach_norm_s is not None else m.update_s
            blocks = sum(max(seconds(m) - m.update_call_s, 0.0) * r for m, r in mine)
            return (blocks / shard + call if mine else 0.0) + \
                copy / self.cluster.memory_bandwidth_bytes_per_s
        return param_elements * (ADAM_BYTES_PER_PARAM / shard) / self.cluster.memory_bandwidth_bytes_per_s + \
            copy / self.cluster.memory_bandwidth_bytes_per_s

    # ------------------------------------------------------------------ one candidate

    def evaluate(self, c: Candidate) -> Estimate:
        if not dimensions.is_plain(c):  # ep, sp, cp, compile: this model on the profile a rank runs
            return dimensions.evaluate(self, c)
        prof, cl = self.profile.at_tp(c.tp), self.cluster
        stages = c.pp * c.chunks
        bounds = c.bounds if c.bounds is not None else self.bounds(c.partition, c.tp, c.micro_batch_size, stages)
        forward, backward, tp_comm = self.block_times(c.tp, c.micro_batch_size)
        whole = c.recompute == "all"
        recompute = frozenset(range(stages)) if whole else frozenset()
        structure = self.timeline(c, recompute, self.stage_costs(c, [(bounds[s], bounds[s + 1]) for s in range(stages)],
                                                                  (0,) * stages))
        spans = [(bounds[s], bounds[s + 1]) for s in range(stages)]
        mem = step_memory(self, c, spans, recompute)
        local_params, tied_split, blocks = mem.local_params, mem.tied_split, mem.blocks
        memory, per_rank, fits = mem.per_stage, mem.per_rank, mem.fits
        rank_of = [s % c.pp for s in range(stages)]

        costs = self.stage_costs(c, spans, blocks)
        times = structure if not any(blocks) else self.timeline(c, recompute, costs)
        b_stage = costs.backward

        # after the pipeline drains: data-parallel all-reduce, tied-weight sum, optimizer step
        finish_all, dp_exposed, comm, opt_time = [], [], [], []
        span_dp = c.dp * c.tp
        for r in range(c.pp):
            mine = [s for s in range(stages) if rank_of[s] == r]
            elements = sum(local_params[s] for s in mine)
            units = self.fsdp_unit_params(c, spans, mine, prof.params) if c.zero == 3 else []  # FSDP2's, and
            unit_forward = self.fsdp_unit_params(c, spans, mine, forward) if units else []  # their compute
            unit_backward = self.fsdp_unit_params(c, spans, mine, backward) if units else []
            exposed = data_parallel_exposed_s(  # the last backward on this rank (its first stage runs last)
                cl, zero=c.zero, dp=c.dp, span=span_dp, param_elements=elements, overlap_s=b_stage[min(mine)],
                element_bytes=2.0 if self.bf16_master else 4.0, num_microbatches=c.num_microbatches,
                per_micro_batch=c.pp == 1, block_params=units, block_forward_s=unit_forward,
                block_backward_s=unit_backward, hide_gathers=not cl.gloo)
            tied = 0.0
            if tied_split and c.pp > 1 and any(rank_of[s] in (rank_of[0], rank_of[stages - 1]) for s in mine):
                tied = cl.all_reduce(self.profile.shared_params // c.tp * self.param_bytes, 2,
                                     span=(c.pp - 1) * span_dp + 1)
            optimizer = self.update_time([spans[s] for s in mine], sum(local_params[s] for s in mine), zero=c.zero,
                                         dp=c.dp, tp=c.tp, foreach_norm=c.pp == 1 and c.tp == 1 and c.zero == 0)
            finish_all.append(times.finish[r] + exposed + tied + optimizer)
            dp_exposed.append(exposed)
            opt_time.append(optimizer)
            tp_time = 2 * c.num_microbatches * sum(sum(tp_comm[a:b]) for s, (a, b) in enumerate(spans) if s in mine)
            comm.append(tp_time + exposed + tied)
        step = max(max(finish_all), times.makespan)
        timeline_step, shared, cpu_terms = step, 0.0, {}
        cores, per_node = cl.cores_per_node, min(cl.devices_per_node, c.dp * c.tp * c.pp)
        if cores and per_node > cores:  # ranks time-share the cores: the step lasts at least their CPU / cores
            cpu_terms = self.step_cpu_terms(c, spans, blocks, times, rank_of, opt_time, local_params)
            free = max(cores - cl.background_cores, 0.05 * cores)  # what the ranks' idle threads leave
            nodes = (c.dp * c.tp * c.pp) // per_node
            shared = sum(cpu_terms.values()) / (free * nodes)
            if c.pp > 1:
                shared += self.idle_cores_s(c, recompute, costs, times, free * nodes)
            shared *= cl.time_shared_scale
            if c.tp > 1:  # each TP all-reduce idles the cores until every member of its group has run (and of the
                # groups a layer couples it to: context parallelism's exchange makes cp of them one lock-step)
                lock_step = c.tp * self.profile.coupled_groups
                shared += self.tp_waits_per_rank(c, spans, blocks) * cl.wait_idle_s(lock_step)
            if self.profile.exchange_waits:  # a ring exchange's wait idles them until its neighbour has run
                shared += self.exchange_waits_per_rank(c, spans, blocks) * cl.wait_idle_s(2)
            step = max(step, shared)
        tokens = self.global_batch_size * self.profile.seq_len
        return Estimate(candidate=c, step_time_s=step, tokens_per_s=tokens / step if step > 0 else 0.0, fits=fits,
                        memory_per_stage=memory, memory_per_rank=per_rank, bubble=times.bubble,
                        comm_share=max(comm) / step if step > 0 else 0.0, bounds=tuple(bounds),
                        recompute_blocks=blocks,
                        parts={"pipeline_s": times.makespan, "dp_exposed_s": max(dp_exposed),
                               "optimizer_s": max(opt_time), "busy_s": max(times.busy),
                               "timeline_step_s": timeline_step, "time_shared_s": shared,
                               "cpu_s": sum(cpu_terms.values()),
                               **{f"cpu_{k}_s": v for k, v in cpu_terms.items()}})
