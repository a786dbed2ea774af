"""The pipeline part of a step's time, from the project's schedule simulator (pipeline/simulate.py).

The simulator plays the real action lists of a schedule against per-stage costs: forward,
backward (or its input and weight halves for zero-bubble schedules), recompute, and the
transfer time of each stage's sends. It is exact for its model but costs O(stages x
micro-batches) Python work per call, so for long schedules this module simulates two
shorter ones in steady state (2pp and 3pp micro-batches) and extends the result linearly:
once every stage is past its warm-up, each further micro-batch adds the same work and the
same delay (checked against full simulation in tests/test_search.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.actions import Action, Op
from ..pipeline.schedules import build_schedule
from ..pipeline.simulate import simulate

SIMULATE_LIMIT = 0  # stages x micro-batches above which a schedule longer than 3pp micro-batches is extrapolated
ROUND_DIGITS = 3  # significant digits kept of each normalised stage cost when looking up the cache


@dataclass(frozen=True)
class StageCosts:
    """Seconds per micro-batch of each global stage's actions, and of its outgoing transfers."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    recompute: tuple[float, ...]
    send_activation: tuple[float, ...]  # stage s -> s + 1
    send_gradient: tuple[float, ...]  # stage s -> s - 1


@dataclass(frozen=True)
class PipelineTimes:
    """What the search needs from a simulated timeline."""

    makespan: float
    finish: tuple[float, ...]  # per pipeline rank: when its last compute ends
    busy: tuple[float, ...]  # per pipeline rank: seconds of compute
    in_flight: tuple[int, ...]  # per global stage: most micro-batches whose activations are alive at once
    stashed: tuple[int, ...]  # per global stage: most stashed inputs (recomputing stages)

    @property
    def bubble(self) -> float:
        """Mean idle fraction of the pipeline ranks."""
        if self.makespan <= 0:
            return 0.0
        return sum(1 - b / self.makespan for b in self.busy) / len(self.busy)


def _simulate(schedule: str, pp: int, chunks: int, m: int, recompute: frozenset[int],
              costs: StageCosts, cache: dict | None = None) -> PipelineTimes:
    stages = pp * chunks
    key = (schedule, pp, chunks, m, recompute)
    if cache is not None and (key, costs) in cache:
        return cache[(key, costs)]
    lists = cache.get(key) if cache is not None else None
    if lists is None:
        lists = build_schedule(schedule, pp=pp, num_microbatches=m, chunks=chunks, recompute=recompute)
        if cache is not None:
            cache[key] = lists

    def cost(action: Action) -> float:
        s, op = action.stage, action.op
        if op == Op.FORWARD:
            return costs.forward[s]
        if op == Op.BACKWARD:
            return costs.backward[s]
        if op == Op.RECOMPUTE:
            return costs.recompute[s]
        return costs.backward[s] / 2  # BACKWARD_INPUT and BACKWARD_WEIGHT: about half each

    def comm(action: Action) -> float:
        return costs.send_activation[action.stage] if action.op == Op.SEND_ACT else costs.send_gradient[action.stage]

    timeline = simulate(lists, pp=pp, num_stages=stages, num_microbatches=m, cost=cost, comm_cost=comm)
    finish, busy = [0.0] * pp, [0.0] * pp
    for rank, start, end, action in timeline.compute_events():
        finish[rank] = max(finish[rank], end)
        busy[rank] += end - start
    result = PipelineTimes(makespan=timeline.makespan, finish=tuple(finish), busy=tuple(busy),
                           in_flight=tuple(timeline.peak_activations.get(s, 0) for s in range(stages)),
                           stashed=tuple(timeline.stashed_inputs.get(s, 0) for s in range(stages)))
    if cache is not None:
        cache[(key, costs)] = result  # the two steady-state runs serve every longer schedule
    return result


def pipeline_times(schedule: str, *, pp: int, chunks: int, num_microbatches: int, recompute: frozenset[int],
                   costs: StageCosts, limit: int = SIMULATE_LIMIT, cache: dict | None = None) -> PipelineTimes:
    """Simulate the schedule, directly when short, else from two steady-state simulations.

    `cache` (a dict the caller owns) keeps built schedules and simulated timelines between calls.
    """
    m = num_microbatches
    low, high = 2 * pp, 3 * pp
    if m * pp * chunks <= limit or m <= high:
        return _simulate(schedule, pp, chunks, m, recompute, costs, cache)
    a = _simulate(schedule, pp, chunks, low, recompute, costs, cache)
    b = _simulate(schedule, pp, chunks, high, recompute, costs, cache)
    t = (m - low) / (high - low)

    def line(x: tuple, y: tuple, integer: bool = False) -> tuple:
        out = tuple(u + (v - u) * t for u, v in zip(x, y))
        return tuple(int(round(v)) for v in out) if integer else out

    return PipelineTimes(makespan=a.makespan + (b.makespan - a.makespan) * t, finish=line(a.finish, b.finish),
                         busy=line(a.busy, b.busy), in_flight=line(a.in_flight, b.in_flight, True),
                         stashed=line(a.stashed, b.stashed, True))


def normalised(costs: StageCosts) -> tuple[float, StageCosts]:
    """(scale, costs / scale rounded to ROUND_DIGITS significant digits): timelines scale with their costs,
    so candidates whose stage costs have the same shape (other micro-batch sizes) share one simulation."""
    scale = max(f + b for f, b in zip(costs.forward, costs.backward)) or 1.0

    def r(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(float(f"{v / scale:.{ROUND_DIGITS}g}") for v in values)

    return scale, StageCosts(r(costs.forward), r(costs.backward), r(costs.recompute), r(costs.send_activation),
                             r(costs.send_gradient))


def scaled(times: PipelineTimes, scale: float) -> PipelineTimes:
    return PipelineTimes(makespan=times.makespan * scale, finish=tuple(v * scale for v in times.finish),
                         busy=tuple(v * scale for v in times.busy), in_flight=times.in_flight, stashed=times.stashed)
