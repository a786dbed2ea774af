"""The pipeline part of a step's time, from the project's schedule simulator (pipeline/simulate.py).

The simulator plays the real action lists of a schedule against per-stage costs: forward,
backward (or, for zero-bubble schedules, its input half I and weight half W, each priced on its
own: cost.py), recompute, and the transfer time of each stage's sends. It is exact for its model but costs O(stages x
micro-batches) Python work per call, so for long schedules this module simulates two
shorter ones in steady state (2pp and 3pp micro-batches) and extends the result linearly:
once every stage is past its warm-up, each further micro-batch adds the same work and the
same delay (checked against full simulation in tests/test_search.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.actions import Action, Op, stage_to_rank
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
    backward_input: tuple[float, ...] = ()  # a zero-bubble schedule's I; empty: half the backward
    backward_weight: tuple[float, ...] = ()  # its W; empty: half the backward

    def split(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(I, W) seconds per stage: as given, else half the backward each."""
        half = tuple(b / 2 for b in self.backward)
        return self.backward_input or half, self.backward_weight or half


@dataclass(frozen=True)
class PipelineTimes:
    """What the search needs from a simulated timeline."""

    makespan: float
    finish: tuple[float, ...]  # per pipeline rank: when its last compute ends
    busy: tuple[float, ...]  # per pipeline rank: seconds of compute
    in_flight: tuple[int, ...]  # per global stage: most micro-batches whose activations are alive at once
    stashed: tuple[int, ...]  # per global stage: most stashed inputs (recomputing stages)
    split_held: tuple[int, ...] = ()  # per global stage: most micro-batches between an I's start and its W's end

    @property
    def bubble(self) -> float:
        """Mean idle fraction of the pipeline ranks."""
        if self.makespan <= 0:
            return 0.0
        return sum(1 - b / self.makespan for b in self.busy) / len(self.busy)


@dataclass(frozen=True)
class CompiledSchedule:
    """One schedule's timing as a longest-path sweep, built once and evaluated for any stage costs.

    The simulator runs each rank's list in order: a compute action starts when the rank's
    previous one ends and its inputs are there; a transfer leaves at the latest of its producer's
    end and the times its send and receive were posted (the end of the compute before each in
    its rank's list). With the order fixed, those are the same max-plus equations for every cost
    vector, so they are recorded once (from one simulation, whose start times give a valid
    evaluation order) and swept per candidate: plain float arithmetic instead of the simulator's
    event loop. The live-activation counts depend only on the order (costs are positive), so they
    are kept from that run. tests/test_search.py checks the sweep against simulate() itself.
    """

    pp: int
    kind: tuple[int, ...]  # per action, in evaluation order: 0 forward, 1 backward, 2 recompute, 3 I, 4 W
    stage: tuple[int, ...]
    rank: tuple[int, ...]
    prev: tuple[int, ...]  # the previous compute action on the same rank (-1: none)
    deps: tuple[tuple[tuple[int, int, int, int, int], ...], ...]  # (producer, send post, recv post, transfer, stage)
    in_flight: tuple[int, ...]
    stashed: tuple[int, ...]
    split_held: tuple[int, ...] = ()

    def times(self, costs: StageCosts) -> PipelineTimes:
        per_kind = (costs.forward, costs.backward, costs.recompute, *costs.split())
        transfer = (costs.send_activation, costs.send_gradient)
        end = [0.0] * len(self.kind)
        finish, busy = [0.0] * self.pp, [0.0] * self.pp
        rows = zip(self.kind, self.stage, self.rank, self.prev, self.deps)
        for i, (kind, stage, rank, prev, deps) in enumerate(rows):
            t = end[prev] if prev >= 0 else 0.0
            for producer, send_post, recv_post, link, link_stage in deps:
                ready = end[producer]
                if link >= 0:
                    if send_post >= 0 and end[send_post] > ready:
                        ready = end[send_post]
                    if recv_post >= 0 and end[recv_post] > ready:
                        ready = end[recv_post]
                    ready += transfer[link][link_stage]
                if ready > t:
                    t = ready
            c = per_kind[kind][stage]
            end[i] = t + c
            busy[rank] += c
            if end[i] > finish[rank]:
                finish[rank] = end[i]
        return PipelineTimes(makespan=max(end, default=0.0), finish=tuple(finish), busy=tuple(busy),
                             in_flight=self.in_flight, stashed=self.stashed, split_held=self.split_held)


    def shared_makespan(self, costs: StageCosts, rate) -> float:
        """The makespan when the pipeline ranks share cores: while k of them have an action ready, each runs it
        at `rate(k)` of its alone speed (processor sharing; a fluid model of the OS scheduler). The sweep in
        `times` assumes every rank has a core; the time-shared bound in cost.py assumes the cores never idle.
        Neither holds on an oversubscribed CPU with a pipeline: while it warms up and drains, fewer ranks are
        ready than there are cores, and the cores idle. Transfers take their wall time and no core."""
        per_kind = (costs.forward, costs.backward, costs.recompute, *costs.split())
        transfer = (costs.send_activation, costs.send_gradient)
        n = len(self.kind)
        queues: list[list[int]] = [[] for _ in range(self.pp)]
        for i in range(n):
            queues[self.rank[i]].append(i)
        end: list[float | None] = [None] * n
        head = [0] * self.pp
        left = [per_kind[self.kind[q[0]]][self.stage[q[0]]] if q else 0.0 for q in queues]

        def ready(i: int) -> float | None:
            prev = self.prev[i]
            if prev >= 0 and end[prev] is None:
                return None
            t = end[prev] if prev >= 0 else 0.0
            for producer, send_post, recv_post, link, link_stage in self.deps[i]:
                if end[producer] is None:
                    return None
                at = end[producer]
                if link >= 0:
                    for post in (send_post, recv_post):
                        if post >= 0:
                            if end[post] is None:
                                return None
                            at = max(at, end[post])
                    at += transfer[link][link_stage]
                t = max(t, at)
            return t

        now, done = 0.0, 0
        while done < n:
            starts = {r: ready(queues[r][head[r]]) for r in range(self.pp) if head[r] < len(queues[r])}
            running = [r for r, t in starts.items() if t is not None and t <= now + 1e-15]
            later = [t for t in starts.values() if t is not None and t > now + 1e-15]
            if not running:
                if not later:
                    raise RuntimeError("shared_makespan: no action can run (the compiled schedule deadlocks)")
                now = min(later)
                continue
            speed = rate(len(running))
            step = min(left[r] / speed for r in running)
            if later and min(later) - now < step:
                step = min(later) - now
            now += step
            for r in running:
                left[r] -= speed * step
                if left[r] <= 1e-12:
                    i = queues[r][head[r]]
                    end[i] = now
                    done += 1
                    head[r] += 1
                    if head[r] < len(queues[r]):
                        nxt = queues[r][head[r]]
                        left[r] = per_kind[self.kind[nxt]][self.stage[nxt]]
        return now


def compile_schedule(lists, *, pp: int, chunks: int, m: int) -> CompiledSchedule:
    """Record the dependency equations of `lists` (one simulation with unit costs fixes the evaluation order)."""
    stages = pp * chunks
    timeline = simulate(lists, pp=pp, num_stages=stages, num_microbatches=m)
    order = [action for _, _, _, action in timeline.compute_events()]  # by start time: producers first
    index = {(a.stage, a.op, a.microbatch): i for i, a in enumerate(order)}
    rank_of = {s: stage_to_rank(s, pp, stages, "loop") for s in range(stages)}  # as simulate() places stages
    prev, posted = [-1] * len(order), {}
    for r, acts in lists.items():
        last = -1
        for a in acts:
            key = (a.stage, a.op, a.microbatch)
            if a.op.is_comm:
                posted[key] = last
            else:
                prev[index[key]] = last
                last = index[key]
    split = {(a.stage, a.microbatch) for a in order if a.op == Op.BACKWARD_INPUT}
    recomputed = {(a.stage, a.microbatch) for a in order if a.op == Op.RECOMPUTE}

    def dep(producer: tuple, send_op: Op, consumer_stage: int, recv_op: Op, link: int) -> tuple:
        if rank_of[producer[0]] == rank_of[consumer_stage]:
            return (index[producer], -1, -1, -1, 0)
        mb = producer[2]
        send, recv = posted.get((producer[0], send_op, mb), -1), posted.get((consumer_stage, recv_op, mb), -1)
        return (index[producer], send, recv, link, producer[0])

    kinds = {Op.FORWARD: 0, Op.BACKWARD: 1, Op.RECOMPUTE: 2, Op.BACKWARD_INPUT: 3, Op.BACKWARD_WEIGHT: 4}
    deps = []
    for a in order:
        s, op, mb = a.stage, a.op, a.microbatch
        mine = []
        if op == Op.FORWARD and s > 0:
            mine.append(dep((s - 1, Op.FORWARD, mb), Op.SEND_ACT, s, Op.RECV_ACT, 0))
        if op in (Op.RECOMPUTE, Op.BACKWARD, Op.BACKWARD_INPUT):
            mine.append((index[(s, Op.FORWARD, mb)], -1, -1, -1, 0))
        if op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            if (s, mb) in recomputed:
                mine.append((index[(s, Op.RECOMPUTE, mb)], -1, -1, -1, 0))
            if s < stages - 1:
                grad = Op.BACKWARD_INPUT if (s + 1, mb) in split else Op.BACKWARD
                mine.append(dep((s + 1, grad, mb), Op.SEND_GRAD, s, Op.RECV_GRAD, 1))
        if op == Op.BACKWARD_WEIGHT:
            mine.append((index[(s, Op.BACKWARD_INPUT, mb)], -1, -1, -1, 0))
        deps.append(tuple(mine))
    return CompiledSchedule(pp=pp, kind=tuple(kinds[a.op] for a in order), stage=tuple(a.stage for a in order),
                            rank=tuple(rank_of[a.stage] for a in order), prev=tuple(prev), deps=tuple(deps),
                            in_flight=tuple(timeline.peak_activations.get(s, 0) for s in range(stages)),
                            stashed=tuple(timeline.stashed_inputs.get(s, 0) for s in range(stages)),
                            split_held=split_held(timeline.compute_events(), stages))


def split_held(events, stages: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches at once between the start of their I and the end of their W: each
    holds the gradients I kept for W (split_backward.WeightWork), on top of its activations. 0: no split."""
    began, ended = {}, {}
    for _, start, end, action in events:
        if action.op == Op.BACKWARD_INPUT:
            began[(action.stage, action.microbatch)] = start
        elif action.op == Op.BACKWARD_WEIGHT:
            ended[(action.stage, action.microbatch)] = end
    out = []
    for s in range(stages):
        points = sorted(p for (stage, mb), t in began.items() if stage == s
                        for p in ((t, 1), (ended.get((stage, mb), float("inf")), -1)))
        live = best = 0
        for _, delta in sorted(points, key=lambda p: (p[0], p[1])):  # an end before a start at the same time
            live += delta
            best = max(best, live)
        out.append(best)
    return tuple(out)


def _compiled(schedule: str, pp: int, chunks: int, m: int, recompute: frozenset[int],
              cache: dict | None = None) -> CompiledSchedule:
    """The schedule's compiled equations, built once per shape and kept in `cache` (a dict the caller owns)."""
    key = ("compiled", schedule, pp, chunks, m, recompute)
    compiled = cache.get(key) if cache is not None else None
    if compiled is None:
        lists = build_schedule(schedule, pp=pp, num_microbatches=m, chunks=chunks, recompute=recompute)
        compiled = compile_schedule(lists, pp=pp, chunks=chunks, m=m)
        if cache is not None:
            cache[key] = compiled
            cache[("lists", *key[1:])] = lists  # memory_walk.schedule_walks walks the same lists
    return compiled


def _simulate(schedule: str, pp: int, chunks: int, m: int, recompute: frozenset[int],
              costs: StageCosts, cache: dict | None = None) -> PipelineTimes:
    return _compiled(schedule, pp, chunks, m, recompute, cache).times(costs)


def simulated(schedule: str, pp: int, chunks: int, m: int, recompute: frozenset[int],
              costs: StageCosts) -> PipelineTimes:
    """The simulator itself on these costs (what CompiledSchedule must reproduce; tests compare the two)."""
    lists = build_schedule(schedule, pp=pp, num_microbatches=m, chunks=chunks, recompute=recompute)

    backward_input, backward_weight = costs.split()

    def cost(action: Action) -> float:
        s, op = action.stage, action.op
        if op == Op.FORWARD:
            return costs.forward[s]
        if op == Op.BACKWARD:
            return costs.backward[s]
        if op == Op.RECOMPUTE:
            return costs.recompute[s]
        return backward_input[s] if op == Op.BACKWARD_INPUT else backward_weight[s]

    def comm(action: Action) -> float:
        return costs.send_activation[action.stage] if action.op == Op.SEND_ACT else costs.send_gradient[action.stage]

    timeline = simulate(lists, pp=pp, num_stages=pp * chunks, num_microbatches=m, cost=cost, comm_cost=comm)
    finish, busy = [0.0] * pp, [0.0] * pp
    for rank, start, end, _ in timeline.compute_events():
        finish[rank] = max(finish[rank], end)
        busy[rank] += end - start
    return PipelineTimes(makespan=timeline.makespan, finish=tuple(finish), busy=tuple(busy),
                         in_flight=tuple(timeline.peak_activations.get(s, 0) for s in range(pp * chunks)),
                         stashed=tuple(timeline.stashed_inputs.get(s, 0) for s in range(pp * chunks)),
                         split_held=split_held(timeline.compute_events(), pp * chunks))


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
                         stashed=line(a.stashed, b.stashed, True), split_held=line(a.split_held, b.split_held, True))


def shared_pipeline_makespan(schedule: str, *, pp: int, chunks: int, num_microbatches: int,
                             recompute: frozenset[int], costs: StageCosts, rate, cache: dict | None = None) -> float:
    """CompiledSchedule.shared_makespan of the schedule, extrapolated from two steady-state lengths past 3pp
    micro-batches as pipeline_times does."""
    def one(m: int) -> float:
        return _compiled(schedule, pp, chunks, m, recompute, cache).shared_makespan(costs, rate)

    m, low, high = num_microbatches, 2 * pp, 3 * pp
    if m <= high:
        return one(m)
    a, b = one(low), one(high)
    return a + (b - a) * (m - low) / (high - low)


def normalised(costs: StageCosts) -> tuple[float, StageCosts]:
    """(scale, costs / scale rounded to ROUND_DIGITS significant digits): timelines scale with their costs,
    so candidates whose stage costs have the same shape (other micro-batch sizes) share one simulation."""
    scale = max(f + b for f, b in zip(costs.forward, costs.backward)) or 1.0

    def r(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(float(f"{v / scale:.{ROUND_DIGITS}g}") for v in values)

    return scale, StageCosts(r(costs.forward), r(costs.backward), r(costs.recompute), r(costs.send_activation),
                             r(costs.send_gradient), r(costs.backward_input), r(costs.backward_weight))


def scaled(times: PipelineTimes, scale: float) -> PipelineTimes:
    return PipelineTimes(makespan=times.makespan * scale, finish=tuple(v * scale for v in times.finish),
                         busy=tuple(v * scale for v in times.busy), in_flight=times.in_flight, stashed=times.stashed,
                         split_held=times.split_held)
