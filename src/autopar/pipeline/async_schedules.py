"""No-flush pipeline schedules (PipeDream-2BW): one action list per rank and per optimizer step.

A flush schedule (1F1B) drains the pipeline at the end of every step: the last stages idle
while the first finish their backwards, (pp-1)(F+B) per step. PipeDream-2BW never drains:
stage s keeps w = pp - s micro-batches in flight (1F1B's depth) across the step boundary, so
the forwards of the next step's first w-1 micro-batches run inside this step, in the slots
1F1B leaves empty in its cool-down.

Micro-batches carry *global* ids: micro-batch j of step t is t*m + j. Step t's segment on
stage s is everything from just after the backward of micro-batch t*m - 1 up to and
including the backward of (t+1)*m - 1, the last of step t, so that step t's gradient is
complete when the segment ends and the optimizer may step:

    warm (pipe empty):  F(tm) .. F(tm+w-1), then B(tm+j), F(tm+j+w)  for j = 0..m-1
    steady:             F(tm+w-1),          then B(tm+j), F(tm+j+w)  for j = 0..m-1

where the last F after B(tm+m-1) is dropped (it opens the next segment), and a draining
segment (before a checkpoint, an eval or the end of training: a flush) omits every F
beyond step t. So a steady segment runs m forwards and m backwards, of which w-1 forwards
belong to step t+1: stage s's last forward of a segment is the first forward of stage
s+1's next segment, the only transfer that crosses a step boundary; its receive is posted
at the end of the segment (`segment_lists`), so the runtime carries it into the next call.

Weight versions (the 2BW rule, pipeline/weight_versions.py): every micro-batch of step t
runs forward and backward on W(t-1), the weights before the last update (W(-1) = W(0)), and
the step applies its gradient to the newest weights: W(t+1) = W(t) - lr * grad f_t(W(t-1)).
During segment t a stage uses W(t-1) (step t) and W(t) (the look-ahead forwards of step
t+1), never a third: `check_versions` verifies it on the lists. This needs m >= pp (the
look-ahead must stay within one step), as in the paper (m >= d).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError
from .actions import Action, Op, Schedule
from .schedules import add_communication

F, B = Op.FORWARD, Op.BACKWARD


def check_no_flush(pp: int, m: int) -> None:
    if not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"pp must be a positive integer, got {pp!r}")
    if not isinstance(m, int) or m < pp:
        raise ConfigError(f"schedule 'pipedream-2bw' needs at least pp={pp} micro-batches per replica per step "
                          f"(the look-ahead forwards of the next step must fit in it, so two weight versions "
                          f"suffice), got {m!r}; raise --global-batch-size or lower --micro-batch-size so that "
                          f"global_batch / (micro_batch * dp) >= {pp}")


def segment(stage: int, *, pp: int, m: int, step: int, warm: bool, drain: bool) -> list[Action]:
    """Compute actions of `stage` in optimizer step `step` (global micro-batch ids)."""
    check_no_flush(pp, m)
    w, base = pp - stage, step * m
    first = 0 if warm else w - 1  # forwards of this step already run by the previous segment
    order = [Action(stage, F, base + j) for j in range(first, w)]
    for j in range(m):
        order.append(Action(stage, B, base + j))
        if j < m - 1 and (j + w < m or not drain):
            order.append(Action(stage, F, base + j + w))
    return order


def flush_steps(steps: int, *, eval_every: int = 0, checkpoint_every: int = 0) -> frozenset[int]:
    """0-based steps after which the pipeline drains: before each eval and checkpoint, and the last."""
    out = {steps - 1}
    for every in (eval_every, checkpoint_every):
        if every:
            out |= {n - 1 for n in range(every, steps + 1, every)}
    return frozenset(s for s in out if s >= 0)


def rank_segment(stage: int, *, pp: int, m: int, step: int, warm: bool, drain: bool) -> list[Action]:
    """`segment` lowered with its sends and receives, as the runtime runs it in one call.

    The receive of the segment's first forward (sent by the previous stage in the previous
    segment) is posted at the end of the previous segment instead, so both ends of every
    transfer are posted before either rank leaves its step (the trainer's ranks meet between
    steps, for the gradient norm and the loss); the runtime carries the posted receive over.
    """
    def lowered(t: int, warm: bool, drain: bool) -> list[Action]:
        return add_communication({stage: segment(stage, pp=pp, m=m, step=t, warm=warm, drain=drain)},
                                 pp=pp, num_stages=pp)[stage]

    actions = lowered(step, warm, drain)
    if not warm and actions and actions[0].op == Op.RECV_ACT:
        actions = actions[1:]
    if not drain:
        following = lowered(step + 1, False, False)
        if following and following[0].op == Op.RECV_ACT:
            actions.append(following[0])
    return actions


def segment_lists(*, pp: int, m: int, steps: Sequence[int], flush_after: frozenset[int] | set[int],
                  warm_first: bool = True) -> dict[int, Schedule]:
    """step -> rank -> the lowered actions `rank_segment` gives, for consecutive `steps`."""
    out: dict[int, Schedule] = {}
    warm = warm_first
    for t in steps:
        drain = t in flush_after
        out[t] = {s: rank_segment(s, pp=pp, m=m, step=t, warm=warm, drain=drain) for s in range(pp)}
        warm = drain
    return out


def whole_run(lists: dict[int, Schedule]) -> Schedule:
    """The segments of every step concatenated: what the simulator checks and times."""
    run: Schedule = {}
    for t in sorted(lists):
        for r, actions in lists[t].items():
            run.setdefault(r, []).extend(actions)
    return run


def version_of(microbatch: int, m: int) -> int:
    """The weight version a micro-batch runs on (2BW): step t uses W(t-1), and W(-1) is W(0)."""
    return max(0, microbatch // m - 1)


def check_versions(lists: dict[int, Schedule], *, m: int, kept: int = 2) -> dict[int, int]:
    """Check, on the lists, that 2BW's weight versions exist when used and that `kept` suffice.

    Stage s holds W(t) from the end of its segment t-1 (the optimizer step). Each forward must
    find its version made, and the backward runs on the version its forward stashed (the runtime
    keeps the forward's graph, which holds that version). A version is alive from its first
    forward to the last backward that uses it. Returns rank -> most versions alive at once;
    raises ValueError if a forward needs a version not yet made or more than `kept` are alive.
    """
    most: dict[int, int] = {}
    problems = []
    for t in sorted(lists):
        for r, actions in lists[t].items():
            for a in actions:
                if a.op == F and version_of(a.microbatch, m) > t:
                    problems.append(f"rank {r}: {a} in step {t} needs W({version_of(a.microbatch, m)}), "
                                    f"made only at the end of step {version_of(a.microbatch, m) - 1}")
    run = whole_run(lists)
    for r, actions in run.items():
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, a in enumerate(actions):
            v = version_of(a.microbatch, m)
            if a.op == F:
                first.setdefault(v, i)
            if a.op == B:
                last[v] = i
        live = 0
        events = sorted([(i, 1) for i in first.values()] + [(i + 0.5, -1) for i in last.values()])
        peak = 0
        for _, change in events:
            live += change
            peak = max(peak, live)
        most[r] = peak
        if peak > kept:
            problems.append(f"rank {r}: {peak} weight versions alive at once, more than {kept}")
    if problems:
        raise ValueError("; ".join(problems[:5]))
    return most


def steady_state_bubble(timeline, lists: dict[int, Schedule], *, skip: int = 1) -> dict[int, float]:
    """Idle fraction of each rank between the end of its segment `skip`-1 and the start of its last
    segment (so neither the first warm-up nor the final drain is counted)."""
    steps = sorted(lists)
    inner = steps[skip:-1]
    if not inner:
        raise ValueError(f"need at least {skip + 2} steps to measure a steady state, got {len(steps)}")
    result = {}
    for r in lists[steps[0]]:
        keys = {(a.stage, a.op, a.microbatch) for t in inner for a in lists[t][r] if a.op.is_compute}
        spans = [(start, end) for rank, start, end, a in timeline.events
                 if rank == r and (a.stage, a.op, a.microbatch) in keys]
        window = max(e for _, e in spans) - min(s for s, _ in spans)
        busy = sum(e - s for s, e in spans)
        result[r] = max(0.0, 1 - busy / window) if window > 0 else 0.0
    return result


def step_time_with_meeting(*, pp: int, m: int, forward: float = 1.0, backward: float = 2.0,
                           lists: dict[int, list[Action]] | None = None) -> float:
    """Time of one steady 2BW step when every rank waits for all others at the step's end (as the
    trainer's ranks do: the gradient norm and the loss are global), with no transfer cost.

    The look-ahead forwards of the previous step have landed, so every rank starts at once; the
    step ends when the slowest rank ends its segment. Compare with 1F1B's step,
    (m + pp - 1) * (forward + backward), and with the no-meeting steady state, m * (forward + backward).
    `lists`: another steady segment (stage -> compute actions), e.g. PipeDream's `stash_segment`.
    """
    if lists is None:
        lists = {s: segment(s, pp=pp, m=m, step=1, warm=False, drain=False) for s in range(pp)}
    done: dict[tuple[int, Op, int], float] = {}
    clock = dict.fromkeys(range(pp), 0.0)
    cursor = dict.fromkeys(range(pp), 0)
    in_segment = {(a.stage, a.op, a.microbatch) for acts in lists.values() for a in acts}

    def ready(a: Action) -> float | None:
        if a.op == F:
            needed = (a.stage - 1, F, a.microbatch)
        else:
            needed = (a.stage + 1, B, a.microbatch) if a.stage < pp - 1 else (a.stage, F, a.microbatch)
        if needed[0] < 0 or needed not in in_segment:
            return 0.0  # stage 0's input, or produced in the previous step (already there)
        return done.get(needed)

    remaining = sum(len(acts) for acts in lists.values())
    while remaining:
        progressed = False
        for s, acts in lists.items():
            while cursor[s] < len(acts):
                a = acts[cursor[s]]
                t = ready(a)
                if t is None:
                    break
                clock[s] = max(clock[s], t) + (forward if a.op == F else backward)
                done[(a.stage, a.op, a.microbatch)] = clock[s]
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("a steady 2BW segment deadlocks")
    return max(clock.values())


# ---------------------------------------------------------------- PipeDream (weight stashing)
#
# The original PipeDream (Narayanan et al., SOSP'19): 1F1B that never drains, and every stage
# updates its weights after every micro-batch's backward. In the trainer one optimizer step is
# one micro-batch per replica (the paper's "minibatch"; replicas sum their gradients): stage s's
# step t runs the forward of micro-batch t + w - 1 (w = pp - s, 1F1B's depth) and the backward
# of micro-batch t, then the optimizer updates. So a forward of micro-batch j on stage s runs on
# the newest weights, W_s(j - (pp-1-s)) (after j - (pp-1-s) updates; at most the run's first
# step r: after a flush the pipeline warms up on the newest weights), and its backward must use
# that same version: weight stashing. With vertical sync every stage uses stage 0's version,
# W_s(max(r, j - (pp-1))).

def stash_segment(stage: int, *, pp: int, step: int, run_start: int, run_end: int) -> list[Action]:
    """Compute actions of `stage` in optimizer step `step` of a pipeline run from `run_start` to
    `run_end` (inclusive; a flush after it). Micro-batch ids are step numbers."""
    w = pp - stage
    if not run_start <= step <= run_end:
        raise ValueError(f"step {step} is outside its run {run_start}..{run_end}")
    forwards = range(step, min(step + w, run_end + 1)) if step == run_start else \
        [j for j in (step + w - 1,) if j <= run_end]
    return [Action(stage, F, j) for j in forwards] + [Action(stage, B, step)]


def runs_of(steps: Sequence[int], flush_after: frozenset[int] | set[int]) -> dict[int, tuple[int, int]]:
    """step -> (first, last step of its pipeline run); a run ends at a flush or the last step."""
    out: dict[int, tuple[int, int]] = {}
    run: list[int] = []
    for t in sorted(steps):
        run.append(t)
        if t in flush_after or t == max(steps):
            out.update({s: (run[0], run[-1]) for s in run})
            run = []
    return out


def stash_lists(*, pp: int, steps: Sequence[int], flush_after: frozenset[int] | set[int]) -> dict[int, Schedule]:
    """step -> rank -> compute-only `stash_segment` lists (one stage per rank)."""
    runs = runs_of(steps, flush_after)
    return {t: {s: stash_segment(s, pp=pp, step=t, run_start=runs[t][0], run_end=runs[t][1]) for s in range(pp)}
            for t in sorted(steps)}


def stash_version(microbatch: int, stage: int, *, pp: int, run_start: int, vertical_sync: bool) -> int:
    """The version (updates applied) stage `stage` runs micro-batch `microbatch` on (module comment)."""
    delay = pp - 1 if vertical_sync else pp - 1 - stage
    return max(run_start, microbatch - delay)


# A weight tied across stages (gpt's embedding and output head) is read by its first and last
# stage. Summing each micro-batch's two gradients before the update makes its owners meet every
# step: the last stage's next forward needs the weight updated with stage 0's gradient of the
# same micro-batch, which stage 0 computes pp - 1 backwards later, so the whole pipe runs at the
# pace of that meeting. The tied rule instead applies a tied weight's summed gradient `delay`
# steps late (default pp - 1, by when stage 0 has long finished it): its update at step t uses
# G(t - delay), the sum over its stages (and replicas) of micro-batch t - delay's gradient; the
# first `delay` steps of a pipeline run leave it unchanged, and the run's last step (the drain)
# applies the sum of every G the run has not applied yet, so no gradient is lost and a flush
# still leaves nothing outstanding (a checkpoint holds no pending gradient). delay = 0 is the
# synchronous sum (the meeting). Not in the paper, which has no tied weights.

def tied_steps_due(step: int, *, run_start: int, run_end: int, delay: int) -> range:
    """The micro-batches (= steps) whose summed tied-weight gradient step `step`'s update applies."""
    if step == run_end:
        return range(max(run_start, step - delay), step + 1)
    if step - delay >= run_start:
        return range(step - delay, step - delay + 1)
    return range(0)


def check_stash_versions(lists: dict[int, Schedule], *, pp: int, flush_after: frozenset[int] | set[int],
                         vertical_sync: bool) -> dict[int, int]:
    """Check, on the lists, PipeDream's stashing: each forward's version exists when it runs (at most
    the updates made so far; without vertical sync exactly the newest), and count the versions a
    rank must hold at once: those of its in-flight micro-batches, the newest, and (vertical sync)
    every version a later forward will still need. Returns rank -> that peak; raises ValueError
    if a version is missing or, without vertical sync, the peak exceeds pp - s."""
    runs = runs_of(sorted(lists), flush_after)
    problems, most = [], {}
    for r in range(pp):
        in_flight: dict[int, int] = {}  # micro-batch -> version its forward used
        peak = 0
        for t in sorted(lists):
            start, end = runs[t]
            for a in lists[t][r]:
                if not a.op.is_compute:
                    continue
                v = stash_version(a.microbatch, r, pp=pp, run_start=start, vertical_sync=vertical_sync)
                if a.op == F:
                    if v > t or (not vertical_sync and v != t):
                        problems.append(f"rank {r}: F{a.microbatch} in step {t} runs on W({v}); the newest is W({t})")
                    in_flight[a.microbatch] = v
                else:
                    if a.microbatch not in in_flight:
                        problems.append(f"rank {r}: B{a.microbatch} in step {t} before its forward")
                        continue
                    in_flight.pop(a.microbatch)
                later = {stash_version(j, r, pp=pp, run_start=start, vertical_sync=vertical_sync)
                         for j in range(max([a.microbatch, *in_flight]) + 1, end + 1)}
                held = set(in_flight.values()) | {t} | {v for v in later if v <= t}
                peak = max(peak, len(held))
        most[r] = peak
        if not vertical_sync and peak > pp - r:
            problems.append(f"rank {r}: {peak} weight versions held at once, more than pp - s = {pp - r}")
    if problems:
        raise ValueError("; ".join(problems[:5]))
    return most
