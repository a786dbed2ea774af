"""Batched, NCCL-safe communication for the no-flush schedules, cut into the trainer's steps.

A no-flush schedule is one long 1F1B run that the trainer executes one optimizer step (one
call of the runtime) at a time; the ranks meet between calls (the global loss and gradient
norm). Its transfers used to be posted as single sends and receives, which NCCL may deadlock
on when two ranks send to each other (comm_steps.py explains why). Here the compute-only lists
of every step of the run are lowered together by `comm_steps.batch_communication` (every
transfer in one global communication step, posted as one `batch_isend_irecv` group at both
ends, steps in the same order on every rank), and the lowered lists are then cut back into
per-step calls: a rank's call t holds its computes of step t and the communication placed
before them, and the groups placed after its last compute of step t (they are posted before
the rank leaves its step).

Why the cut cannot deadlock with the meeting between calls: `check_calls_aligned` verifies that
both ends of every group fall in the same call. Then within a call the batched argument holds
(a rank's groups increase along its list, a receive's group precedes its consumer, a send's
follows its producer), and a rank never waits in call t for a peer that is still in call t-1
or waiting for call t+1; the meeting only starts once every rank has finished its call.
"""

from __future__ import annotations

from collections.abc import Callable

from .actions import Action, Schedule
from .comm_steps import batch_communication


def lower_calls(compute: dict[int, Schedule], *, pp: int,
                flush_after: set[int] | frozenset[int]) -> dict[int, Schedule]:
    """step -> rank -> compute-only actions (global micro-batch ids), consecutive steps to the
    end of training (the last drains) -> the same with batched SEND/RECV groups, per step.

    Each pipeline run (the steps from a warm-up to the next flush) is lowered on its own: the
    pipeline is empty between runs, and lowering across a flush would let the simulator start
    the next run's forwards before the trainer's meeting, which the real ranks cannot.
    """
    out: dict[int, Schedule] = {}
    run: list[int] = []
    groups = 0  # group ids stay unique over the runs
    for t in sorted(compute):
        run.append(t)
        if t in flush_after or t == max(compute):
            lowered = _lower_run({s: compute[s] for s in run}, pp=pp)
            ids = [a.step for lists in lowered.values() for acts in lists.values() for a in acts if a.op.is_comm]
            for step, lists in lowered.items():
                out[step] = {r: [Action(a.stage, a.op, a.microbatch, peer=a.peer, step=a.step + groups)
                                 if a.op.is_comm else a for a in acts] for r, acts in lists.items()}
            groups += max(ids, default=-1) + 1
            run = []
    check_calls_aligned(out)
    return out


def _lower_run(compute: dict[int, Schedule], *, pp: int) -> dict[int, Schedule]:
    steps = sorted(compute)
    ids = {a.microbatch for t in steps for acts in compute[t].values() for a in acts}
    base = min(ids)
    if ids != set(range(base, base + len(ids))):
        raise ValueError("lower_calls needs consecutive micro-batch ids over the steps it lowers")
    shift: Callable[[Action, int], Action] = lambda a, d: Action(a.stage, a.op, a.microbatch + d, peer=a.peer,
                                                                step=a.step)
    whole = {r: [shift(a, -base) for t in steps for a in compute[t].get(r, [])] for r in range(pp)}
    lowered = batch_communication(whole, pp=pp, num_stages=pp, num_microbatches=len(ids))
    out: dict[int, Schedule] = {t: {} for t in steps}
    for r in range(pp):
        counts = [sum(1 for a in compute[t].get(r, []) if a.op.is_compute) for t in steps]
        call, done, mine = 0, 0, lowered.get(r, [])
        for a in mine:
            while call < len(steps) - 1 and done == counts[call] and a.op.is_compute:
                call, done = call + 1, 0  # the next compute opens the next call
            out[steps[call]].setdefault(r, []).append(shift(a, base))
            if a.op.is_compute:
                done += 1
        for t in steps:
            out[t].setdefault(r, [])
    return _align(out)


def _align(calls: dict[int, Schedule]) -> dict[int, Schedule]:
    """Move a group that one end posts a call earlier than the other (the simulator plays the run
    without the meetings, so a receive may be placed where its rank is still in the previous step)
    to the start of the later call: posting later is always allowed, and the group stays before
    its consumer, which is in the later call too (`simulate.check` confirms on the whole run)."""
    target: dict[int, int] = {}
    for t, lists in calls.items():
        for actions in lists.values():
            for a in actions:
                if a.op.is_comm:
                    target[a.step] = max(target.get(a.step, t), t)
    moved: dict[tuple[int, int], list[Action]] = {}
    out: dict[int, Schedule] = {}
    for t in sorted(calls):
        for r, actions in calls[t].items():
            kept = []
            for a in actions:
                if a.op.is_comm and target[a.step] > t:
                    moved.setdefault((target[a.step], r), []).append(a)
                else:
                    kept.append(a)
            out.setdefault(t, {})[r] = kept
    for (t, r), actions in moved.items():
        out[t][r] = actions + out[t][r]
    return out


def check_calls_aligned(calls: dict[int, Schedule]) -> None:
    """Both ends of every communication group in the same call (see the module docstring)."""
    where: dict[int, set[int]] = {}
    for t, lists in calls.items():
        for actions in lists.values():
            for a in actions:
                if a.op.is_comm:
                    if a.step is None:
                        raise ValueError(f"{a} in step {t} carries no communication group")
                    where.setdefault(a.step, set()).add(t)
    split = {g: sorted(ts) for g, ts in where.items() if len(ts) > 1}
    if split:
        g, ts = next(iter(sorted(split.items())))
        raise ValueError(f"communication group {g} is posted in different optimizer steps {ts} by its two ends; "
                         f"the ranks meet between steps, so this could deadlock ({len(split)} such groups)")
