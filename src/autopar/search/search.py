"""The search: every strategy that fits, scored by the step model; and an MCMC walk over a larger space.

Exhaustive space (`enumerate_candidates`): dp x tp x pp = devices, tp within a node and only
degrees the TP planner accepted for this model; micro-batch size and count dividing the
global batch; every schedule (interleaved with 2 or more chunks, when the stages exist);
recomputation none / stage-aware / whole-stage; partition uniform / parameters / time; the ZeRO
level 0-3. What the runtime runs is the rule table's (config/rules.py, asked per layout by
runnable.py); `search_limits` holds only the search's own (what the cost model prices, one name per
execution). What it leaves alone is coverage.py's table. Precision is not searched: --dtype changes
the numbers trained, so the user's choice stays and the memory and cost models follow it.
Candidates over the device memory are pruned; the rest are ranked by predicted step time.

MCMC (`mcmc`, after FlexFlow): a Metropolis walk whose state also holds the exact cut (layers
per stage) and the recomputed blocks per stage, spaces too large to enumerate for deep
models. A move changes one thing; a slower state is accepted with probability
exp(-beta * relative slowdown). On small models the exhaustive enumeration of the same space
is its oracle (tests/test_search.py).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from ..context_parallel.all_to_all import swaps_heads
from ..errors import ConfigError
from ..pipeline.schedules import SCHEDULES, schedule_spec
from .cost import PARTITIONS, RECOMPUTE, Candidate, Estimate, StepModel
from .equivalence import collapse
from .runnable import broken_rules, runs


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SearchSpace:
    """What may vary; defaults are the full space."""

    nproc: int
    schedules: tuple[str, ...] = tuple(s for s in SCHEDULES if schedule_spec(s).searched)  # the schedule table's
    chunks: tuple[int, ...] = (1, 2)
    recompute: tuple[str, ...] = RECOMPUTE
    partitions: tuple[str, ...] = PARTITIONS
    max_microbatches: int | None = None
    zero_levels: tuple[int, ...] = (0, 1, 2, 3)
    dimensions: bool = True  # also ep, sp, cp and compile (dimensions.py) where the model and the runtime have them
    compile: tuple[bool, ...] | None = None  # None: eager, and compiled where the cluster has a measured speedup


def zero_valid(zero: int, dp: int, tp: int, pp: int, optimizer: str, schedule: str = "1f1b", chunks: int = 1,
               dtype: str = "fp32") -> bool:
    """The rule table's verdict on the ZeRO level alone (runnable.py): no rule broken at `zero` that is not
    already broken at level 0 (the micro-batch split is not known here, so rules about it count for neither)."""
    if zero == 0:
        return True
    at = broken_rules(dp, tp, pp, 1, 1, schedule, chunks, zero, "none", optimizer, dtype)
    return set(at) <= set(broken_rules(dp, tp, pp, 1, 1, schedule, chunks, 0, "none", optimizer, dtype))


def search_limits(schedule: str, pp: int, chunks: int, num_blocks: int) -> bool:
    """The search's own limits, not the runtime's: one name per execution and what the cost model prices."""
    if pp * chunks > num_blocks:  # every stage holds a block
        return False
    if pp == 1:
        return schedule == "1f1b" and chunks == 1  # no pipeline: every schedule is the same loop
    spec = schedule_spec(schedule)
    if spec.placement != "loop":  # the cost model places stages as a loop
        return False
    return (chunks > 1) == (spec.chunks != (1, 1))  # chunks only where they interleave (else: the same execution)


def schedule_valid(schedule: str, pp: int, chunks: int, m: int, num_blocks: int) -> bool:
    """The search's limits, then the rule table on the schedule with `m` micro-batches (chunks, counts)."""
    return search_limits(schedule, pp, chunks, num_blocks) and (
        pp == 1 or runs(1, 1, pp, 1, m, schedule, chunks, 0, "none", "adamw", "fp32"))


def context_degrees(model: StepModel, space: SearchSpace, rest: int) -> list[int]:
    """cp degrees to try out of `rest` ranks: 1, and where the model has scaled-dot-product attention (what the
    runtime rewrites) every divisor whose 2 x cp divides the sequence (context_parallel/layout.py's halves)."""
    att, seq = model.profile.attention, model.profile.seq_len
    if not space.dimensions or att is None:
        return [1]
    return [cp for cp in divisors(rest) if cp == 1 or seq % (2 * cp) == 0]


def all_to_all_runs(model: StepModel, tp: int, cp: int) -> bool:
    """Whether --cp-mode all-to-all runs at tp x cp on this model: the rewrite's own test on every attention."""
    att = model.profile.attention
    return att is not None and all(swaps_heads(h, tp, cp) for h in att.head_counts or (att.heads,))


def dimension_choices(model: StepModel, space: SearchSpace, dp: int, tp: int, cp: int) -> list[tuple]:
    """(ep, sp, cp_mode, compile) to try for one dp x cp x tp: ep over the dp ranks where the model has experts
    (dividing the expert count), sp where tp > 1 divides the sequence, all-to-all where the runtime can swap each
    tp rank's heads over cp (context_parallel's swaps_heads, the rewrite's own test), compile where measured (or
    as `space.compile` says)."""
    prof = model.profile
    compiles = space.compile if space.compile is not None else (
        (False, True) if space.dimensions and model.cluster.compile_speedup > 0 else (False,))
    if not space.dimensions:
        return [(1, False, "ring", c) for c in compiles]
    eps = [1] + ([e for e in divisors(dp) if e > 1 and prof.experts.num_experts % e == 0] if prof.experts else [])
    modes = ["ring"] + (["all-to-all"] if cp > 1 and all_to_all_runs(model, tp, cp) else [])
    sps = (False, True) if tp > 1 and prof.seq_len % tp == 0 else (False,)  # --sp splits the sequence over tp
    return [(ep, sp, mode, comp) for ep in eps for sp in sps
            for mode in modes for comp in compiles]


def enumerate_candidates(model: StepModel, space: SearchSpace) -> Iterator[Candidate]:
    prof, cl, n = model.profile, model.cluster, space.nproc
    for tp in divisors(n):
        if tp > cl.devices_per_node or tp not in prof.tp:
            continue
        for cp, pp in ((cp, pp) for cp in context_degrees(model, space, n // tp) for pp in divisors(n // (tp * cp))):
            dp = n // (tp * pp * cp)
            if model.global_batch_size % dp:
                continue
            per_replica = model.global_batch_size // dp
            for mbs in divisors(per_replica):
                m = per_replica // mbs
                if space.max_microbatches and m > space.max_microbatches:
                    continue
                for schedule in space.schedules:
                    for chunks in space.chunks:
                        if not search_limits(schedule, pp, chunks, prof.num_blocks):
                            continue
                        for recompute, dims in ((r, d) for r in space.recompute
                                                for d in dimension_choices(model, space, dp, tp, cp)):
                            ep, sp, cp_mode, comp = dims
                            zeros = [z for z in space.zero_levels if runs(dp, tp, pp, mbs, m, schedule, chunks, z,
                                                                          recompute, model.optimizer, model.dtype,
                                                                          ep, sp, cp, cp_mode, comp)]
                            for method in (space.partitions if pp > 1 else ("uniform",)):
                                for zero in zeros:
                                    yield Candidate(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=m,
                                                    schedule=schedule, chunks=chunks, recompute=recompute,
                                                    partition=method, zero=zero, ep=ep, sp=sp, cp=cp,
                                                    cp_mode=cp_mode, compile=comp)


@dataclass
class SearchResult:
    ranked: list[Estimate]  # fitting candidates, fastest first, one per execution class (equivalence.py)
    evaluated: int
    pruned: int  # execution classes over the device memory
    smallest_memory: float  # least per-device memory any candidate needs (bytes)
    collapsed: int = 0  # candidates folded into an equivalent one (the same execution under another name)


def exhaustive(model: StepModel, space: SearchSpace, candidates: list[Candidate] | None = None) -> SearchResult:
    """Score every candidate, fold those that execute the same into one (its default-most name), keep what fits."""
    estimates = [model.evaluate(c) for c in (candidates if candidates is not None else
                                             enumerate_candidates(model, space))]
    if not estimates:
        raise ConfigError(f"no strategy exists for {space.nproc} processes and global batch "
                          f"{model.global_batch_size} of {model.profile.name}: no dp x tp x pp with dp dividing the "
                          f"batch; use a global batch size that is a multiple of {space.nproc}")
    distinct, collapsed = collapse(estimates)
    ranked = [e for e in distinct if e.fits]
    ranked.sort(key=lambda e: (e.step_time_s, e.peak_memory))
    return SearchResult(ranked=ranked, evaluated=len(estimates), pruned=len(distinct) - len(ranked),
                        smallest_memory=min(e.peak_memory for e in estimates), collapsed=collapsed)


def require_fit(result: SearchResult, model: StepModel) -> None:
    """A clear error when nothing fits, naming the smallest memory per device that would."""
    if result.ranked:
        return
    need = result.smallest_memory / 2**30
    have = model.cluster.memory_per_device_gb
    raise ConfigError(f"{model.profile.name} fits no configuration on {model.cluster.num_devices} devices of "
                      f"{have:g} GiB ({result.evaluated} tried, all over the memory); the smallest memory per "
                      f"device that works is {need:.3g} GiB (pass --memory-per-device-gb {math.ceil(need * 100) / 100:g} "
                      f"or more, use more devices, or a smaller global batch)")


# ------------------------------------------------------------------------------ MCMC


def _random_bounds(rng: random.Random, blocks: int, stages: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, blocks), stages - 1))
    return tuple([0, *cuts, blocks])


def _neighbour(c: Candidate, model: StepModel, space: SearchSpace, rng: random.Random,
               degrees: list[tuple[int, int, int, int, int]]) -> Candidate:
    """One random change: degrees and micro-batching, schedule, zero level, a cut, or one stage's recomputation."""
    move = rng.randrange(5)
    if move == 0:  # new (dp, tp, pp, mbs, m): start from the time partition of the new stage count
        dp, tp, pp, mbs, m = rng.choice(degrees)
        zero = c.zero if zero_valid(c.zero, dp, tp, pp, model.optimizer, dtype=model.dtype) else 0
        return dataclasses.replace(c, dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=m,
                                   chunks=1, schedule="1f1b", bounds=None, recompute_blocks=None, zero=zero,
                                   ep=1, sp=False, cp=1, cp_mode="ring")  # the degrees list dp x tp x pp layouts
    if move == 1:
        schedule = rng.choice(space.schedules)
        chunks = rng.choice(space.chunks)
        return dataclasses.replace(c, schedule=schedule, chunks=chunks, bounds=None, recompute_blocks=None)
    if move == 4:
        return dataclasses.replace(c, zero=rng.choice(space.zero_levels))
    stages = c.pp * c.chunks
    bounds = list(c.bounds or model.bounds(c.partition, c.tp, c.micro_batch_size, stages))
    if move == 2 and stages > 1:  # move one cut by one block
        i = rng.randrange(1, stages)
        bounds[i] += rng.choice((-1, 1))
        return dataclasses.replace(c, bounds=tuple(bounds))
    rc = list(c.recompute_blocks or (0,) * stages)
    s = rng.randrange(stages)
    rc[s] = max(0, min(bounds[s + 1] - bounds[s], rc[s] + rng.choice((-1, 1))))
    return dataclasses.replace(c, bounds=tuple(bounds), recompute_blocks=tuple(rc), recompute="none")


def enumerate_mcmc_space(model: StepModel, space: SearchSpace) -> Iterator[Candidate]:
    """Every state the MCMC walk can reach (every cut, every per-stage recompute count): the oracle on
    models small enough to list it."""
    import itertools
    blocks = model.profile.num_blocks
    base = dataclasses.replace(space, recompute=("none",), partitions=("time",))
    for c in enumerate_candidates(model, base):
        stages = c.pp * c.chunks
        for cuts in itertools.combinations(range(1, blocks), stages - 1):
            bounds = (0, *cuts, blocks)
            sizes = [bounds[s + 1] - bounds[s] for s in range(stages)]
            for rc in itertools.product(*(range(n + 1) for n in sizes)):
                yield dataclasses.replace(c, bounds=bounds, recompute_blocks=tuple(rc))


def valid(c: Candidate, model: StepModel) -> bool:
    blocks = model.profile.num_blocks
    if not search_limits(c.schedule, c.pp, c.chunks, blocks):
        return False
    if not runs(c.dp, c.tp, c.pp, c.micro_batch_size, c.num_microbatches, c.schedule, c.chunks, c.zero,
                "stage-aware" if c.recompute_blocks else c.recompute, model.optimizer, model.dtype, c.ep, c.sp, c.cp,
                c.cp_mode, c.compile):
        return False
    if c.cp > 1 and c.cp_mode == "all-to-all" and not all_to_all_runs(model, c.tp, c.cp):
        return False
    if c.bounds is not None:
        b = c.bounds
        if len(b) != c.pp * c.chunks + 1 or b[0] != 0 or b[-1] != blocks or any(x >= y for x, y in zip(b, b[1:])):
            return False
    return True


def mcmc(model: StepModel, space: SearchSpace, *, steps: int = 2000, seed: int = 0, beta: float = 20.0,
         start: Candidate | None = None) -> tuple[Estimate | None, int]:
    """Metropolis search; returns the fastest fitting estimate seen and the number of states scored."""
    rng = random.Random(seed)
    degrees = sorted({(c.dp, c.tp, c.pp, c.micro_batch_size, c.num_microbatches)
                      for c in enumerate_candidates(model, dataclasses.replace(space, schedules=("1f1b",),
                                                                                chunks=(1,), recompute=("none",),
                                                                                partitions=("time",),
                                                                                zero_levels=(0,), dimensions=False,
                                                                                compile=(False,)))})
    if not degrees:
        return None, 0
    if start is None:
        dp, tp, pp, mbs, m = rng.choice(degrees)
        start = Candidate(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=m)
    seen: dict[Candidate, Estimate] = {}

    def score(c: Candidate) -> Estimate:
        if c not in seen:
            seen[c] = model.evaluate(c)
        return seen[c]

    def energy(e: Estimate) -> float:
        return e.step_time_s * (1.0 if e.fits else 10.0 * e.peak_memory / model.cluster.memory_bytes)

    current = score(start)
    best = current if current.fits else None
    for _ in range(steps):
        proposal = _neighbour(current.candidate, model, space, rng, degrees)
        if not valid(proposal, model):
            continue
        new = score(proposal)
        if new.fits and (best is None or new.step_time_s < best.step_time_s):
            best = new
        ratio = (energy(new) - energy(current)) / energy(current)
        if ratio <= 0 or rng.random() < math.exp(-beta * ratio):
            current = new
    return best, len(seen)


# ------------------------------------------------------------------------------ explanation


def differing(a: float, b: float, form) -> tuple[str, str] | None:
    """`form(value, digits)` of a and b with the fewest digits (3 to 6) at which they read differently; None
    when they are equal at 6 digits (then no sentence may set them side by side)."""
    for digits in range(3, 7):
        x, y = form(a, digits), form(b, digits)
        if x != y:
            return x, y
    return None


def ms(seconds: float, digits: int = 3) -> str:
    return f"{seconds * 1e3:.{digits}g} ms"


def share(fraction: float, digits: int = 3) -> str:
    return f"{fraction * 100:.{digits - 3}f}%"


def percent(x: float) -> str:
    """A relative difference with as many decimals as it takes not to read 0.0% (up to 4)."""
    for decimals in range(1, 5):
        text = f"{x * 100:.{decimals}f}%"
        if float(text[:-1]) != 0:
            return text
    return f"{x * 100:.1f}%"


def why(winner: Estimate, runner_up: Estimate | None) -> str:
    """One sentence on why the winner beats the best structurally different runner-up (the search keeps one
    configuration per execution, so they differ), from the part of the step that differs most, in numbers
    that differ."""
    if runner_up is None:
        return "it is the only configuration that fits the device memory."
    a, b = winner, runner_up
    gain = (b.step_time_s - a.step_time_s) / b.step_time_s
    ca, cb = a.candidate, b.candidate
    changed = [f"{name} {getattr(ca, name)} vs {getattr(cb, name)}" for name in
               ("dp", "tp", "pp", "micro_batch_size", "num_microbatches", "schedule", "chunks", "recompute", "partition",
                "zero", "ep", "sp", "cp", "cp_mode", "compile")
               if getattr(ca, name) != getattr(cb, name)]
    dp_a = a.parts["dp_exposed_s"] + a.parts["optimizer_s"]
    dp_b = b.parts["dp_exposed_s"] + b.parts["optimizer_s"]
    reasons = [  # (how much of b's step it explains, a's value, b's value, form, sentence)
        (b.bubble - a.bubble, a.bubble, b.bubble, share, "its pipeline idles {} of the step instead of {}"),
        (b.comm_share - a.comm_share, a.comm_share, b.comm_share, share,
         "communication takes {} of its step instead of {}"),
        ((dp_b - dp_a) / b.step_time_s, dp_a, dp_b, ms,
         "its data-parallel communication and optimizer step take {} instead of {}"),
        ((b.parts["pipeline_s"] - a.parts["pipeline_s"]) / b.step_time_s, a.parts["pipeline_s"],
         b.parts["pipeline_s"], ms, "its pipeline (compute and transfers) takes {} instead of {}"),
        ((b.parts.get("time_shared_s", 0.0) - a.parts.get("time_shared_s", 0.0)) / b.step_time_s,
         a.parts.get("time_shared_s", 0.0), b.parts.get("time_shared_s", 0.0), ms,
         "its ranks' CPU, shared over the cores, takes {} instead of {}"),
        ((b.parts.get("exchange_s", 0.0) - a.parts.get("exchange_s", 0.0)) / b.step_time_s,
         a.parts.get("exchange_s", 0.0), b.parts.get("exchange_s", 0.0), ms,
         "its expert all-to-alls and attention exchanges take {} instead of {}"),
    ]
    text = None
    for _, x, y, form, sentence in sorted(reasons, key=lambda r: -r[0]):
        pair = differing(x, y, form)
        if pair is not None and (x < y) == (a.step_time_s <= b.step_time_s):
            text = sentence.format(*pair)
            break
    times = differing(a.step_time_s, b.step_time_s, ms)
    memory = differing(a.peak_memory / 2**20, b.peak_memory / 2**20, lambda v, d: f"{v:.{d}g} MiB")
    what = "; ".join(changed) if changed else "a different cut or recomputation"
    if times is None:  # equal predicted times: the ranking's tie-break is the memory
        if memory is not None:
            return (f"the winner is predicted as fast as the runner-up ({what}, {ms(a.step_time_s)}) and needs "
                    f"less memory per rank ({memory[0]} instead of {memory[1]}).")
        return (f"the winner and the runner-up ({what}) are predicted alike ({ms(a.step_time_s)}, "
                f"{a.peak_memory / 2**20:.3g} MiB per rank); the winner comes first.")
    text = text or f"its step is predicted at {times[0]} instead of {times[1]}"
    return f"the winner is {percent(gain)} faster than the runner-up ({what}) because {text}."
