"""Expert parallelism, sequence parallelism, context parallelism and compilation in the step model.

Why as profile transforms: each of these changes what a rank computes, holds and exchanges per block,
not how the pipeline, data-parallel and memory models combine blocks. So a candidate with any of them
is priced by the same StepModel on a profile rewritten for it (cached per layout), and nothing of the
schedule simulation, the memory walk or the time-sharing bound is written twice:

    ep       the experts' parameters (and so their gradients and optimizer state) / ep on each rank;
             the experts' compute x EXPERT_IMBALANCE (the busiest rank of an expert group sets the pace;
             without ep each rank runs its own tokens through every expert, balanced by construction);
             per MoE layer a dispatch and a combine all-to-all over the ep ranks, forward and again
             backward (Cluster.all_to_all: tokens x top_k x hidden x 4 bytes per sequence).
             ep loses when those all-to-alls and the imbalance outweigh what the memory saving buys:
             the search picks it when the experts only fit sharded, or the saved memory lets a larger
             micro-batch or no recomputation run.
    sp       (tp > 1) a split block keeps all of its activations / tp, not only the values the TP plan shards;
             each tensor-parallel all-reduce becomes a reduce-scatter and an all-gather (the same ring
             volume, twice the latencies).
    cp       every sequence-dim quantity / cp (FLOPs, saved activations, stage boundaries: each rank
             holds T/cp tokens, and its queries meet all keys, 1/cp of attention's FLOPs); priced as
             dp x cp replicas of T/cp-token sequences (gradients summed over dp x cp, as the runtime
             does). Attention's exchange per layer: ring, cp - 1 key/value block sends forward (and
             2cp - 1 backward: the blocks again and their gradients, the last back home) overlapped
             with the attention's own compute, only what outlasts it showing; its compute is the ring's
             own, timed on this machine (ring_cost.py); all-to-all, two swaps forward (queries/keys/values
             stacked in one, the output back) and two backward, and its own work around the kernel (the swaps'
             buffers and reorders), timed on this machine too.
    compile  the repeated blocks' compute / Cluster.compile_speedup (measured, never assumed) and
             Cluster.compile_seconds amortised over the run's steps; without a measured figure the
             search does not compile, and a factor <= 1 keeps eager on its own pricing.
"""

from __future__ import annotations

import dataclasses

from ..context_parallel.all_to_all import heads_per_rank
from .candidate import Candidate, Estimate
from .profile import ModelProfile
from .ring_cost import ring_adjusted

EXPERT_IMBALANCE = 1.25
"""Tokens the busiest rank of an expert group receives over the mean: top-k routing is not balanced per step
(the common capacity factor 1.25); a stated estimate, not measured."""
RUN_STEPS = 1000
"""Steps a compile time is amortised over when the caller does not say (plan --auto without --steps)."""


def is_plain(c: Candidate) -> bool:
    return c.ep == 1 and not c.sp and c.cp == 1 and not c.compile


def scaled_sequence(profile: ModelProfile, factor: float) -> ModelProfile:
    """The profile of sequences `factor` x as long, or of the T/cp tokens a context-parallel rank holds
    (factor 1/cp): what grows with the tokens scales, the parameters and the fixed terms do not. Attention's
    FLOPs scale linearly too: right for cp (a rank's queries meet every key), a lower bound for longer
    sequences (the search reports the longest sequence that fits the memory, not its time)."""
    def times(values):
        return tuple(v * factor for v in values)

    tps = {t: dataclasses.replace(p, flops=times(p.flops), saved_bytes=times(p.saved_bytes),
                                  allreduce_bytes=times(p.allreduce_bytes)) for t, p in profile.tp.items()}
    crossings = tuple(dataclasses.replace(c, per_seq=c.per_seq * factor, grad_per_seq=c.grad_per_seq * factor)
                      for c in profile.crossings)
    measured = profile.measured
    if measured is not None:
        per_seq = [f.name for f in dataclasses.fields(measured[0])
                   if f.name.endswith("per_seq_s") or f.name.endswith("per_seq")]
        measured = tuple(dataclasses.replace(m, **{k: getattr(m, k) * factor for k in per_seq
                                                   if getattr(m, k) is not None}) for m in measured)
    experts = profile.experts and dataclasses.replace(profile.experts, flops=times(profile.experts.flops),
                                                      dispatch_bytes=times(profile.experts.dispatch_bytes))
    attention = profile.attention and dataclasses.replace(
        profile.attention, kv_bytes=times(profile.attention.kv_bytes), flops=times(profile.attention.flops),
        qkv_out_bytes=times(profile.attention.qkv_out_bytes))
    return dataclasses.replace(profile, seq_len=max(1, round(profile.seq_len * factor)), flops=times(profile.flops),
                               saved_bytes=times(profile.saved_bytes), boundary_bytes=times(profile.boundary_bytes),
                               crossings=crossings, tp=tps, measured=measured, experts=experts, attention=attention,
                               weight_flops=times(profile.weight_flops),
                               weight_out_bytes=times(profile.weight_out_bytes))


def _compute_scaled(profile: ModelProfile, per_block: list[float]) -> ModelProfile:
    """Each block's compute (FLOPs, or measured seconds) x per_block[i]; communication and memory unchanged."""
    tps = {d: dataclasses.replace(t, flops=tuple(f * k for f, k in zip(t.flops, per_block)))
           for d, t in profile.tp.items()}  # every degree, so tp's FLOP share of a measured block stays
    measured = profile.measured
    if measured is not None:
        keys = [f.name for f in dataclasses.fields(measured[0])
                if f.name.endswith("_s") and not f.name.startswith("update")]
        measured = tuple(dataclasses.replace(m, **{k: getattr(m, k) * s for k in keys if getattr(m, k) is not None})
                         for m, s in zip(measured, per_block))
    flops = tuple(f * k for f, k in zip(profile.flops, per_block))
    return dataclasses.replace(profile, tp=tps, measured=measured, flops=flops)


def _with_experts(profile: ModelProfile, cluster, ep: int) -> tuple[ModelProfile, list[tuple]]:
    ex = profile.experts

    def sharded(params):
        return tuple(p - e + e // ep for p, e in zip(params, ex.params))
    profile = dataclasses.replace(profile, params=sharded(profile.params),
                                  tp={d: dataclasses.replace(t, params=sharded(t.params)) for d, t in profile.tp.items()})
    share = [min(e / f, 1.0) if f else 0.0 for e, f in zip(ex.flops, profile.flops)]
    profile = _compute_scaled(profile, [1.0 + (EXPERT_IMBALANCE - 1.0) * s for s in share])
    exchange = []
    for nbytes in ex.dispatch_bytes:  # dispatch + combine, forward; the same two backward
        fixed, per_seq = _linear(lambda b: cluster.all_to_all(b, ep), nbytes)
        exchange.append((2 * fixed, 2 * per_seq, 2 * fixed, 2 * per_seq))
    return profile, exchange


def _linear(cost, nbytes: float) -> tuple[float, float]:
    """A collective's seconds for `nbytes` per sequence as (fixed, per sequence): cost(b x mbs) = fixed + per x mbs
    (latency terms + bytes / bandwidth), read off at one and two sequences."""
    if not nbytes:
        return 0.0, 0.0
    one, two = cost(nbytes), cost(2 * nbytes)
    return 2 * one - two, two - one


def _with_sequence_parallel(profile: ModelProfile, tp: int) -> ModelProfile:
    """A split layer's activations all / tp, but not the last block's (the head): its vocabulary-parallel head
    all-gathers its input to the whole sequence, keeps it, and makes a whole-sequence input gradient, so that block
    holds what it holds without tp plus one whole copy of its input (measured with live_memory on gpt-small,
    tp=2 pp=4 --sp, the last stage at micro-batch 8 and 16: two whole-sequence gathered copies alive at its peak,
    8.7 and 15.0 MiB; its traced share at 1 / tp priced 6.4 and 10.2)."""
    t = profile.tp[tp]
    last = profile.num_blocks - 1
    head = profile.saved_bytes[last] + (profile.boundary_bytes[last - 1] if last > 0 else 0.0)
    saved = tuple(head if i == last else whole / tp if count else s
                  for i, (s, whole, count) in enumerate(zip(t.saved_bytes, profile.saved_bytes, t.allreduce_count)))
    return dataclasses.replace(profile, tp={**profile.tp, tp: dataclasses.replace(
        t, saved_bytes=saved, allreduce_count=tuple(2 * n for n in t.allreduce_count))})


def _context_exchange(profile: ModelProfile, cluster, cp: int, mode: str, rate: float, tp: int = 1) -> list[tuple]:
    """Per block (fixed, per-sequence) seconds forward and backward of attention's exchange, on the T/cp
    profile (its bytes already a rank's share of the tokens; under tp a rank exchanges its 1/tp of the heads)."""
    att = profile.attention
    heads = heads_per_rank(att.heads, tp) / att.heads
    out = []
    for layers, kv, qkvo, flops in zip(att.layers, att.kv_bytes, att.qkv_out_bytes, att.flops):
        kv, qkvo, flops = kv * heads, qkvo * heads, flops * heads
        if not layers:
            out.append((0.0, 0.0, 0.0, 0.0))
            continue
        if mode == "ring":  # cp - 1 sends of a rank's K/V block per layer, hidden behind the attention's compute;
            # backward the blocks' cp - 1 again and their gradients' cp (the last one home: context_parallel/ring.py)
            latency = cluster.intra_node.latency_s * layers
            send = kv / cluster.intra_node.bandwidth_bytes_per_s
            per_seq = max((cp - 1) * send - flops / rate, 0.0)
            back = max((2 * cp - 1) * send - 2 * flops / rate, 0.0)
            out.append(((cp - 1) * latency, per_seq, (2 * cp - 1) * latency, back))
        else:  # two all-to-all swaps per layer each way: q, k, v stacked in one, the output back in another
            swaps = [_linear(lambda b: cluster.all_to_all(b, cp), qkvo / layers * share) for share in (0.75, 0.25)]
            fixed, per_seq = (layers * sum(x) for x in zip(*swaps))
            out.append((fixed, per_seq, fixed, per_seq))
    return out


def _context_waits(profile: ModelProfile, cp: int, mode: str) -> tuple[tuple[int, int], ...]:
    """Per block, the blocking waits of ring attention per micro-batch (forward, backward): per attention layer
    cp - 1 received K/V blocks forward, 2 cp - 1 backward (K/V again, then their gradients). None for all-to-all:
    the calibrated all-to-all's wall time, which the exchange already prices, was measured with every rank in it."""
    if mode != "ring" or profile.attention is None:
        return ()
    return tuple((layers * (cp - 1), layers * (2 * cp - 1)) for layers in profile.attention.layers)


def dimension_profile(profile: ModelProfile, cluster, c: Candidate, rate: float) -> ModelProfile:
    """The profile a rank of `c` runs: the dense profile rewritten for its ep, sp, cp and compile."""
    tp = c.tp
    exchange = [(0.0, 0.0, 0.0, 0.0)] * profile.num_blocks
    if c.cp > 1:
        profile = scaled_sequence(profile, 1.0 / c.cp)
        # the ring's written-out attention, or the all-to-all's swaps around the kernel, measured, for its share
        profile = ring_adjusted(profile, c.cp, c.cp_mode)
        exchange = _context_exchange(profile, cluster, c.cp, c.cp_mode, rate, tp)
        profile = dataclasses.replace(profile, coupled_groups=c.cp, exchange_waits=_context_waits(profile, c.cp,
                                                                                                   c.cp_mode))
    if c.ep > 1 and profile.experts is not None:
        profile, experts = _with_experts(profile, cluster, c.ep)
        exchange = [tuple(a + b for a, b in zip(x, y)) for x, y in zip(exchange, experts)]
    if c.sp and tp > 1:
        profile = _with_sequence_parallel(profile, tp)
    if c.compile and cluster.compile_speedup > 0:
        n = profile.num_blocks  # --compile wraps the repeated blocks, not the prelude and postlude
        factor = 1.0 / cluster.compile_speedup
        profile = _compute_scaled(profile, [factor if 0 < i < n - 1 else 1.0 for i in range(n)])
    return dataclasses.replace(profile, exchange=tuple(exchange))


def evaluate(model, c: Candidate) -> Estimate:
    """`model.evaluate` for a candidate with ep, sp, cp or compile: the plain candidate of dp x cp replicas on
    the profile a rank runs (cached per profile-changing choice), then relabelled and charged its compile time."""
    from .cost import StepModel
    key = (c.ep, c.sp, c.cp, c.cp_mode, c.compile, c.tp)
    variants = model.__dict__.setdefault("_variants", {})
    inner = variants.get(key)
    if inner is None:
        profile = dimension_profile(model.profile, model.cluster, c, model.rate)
        inner = StepModel(profile, model.cluster, global_batch_size=model.global_batch_size * c.cp,
                          dtype=model.dtype, optimizer=model.optimizer, clip_gradients=model.clip)
        variants[key] = inner
    plain = dataclasses.replace(c, dp=c.dp * c.cp, ep=1, sp=False, cp=1, cp_mode="ring", compile=False)
    e = inner.evaluate(plain)
    exchange_f, exchange_b = inner.profile.exchange_seconds(c.micro_batch_size)
    exchanged = c.num_microbatches * (sum(exchange_f) + sum(exchange_b)) / c.pp
    compiling = 0.0
    if c.compile and model.cluster.compile_speedup > 0:
        compiling = model.cluster.compile_seconds / max(getattr(model, "run_steps", None) or RUN_STEPS, 1)
    step = e.step_time_s + compiling
    tokens = model.global_batch_size * model.profile.seq_len
    return dataclasses.replace(e, candidate=c, step_time_s=step, tokens_per_s=tokens / step if step > 0 else 0.0,
                               parts={**e.parts, "exchange_s": exchanged, "compile_amortised_s": compiling})


def compile_note(cluster) -> str:
    """Why the search compiles or not, for the plan's output."""
    if cluster.compile_speedup <= 0:
        return ("compile: not searched, no measured speedup for this cluster (set compile_speedup and "
                "compile_seconds in the cluster file from a --compile run)")
    if cluster.compile_speedup <= 1:
        return (f"compile: measured {cluster.compile_speedup:.2f}x per block on {cluster.name}, no faster than "
                f"eager: the search keeps eager")
    return (f"compile: priced at the measured {cluster.compile_speedup:.2f}x per repeated block, "
            f"{cluster.compile_seconds:g} s of compiling amortised over the run's steps")


def longest_sequence(model, c: Candidate, *, limit: int = 1 << 20) -> int | None:
    """The longest sequence (tokens) layout `c` fits in the device memory by the memory model: a bisection on
    sequences of a multiple of 2 x cp tokens (what context parallelism splits). None when not even the
    shortest fits."""
    from .cost import StepModel
    unit = 2 * c.cp if c.cp > 1 else 1

    def fits(tokens: int) -> bool:
        scaled = scaled_sequence(model.profile, tokens / model.profile.seq_len)
        step = StepModel(scaled, model.cluster, global_batch_size=model.global_batch_size, dtype=model.dtype,
                         optimizer=model.optimizer, clip_gradients=model.clip)
        return step.evaluate(c).fits

    lo, hi = 0, limit // unit
    if not fits(unit):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * unit):
            lo = mid
        else:
            hi = mid - 1
    return lo * unit


_NAMES = {"ep": ("expert parallelism", lambda c: c.ep > 1), "sp": ("sequence parallelism", lambda c: c.sp),
          "cp": ("context parallelism", lambda c: c.cp > 1), "compile": ("compile", lambda c: c.compile)}
_WHY = {"ep": "its dispatch and combine all-to-alls and the busiest expert rank's tokens (x{imbalance:g})",
        "sp": "twice the tensor-parallel collectives' latencies", "cp": "attention's exchange between cp ranks",
        "compile": "the compile time over the run's steps"}


def dimension_notes(ranked: list[Estimate]) -> list[str]:
    """For each of ep, sp, cp and compile the search tried but the winner does not use: why it lost, from the
    fastest fitting plan that uses it (how much slower, and what its exchange costs)."""
    if not ranked:
        return []
    best, notes = ranked[0], []
    for key, (name, uses) in _NAMES.items():
        if uses(best.candidate):
            continue
        rival = next((e for e in ranked if uses(e.candidate)), None)
        if rival is None:
            continue
        slower = rival.step_time_s / best.step_time_s - 1
        exchange = rival.parts.get("exchange_s", 0.0)
        cost = _WHY[key].format(imbalance=EXPERT_IMBALANCE)
        notes.append(f"{name}: its fastest plan ({rival.candidate.describe()}) is predicted {slower:.1%} slower, "
                     f"paying {cost}" + (f" ({exchange * 1e3:.3g} ms of exchange per step)" if exchange else "")
                     + (f" for {rival.peak_memory / 2**20:.3g} MiB per rank instead of "
                        f"{best.peak_memory / 2**20:.3g}" if rival.peak_memory < best.peak_memory else ""))
    return notes
