"""Lower a compute-only schedule into batched communication steps that NCCL cannot deadlock on.

Why: NCCL pairs point-to-point operations by order and runs a rank's batched groups one after
another on one stream. If rank 0 posts SEND_F1 then RECV_B0 while rank 1 posts SEND_B0 then
RECV_F1 (1F1B at pp=2), each send waits for a receive queued behind the other's send: a
deadlock gloo never shows. So every transfer is assigned to one global *communication step*;
a rank posts all its operations of a step as one `batch_isend_irecv` group, at the same point
of its list for both ends of every transfer, and steps come in the same order on every rank.

How the steps are chosen: the compute-only lists are played by the simulator (default costs);
each cross-rank transfer joins the step of the instant its producer finishes (the transfers one
rank makes at one instant share a step; steps are ordered by instant, then rank). The sender
posts right after the producer; the receiver at the point it had reached when the producer
*started*, so its receive is already posted when the data is ready even if real timings
differ from the simulated ones. A rank posts its whole step at the latest of those points, and
never before an earlier step. Within a step a rank orders its operations by (peer, send
before receive, message kind, micro-batch, stage), so a rank pair lists its messages in one
order on both sides.

Why this cannot deadlock (whatever the real timing): a rank's steps increase along its list and
both ends of a transfer are in one step; a receive's step precedes its consumer and a send's
follows its producer. So the computes before step k on any rank need only data of steps < k,
and by induction every rank reaches step k once steps < k are done; `simulate.check` verifies
these properties of any lowered schedule that carries steps.
"""

from __future__ import annotations

from collections import defaultdict

from .actions import Action, Op, Schedule, stage_to_rank
from .simulate import simulate

F, B, I = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT


def batch_communication(schedule: Schedule, *, pp: int, num_stages: int, num_microbatches: int,
                        style: str = "loop") -> Schedule:
    """Compute-only `schedule` -> lists with SEND/RECV actions tagged by communication step.

    Raises ValueError if `schedule` already has communication actions (lower it only once).
    """
    if any(a.op.is_comm for acts in schedule.values() for a in acts):
        raise ValueError("batch_communication lowers compute-only lists; this schedule already has "
                         "sends and receives (pass the output of schedules.generate)")
    rank = {s: stage_to_rank(s, pp, num_stages, style) for s in range(num_stages)}
    timeline = simulate(schedule, pp=pp, num_stages=num_stages, num_microbatches=num_microbatches, style=style)
    ends: dict[int, list[float]] = defaultdict(list)  # rank -> end times of its computes, in list order
    # (producer's end, its rank) -> [(producer's start, send, recv)]
    transfers: dict[tuple[float, int], list[tuple[float, Action, Action]]] = defaultdict(list)
    for r, start, end, action in sorted(timeline.compute_events(), key=lambda e: (e[0], e[1])):
        ends[r].append(end)
        s, mb = action.stage, action.microbatch
        if action.op == F and s + 1 < num_stages and rank[s + 1] != r:
            transfers[(end, r)].append((start, Action(s, Op.SEND_ACT, mb, peer=rank[s + 1]),
                                        Action(s + 1, Op.RECV_ACT, mb, peer=r)))
        if action.op in (B, I) and s > 0 and rank[s - 1] != r:
            transfers[(end, r)].append((start, Action(s, Op.SEND_GRAD, mb, peer=rank[s - 1]),
                                        Action(s - 1, Op.RECV_GRAD, mb, peer=r)))
    # per rank: (position in its compute list, step, action); position = computes finished by then
    posted: dict[int, list[tuple[int, int, Action]]] = defaultdict(list)
    reached: dict[int, int] = defaultdict(int)
    for step, key in enumerate(sorted(transfers)):
        instant = key[0]
        ops: dict[int, list[tuple[int, Action]]] = defaultdict(list)  # rank -> (earliest position, action)
        for began, send, recv in transfers[key]:  # a peer is the other end's rank
            ops[recv.peer].append((sum(1 for t in ends[recv.peer] if t <= instant), send))
            ops[send.peer].append((sum(1 for t in ends[send.peer] if t <= began), recv))
        for owner, mine in ops.items():  # one position per rank and step: its group
            position = reached[owner] = max(reached[owner], *(p for p, _ in mine))
            posted[owner] += [(position, step, _with_step(action, step)) for _, action in mine]
    lowered: Schedule = {}
    for r in schedule:
        computes = list(schedule[r])
        comm = sorted(posted.get(r, []), key=lambda p: (p[0], p[1], _order_key(p[2])))
        out: list[Action] = []
        i = 0
        for position, compute in enumerate([*computes, None]):
            while i < len(comm) and comm[i][0] == position:
                out.append(comm[i][2])
                i += 1
            if compute is not None:
                out.append(compute)
        lowered[r] = out
    return lowered


def _with_step(action: Action, step: int) -> Action:
    return Action(action.stage, action.op, action.microbatch, peer=action.peer, step=step)


def _order_key(action: Action) -> tuple:
    """(peer, send before receive, kind, micro-batch, producing stage): the same message order at both ends."""
    send = action.op in (Op.SEND_ACT, Op.SEND_GRAD)
    forward = action.op in (Op.SEND_ACT, Op.RECV_ACT)
    producer = {Op.RECV_ACT: action.stage - 1, Op.RECV_GRAD: action.stage + 1}.get(action.op, action.stage)
    return action.peer, not send, not forward, action.microbatch, producer
