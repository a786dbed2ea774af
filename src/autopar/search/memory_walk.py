"""What one pipeline rank keeps alive at each action of its schedule: the walk behind the memory model's peak.

A rank's memory depends only on the order of its own actions (pipeline/runtime.py), not on their timing, so
the walk steps through the lowered action list (schedules.build_schedule) and counts, per stage of the rank,
what is alive at each compute action:

    activations   micro-batches between the end of their F (or the start of their R under whole-stage
                  recomputation) and the end of their B (or W: an I keeps its graph for W)
    stashed       micro-batches whose stage input is kept: from F to the end of B (or W)
    held          zero-bubble: micro-batches between the start of I and the end of W (what I keeps for W)
    sent_outputs  activations sent so far: a sent tensor lives to the step's end (pipeline/p2p.py wait_sends)
    sent_grads    input gradients made so far for a stage on another rank (likewise kept to the end)
    grads_in      output gradients received (from RECV_B's post) or handed over on the rank, not yet consumed
    transient     1 while this stage's B, I or W runs (one block's backward working set)

A snapshot is taken during every compute action (with what it builds) and once at the step's end. The
memory model prices each count in bytes per stage (memory.py) and takes the largest priced snapshot: the
peak of the sum, not the sum of each term's own peak. Snapshots below another in every count can never be
the peak and are dropped, so pricing a candidate is a few dot products.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import mul

from ..pipeline.actions import Op, Schedule, stage_to_rank
from ..pipeline.schedules import build_schedule, placement

COUNTS = ("activations", "stashed", "held", "sent_outputs", "sent_grads", "grads_in", "transient")
Snapshot = tuple[tuple[float, ...], ...]  # per stage of the rank (in `RankWalk.stages` order), COUNTS


@dataclass(frozen=True)
class RankWalk:
    """The snapshots of one rank that could be its peak, whatever the bytes of each count."""

    stages: tuple[int, ...]
    snapshots: tuple[Snapshot, ...]
    flat: tuple[tuple[float, ...], ...] = field(init=False, repr=False, compare=False)  # each snapshot, flattened

    def __post_init__(self) -> None:
        object.__setattr__(self, "flat", tuple(tuple(c for counts in snap for c in counts) for snap in self.snapshots))

    def peak(self, unit_bytes: dict[int, tuple[float, ...]], only: int | None = None) -> Snapshot:
        """The snapshot with the most bytes, each count priced by `unit_bytes[stage]` (COUNTS order); `only`:
        the stage whose bytes alone are counted (a stage's own peak, to size its recomputation)."""
        if len(self.snapshots) == 1:
            return self.snapshots[0]
        zero = (0.0,) * len(COUNTS)
        units = [u for s in self.stages for u in (unit_bytes[s] if only is None or s == only else zero)]
        flat = self.flat
        best = max(range(len(flat)), key=lambda i: sum(map(mul, flat[i], units)))
        return self.snapshots[best]


def walk_schedule(lists: Schedule, *, pp: int, num_stages: int, style: str = "loop") -> dict[int, RankWalk]:
    """Per rank, the snapshots of what is alive (see the module docstring), dominated ones dropped."""
    rank_of = {s: stage_to_rank(s, pp, num_stages, style) for s in range(num_stages)}
    rank_of |= {a.stage: rank for rank, acts in lists.items() for a in acts}  # where the lists run each stage
    whole = {a.stage for acts in lists.values() for a in acts if a.op == Op.RECOMPUTE}
    out = {}
    for rank, acts in lists.items():
        stages = tuple(sorted({a.stage for a in acts}))
        where = {s: i for i, s in enumerate(stages)}
        live = [[0] * len(COUNTS) for _ in stages]
        act, stash, held, sent_out, sent_grad, grad_in, transient = range(len(COUNTS))
        snaps: list[Snapshot] = []

        def snap() -> None:
            snaps.append(tuple(tuple(float(c) for c in counts) for counts in live))

        for a in acts:
            s, op = a.stage, a.op
            mine = live[where[s]]
            if op == Op.SEND_ACT:
                mine[sent_out] += 1
            elif op == Op.RECV_GRAD:
                mine[grad_in] += 1
            elif op == Op.FORWARD:
                mine[stash] += 1
                if s not in whole:
                    mine[act] += 1
                snap()
            elif op == Op.RECOMPUTE:
                mine[act] += 1
                snap()
            elif op in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
                mine[transient] = 1
                snap()
                mine[transient] = 0
                if op != Op.BACKWARD_WEIGHT:  # the output gradient is consumed, the input gradient made
                    if s < num_stages - 1:
                        mine[grad_in] -= 1
                    if s > 0:
                        if rank_of[s - 1] == rank:  # handed to the previous stage on this rank
                            live[where[s - 1]][grad_in] += 1
                        else:
                            mine[sent_grad] += 1
                if op == Op.BACKWARD_INPUT:
                    mine[held] += 1
                else:  # B, or the W that ends an I's micro-batch: its graph and input go
                    if op == Op.BACKWARD_WEIGHT:
                        mine[held] -= 1
                    mine[act] -= 1
                    mine[stash] -= 1
        snap()
        out[rank] = RankWalk(stages=stages, snapshots=_undominated(snaps))
    return out


def _undominated(snaps: list[Snapshot]) -> tuple[Snapshot, ...]:
    """The snapshots no other one covers in every count (those alone can be a peak)."""
    flat = sorted({tuple(c for counts in x for c in counts): x for x in snaps}.items(), key=lambda kv: -sum(kv[0]))
    kept: list[tuple[tuple[float, ...], Snapshot]] = []
    for fx, x in flat:
        if not any(all(a >= b for a, b in zip(fy, fx)) for fy, _ in kept):
            kept.append((fx, x))
    return tuple(x for _, x in kept)


def extrapolate(low: Snapshot, high: Snapshot, t: float) -> Snapshot:
    """Counts on the line through two steady-state snapshots (t = 0 at `low`, 1 at `high`), as the timeline
    extrapolates a long schedule from two shorter ones (timeline.pipeline_times)."""
    return tuple(tuple(a + (b - a) * t for a, b in zip(x, y)) for x, y in zip(low, high))


def schedule_walks(schedule: str, *, pp: int, chunks: int, num_microbatches: int, recompute: frozenset[int],
                   cache: dict | None = None) -> dict[int, RankWalk]:
    """`walk_schedule` of the named schedule's lists, kept in `cache` (shared with timeline.py's compiled ones)."""
    key = ("walk", schedule, pp, chunks, num_microbatches, recompute)
    walks = cache.get(key) if cache is not None else None
    if walks is None:
        lists = cache.get(("lists", *key[1:])) if cache is not None else None
        if lists is None:
            lists = build_schedule(schedule, pp=pp, num_microbatches=num_microbatches, chunks=chunks,
                                   recompute=recompute)
        walks = walk_schedule(lists, pp=pp, num_stages=pp * chunks, style=placement(schedule))
        if cache is not None:
            cache[key] = walks
    return walks


def rank_peaks(schedule: str, *, pp: int, chunks: int, num_microbatches: int, recompute: frozenset[int],
               unit_bytes: dict[int, tuple[float, ...]], only: int | None = None,
               cache: dict | None = None) -> dict[int, dict[int, tuple[float, ...]]]:
    """Per rank, the counts of each of its stages at its peak, the counts priced by `unit_bytes` (see
    RankWalk.peak). Past 3pp micro-batches, from the peaks of two steady-state lengths (2pp and 3pp), extended
    along their line, as timeline.pipeline_times extends the timeline (the sent tensors grow by the same
    count per micro-batch there; a line can only miss a peak that moves between phases)."""
    m, low, high = num_microbatches, 2 * pp, 3 * pp

    def walks(n: int) -> dict[int, RankWalk]:
        return schedule_walks(schedule, pp=pp, chunks=chunks, num_microbatches=n, recompute=recompute, cache=cache)

    def priced(stages, snap: Snapshot) -> float:
        return sum(c * u for s, counts in zip(stages, snap) if only is None or s == only
                   for c, u in zip(counts, unit_bytes[s]))

    out = {}
    if m <= high:
        for rank, walk in walks(m).items():
            if only is not None and only not in walk.stages:
                continue
            out[rank] = dict(zip(walk.stages, walk.peak(unit_bytes, only)))
        return out
    short, long = walks(low), walks(high)
    t = (m - low) / (high - low)
    for rank, walk in long.items():
        if only is not None and only not in walk.stages:
            continue
        a, b = short[rank].peak(unit_bytes, only), walk.peak(unit_bytes, only)
        line = extrapolate(a, b, t)
        best = line if priced(walk.stages, line) >= priced(walk.stages, b) else b
        out[rank] = dict(zip(walk.stages, best))
    return out
