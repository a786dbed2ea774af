"""Check and time pipeline schedules without running a model.

`check` verifies that a schedule is complete and consistent (every micro-batch's forward and
backward on every stage, each on the rank that owns the stage, sends paired with receives);
`simulate` plays the per-rank lists against a cost model and reports the timeline, the idle
fraction of each rank and the peak number of live activations per stage. Both are pure Python,
so schedules can be tested, compared and plotted without GPUs.

Timing model. A rank runs its compute actions in list order, one at a time; a compute starts
when the rank is free and its inputs are there. Communication actions take no rank time: they
are posted when the rank reaches them (sends and receives are asynchronous, as in the runtime).
A transfer starts once its SEND and its RECV are both posted and takes `comm_cost(send)`; where
the schedule has no communication actions (compute-only lists from `generate`) the receive
counts as posted from the start. Transfers share no links, so they never queue.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from autopar.pipeline.actions import Action, Op, Schedule, stage_to_rank

F, B, I, W, R = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.RECOMPUTE

DEFAULT_COSTS = {F: 1.0, B: 2.0, I: 1.0, W: 1.0, R: 1.0}


def default_cost(action: Action) -> float:
    """F=1, B=2 (I=1 + W=1), R=1: a backward costs about two forwards."""
    return DEFAULT_COSTS[action.op]


@dataclass
class Timeline:
    """What `simulate` found: when each action ran, the step time, idle time and live activations."""

    events: list[tuple[int, float, float, Action]]
    makespan: float
    bubble: dict[int, float]
    peak_activations: dict[int, int]
    stashed_inputs: dict[int, int] = field(default_factory=dict)
    """global stage -> most micro-batches whose stashed inputs are kept at once (recompute stages; else 0)."""

    def compute_events(self) -> list[tuple[int, float, float, Action]]:
        return [e for e in self.events if e[3].op.is_compute]

    def to_chrome_trace(self, path) -> None:
        """Write a Chrome trace (open in Perfetto or chrome://tracing); times in microseconds.

        One process per rank; compute on thread 0, transfers (if they cost anything) on thread 1,
        so that overlapping communication does not hide compute bars.
        """
        trace = []
        for rank, start, end, action in self.events:
            trace.append({
                "name": str(action), "cat": action.op.value, "ph": "X",
                "ts": float(start) * 1e6, "dur": float(end - start) * 1e6, "pid": rank,
                "tid": 0 if action.op.is_compute else 1,
                "args": {"stage": action.stage, "microbatch": action.microbatch, "op": action.op.value,
                         "peer": action.peer},
            })
        for rank in sorted({e[0] for e in self.events}):
            trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))

    def to_png(self, path, title: str = "") -> None:
        """Draw a Gantt chart, one row per rank (rank 0 on top), coloured by op, labelled by micro-batch."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        colours = {F: "#4c72b0", B: "#55a868", I: "#8fd18f", W: "#c9a227", R: "#c44e52"}
        ranks = sorted({e[0] for e in self.events}) or [0]
        fig, ax = plt.subplots(figsize=(max(6.0, min(40.0, float(self.makespan) * 0.35)), 0.6 * len(ranks) + 1.2))
        for rank, start, end, action in self.compute_events():
            y = len(ranks) - 1 - ranks.index(rank)
            ax.broken_barh([(float(start), float(end - start))], (y - 0.4, 0.8), facecolors=colours[action.op],
                           edgecolor="black", linewidth=0.4)
            ax.text(float(start + end) / 2, y, f"{action.microbatch}", ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(ranks)])
        ax.set_xlim(0, max(float(self.makespan), 1e-9))
        ax.set_xlabel("time")
        used = {e[3].op for e in self.compute_events()}
        ax.legend(handles=[Patch(color=c, label=op.value) for op, c in colours.items() if op in used],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
        ax.set_title(title or f"makespan {self.makespan:g}")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


# ---------------------------------------------------------------------------------------------
# check

def _peer_rules(action: Action, pp: int, num_stages: int, style: str) -> tuple[int, int] | None:
    """(peer stage, expected peer rank) of a comm action, or None if the stage has no such peer."""
    step = 1 if action.op in (Op.SEND_ACT, Op.RECV_GRAD) else -1
    other = action.stage + step
    if not 0 <= other < num_stages:
        return None
    return other, stage_to_rank(other, pp, num_stages, style)


def _matching(action: Action) -> tuple[int, Op, int]:
    """The (stage, op, microbatch) of the action on the peer that pairs with a send or receive."""
    pair = {Op.SEND_ACT: (1, Op.RECV_ACT), Op.RECV_ACT: (-1, Op.SEND_ACT),
            Op.SEND_GRAD: (-1, Op.RECV_GRAD), Op.RECV_GRAD: (1, Op.SEND_GRAD)}
    step, op = pair[action.op]
    return action.stage + step, op, action.microbatch


def check(schedule: Schedule, *, pp: int, num_stages: int, num_microbatches: int, style: str = "loop") -> None:
    """Raise ValueError listing what is wrong with `schedule`; pass silently if it is runnable.

    Checks completeness (one F and one B, or one I then one W, per stage and micro-batch),
    placement (each action on the rank owning its stage), order on a rank (F < R < B/I < W,
    receives before the compute that needs them, sends after the compute that produces them),
    recompute consistency (a stage recomputes all its micro-batches or none), send/receive
    pairing (right peer; received in the order sent, as NCCL needs), and finally that the
    lists do not deadlock (by simulating with unit costs).
    """
    problems: list[str] = []
    position: dict[tuple[int, Op, int], int] = {}
    rank_of: dict[tuple[int, Op, int], int] = {}
    counts: Counter = Counter()
    extra = sorted(set(schedule) - set(range(pp)))
    if extra:
        problems.append(f"ranks {extra} are outside 0..{pp - 1} (pp={pp})")
    for rank in range(pp):
        for index, action in enumerate(schedule.get(rank, [])):
            if not 0 <= action.stage < num_stages or not 0 <= action.microbatch < num_microbatches:
                problems.append(f"rank {rank} action {action} #{index}: stage must be in 0..{num_stages - 1} and "
                                f"micro-batch in 0..{num_microbatches - 1}")
                continue
            owner = stage_to_rank(action.stage, pp, num_stages, style)
            if owner != rank:
                problems.append(f"{action} is on rank {rank} but stage {action.stage} belongs to rank {owner}")
            if action.op.is_comm:
                peer = _peer_rules(action, pp, num_stages, style)
                if peer is None:
                    problems.append(f"{action} on rank {rank}: stage {action.stage} has no neighbour to exchange with")
                elif peer[1] == owner:
                    problems.append(f"{action} on rank {rank}: stages {action.stage} and {peer[0]} share rank {owner}, "
                                    "so they exchange locally and need no communication action")
                elif action.peer != peer[1]:
                    problems.append(f"{action} on rank {rank} has peer={action.peer}, expected rank {peer[1]}")
            key = (action.stage, action.op, action.microbatch)
            counts[key] += 1
            position[key] = index
            rank_of[key] = rank
    for key, n in sorted(counts.items()):
        if n > 1:
            problems.append(f"{_name(key)} appears {n} times (expected once)")
    recomputing = {s for (s, op, _) in counts if op == R}
    split = {(s, mb) for (s, op, mb) in counts if op in (I, W)}
    for s in range(num_stages):
        for mb in range(num_microbatches):
            has = {op: counts[(s, op, mb)] > 0 for op in (F, B, I, W, R)}
            if not has[F]:
                problems.append(f"missing forward {s}F{mb}")
            if (s, mb) in split:
                if has[B]:
                    problems.append(f"stage {s} micro-batch {mb} has both B and I/W; use one B or one I plus one W")
                for op in (I, W):
                    if not has[op]:
                        problems.append(f"missing {s}{op.value}{mb} (I and W come in pairs)")
            elif not has[B]:
                problems.append(f"missing backward {s}B{mb} (or {s}I{mb} + {s}W{mb})")
            if s in recomputing and not has[R]:
                problems.append(f"missing recompute {s}R{mb}: stage {s} recomputes other micro-batches, so it "
                                "stashes only inputs and needs an R for every micro-batch")
            grad = (s, I if (s, mb) in split else B, mb)
            _order(problems, position, rank_of, (s, F, mb), (s, R, mb))
            _order(problems, position, rank_of, (s, R, mb), grad)
            _order(problems, position, rank_of, (s, F, mb), grad)
            _order(problems, position, rank_of, (s, I, mb), (s, W, mb))
            _order(problems, position, rank_of, (s, Op.RECV_ACT, mb), (s, F, mb))
            _order(problems, position, rank_of, (s, F, mb), (s, Op.SEND_ACT, mb))
            _order(problems, position, rank_of, (s, Op.RECV_GRAD, mb), grad)
            _order(problems, position, rank_of, grad, (s, Op.SEND_GRAD, mb))
    lowered = any(op.is_comm for (_, op, _) in counts)
    for key in sorted(counts):
        s, op, mb = key
        if op.is_comm and _matching(Action(s, op, mb)) not in counts:
            ps, pop, pmb = _matching(Action(s, op, mb))
            problems.append(f"{_name(key)} on rank {rank_of[key]} has no matching {ps}{pop.value}{pmb}")
    if lowered:
        for s in range(num_stages - 1):
            if stage_to_rank(s, pp, num_stages, style) == stage_to_rank(s + 1, pp, num_stages, style):
                continue
            for mb in range(num_microbatches):
                for need in ((s, Op.SEND_ACT, mb), (s + 1, Op.SEND_GRAD, mb)):
                    if need not in counts:
                        problems.append(f"cross-rank edge needs {_name(need)} (and its receive), which is missing")
    problems += _order_mismatches(schedule, pp)
    problems += step_mismatches(schedule)
    if problems:
        shown = problems[:12]
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise ValueError(f"invalid schedule ({len(problems)} problems):\n  " + "\n  ".join(shown) + more)
    simulate(schedule, pp=pp, num_stages=num_stages, num_microbatches=num_microbatches, style=style)


def _order_mismatches(schedule: Schedule, pp: int) -> list[str]:
    """Messages between two ranks must be received in the order they are sent.

    NCCL pairs point-to-point operations between two ranks by order, not by tag, so a
    schedule that receives in another order would hand a tensor to the wrong micro-batch.
    """
    def message(action: Action) -> str:
        """Name the data moved, the same at both ends: the producing stage and the micro-batch."""
        producer = {Op.RECV_ACT: action.stage - 1, Op.RECV_GRAD: action.stage + 1}.get(action.op, action.stage)
        kind = "activation" if action.op in (Op.SEND_ACT, Op.RECV_ACT) else "gradient"
        return f"{kind} of {producer}/mb{action.microbatch}"

    def messages(rank: int, ops: tuple[Op, Op], peer: int) -> list[str]:
        return [message(a) for a in schedule.get(rank, []) if a.op in ops and a.peer == peer]

    out = []
    for src in range(pp):
        for dst in range(pp):
            sends = messages(src, (Op.SEND_ACT, Op.SEND_GRAD), dst)
            recvs = messages(dst, (Op.RECV_ACT, Op.RECV_GRAD), src)
            if src != dst and sorted(sends) == sorted(recvs) and sends != recvs:
                first = next(i for i, (x, y) in enumerate(zip(sends, recvs)) if x != y)
                out.append(f"rank {src} sends to rank {dst} in another order than rank {dst} receives: "
                           f"message #{first} is sent as {sends[first]} but received as {recvs[first]} "
                           "(NCCL matches by order)")
    return out


def step_mismatches(schedule: Schedule) -> list[str]:
    """What breaks the batched-communication contract (comm_steps.py) in lists that carry steps.

    Every rank posts a step's operations as one group, so: the two ends of a transfer are in the
    same step; on each rank a step's actions are adjacent (no compute between them) and steps
    only increase along the list; and within a step, what one rank sends to a peer is listed in
    the order the peer receives it. Lists without steps (posted one by one) pass.
    """
    comm = [(r, i, a) for r, acts in schedule.items() for i, a in enumerate(acts) if a.op.is_comm]
    if all(a.step is None for _, _, a in comm):
        return []
    out = [f"{a} on rank {r} has no communication step while others have one" for r, _, a in comm if a.step is None]
    step_of = {(a.stage, a.op, a.microbatch): a.step for _, _, a in comm}
    for r, _, a in comm:
        other = _matching(a)
        if a.op in (Op.SEND_ACT, Op.SEND_GRAD) and other in step_of and step_of[other] != a.step:
            out.append(f"{a} on rank {r} is in step {a.step} but its receive {_name(other)} on rank {a.peer} is in "
                       f"step {step_of[other]} (both ends of a transfer must be posted in one group)")
    for r, acts in schedule.items():
        latest, open_step = None, None
        for a in acts:
            if a.op.is_compute:
                open_step = None
                continue
            if a.step is None:
                continue
            if latest is not None and (a.step < latest or (a.step == latest and open_step != a.step)):
                out.append(f"rank {r} posts {a} in step {a.step} after step {latest}"
                           + (" was closed by a compute" if a.step == latest else "")
                           + " (steps must be adjacent and increase along every rank's list)")
            latest = open_step = a.step
    sent: dict[tuple, list[str]] = defaultdict(list)  # (from, to, step) -> messages, in list order
    got: dict[tuple, list[str]] = defaultdict(list)
    for r, _, a in comm:  # `comm` is in list order per rank
        if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
            sent[(r, a.peer, a.step)].append(_message(a))
        else:
            got[(a.peer, r, a.step)].append(_message(a))
    for key, messages in sent.items():
        if sorted(messages) == sorted(got.get(key, [])) and messages != got[key]:
            src, dst, step = key
            out.append(f"in step {step} rank {src} lists its sends to rank {dst} as {messages} but rank {dst} "
                       f"lists the receives as {got[key]} (one order at both ends)")
    return out


def _message(action: Action) -> str:
    """The data a comm action moves, named the same at both ends: kind, producing stage, micro-batch."""
    producer = {Op.RECV_ACT: action.stage - 1, Op.RECV_GRAD: action.stage + 1}.get(action.op, action.stage)
    kind = "activation" if action.op in (Op.SEND_ACT, Op.RECV_ACT) else "gradient"
    return f"{kind} of {producer}/mb{action.microbatch}"


def _name(key: tuple[int, Op, int]) -> str:
    return f"{key[0]}{key[1].value}{key[2]}"


def _order(problems, position, rank_of, first, second) -> None:
    """Record a problem if both actions are on the same rank and `first` comes after `second`."""
    if first in position and second in position and rank_of[first] == rank_of[second]:
        if position[first] > position[second]:
            problems.append(f"{_name(first)} must come before {_name(second)} on rank {rank_of[first]} "
                            f"(positions {position[first]} and {position[second]})")


# ---------------------------------------------------------------------------------------------
# simulate

def simulate(schedule: Schedule, *, pp: int, num_stages: int, num_microbatches: int,
             cost: Callable[[Action], float] | None = None, comm_cost: Callable[[Action], float] | None = None,
             style: str = "loop") -> Timeline:
    """Play the per-rank lists against `cost` (default F=1, B=2, I=W=R=1) and `comm_cost` (default 0).

    Raises ValueError naming the blocked action on each rank if no rank can progress while work
    remains (a deadlock: the lists wait on each other in a cycle, or wait on something absent).
    """
    cost = cost or default_cost
    comm_cost = comm_cost or (lambda action: 0)
    rank = {s: stage_to_rank(s, pp, num_stages, style) for s in range(num_stages)}
    lists = {r: list(schedule.get(r, [])) for r in range(pp)}
    outside = [f"rank {r}: {a}" for r, acts in lists.items() for a in acts
               if not 0 <= a.stage < num_stages or not 0 <= a.microbatch < num_microbatches]
    if outside:
        raise ValueError(f"actions outside {num_stages} stages x {num_microbatches} micro-batches: {outside[:5]}")
    split = {(a.stage, a.microbatch) for acts in lists.values() for a in acts if a.op == I}
    recomputed = {(a.stage, a.microbatch) for acts in lists.values() for a in acts if a.op == R}
    has_comm = {r: {(a.stage, a.op, a.microbatch) for a in acts if a.op.is_comm} for r, acts in lists.items()}
    done: dict[tuple[int, Op, int], float] = {}  # compute key -> end time
    posted: dict[tuple[int, Op, int], float] = {}  # comm key -> time posted
    starts: dict[tuple[int, Op, int], float] = {}
    logged: set[tuple[int, Op, int]] = set()  # transfers already in `events`
    events: list[tuple[int, float, float, Action]] = []
    cursor = dict.fromkeys(lists, 0)
    clock = dict.fromkeys(lists, 0)

    def grad_op(s: int, mb: int) -> Op:
        return I if (s, mb) in split else B

    def arrival(producer: tuple[int, Op, int], send_op: Op, consumer_stage: int, recv_op: Op) -> float | None:
        """When the output of `producer` is usable on `consumer_stage`'s rank (None: not yet known)."""
        if producer not in done:
            return None
        src, dst = rank[producer[0]], rank[consumer_stage]
        if src == dst:
            return done[producer]
        mb = producer[2]
        send_key, recv_key = (producer[0], send_op, mb), (consumer_stage, recv_op, mb)
        if send_key in has_comm[src] and send_key not in posted:
            return None
        if recv_key in has_comm[dst] and recv_key not in posted:
            return None
        start = max(done[producer], posted.get(send_key, 0), posted.get(recv_key, 0))
        send = Action(producer[0], send_op, mb, peer=dst)
        duration = comm_cost(send)
        if duration > 0 and send_key not in logged:
            logged.add(send_key)
            events.append((src, start, start + duration, send))
            events.append((dst, start, start + duration, Action(consumer_stage, recv_op, mb, peer=src)))
        return start + duration

    def ready(action: Action) -> float | None:
        """Earliest time the inputs of a compute action are there (None: a dependency is pending)."""
        s, op, mb = action.stage, action.op, action.microbatch
        needs: list[float | None] = []
        if op == F and s > 0:
            needs.append(arrival((s - 1, F, mb), Op.SEND_ACT, s, Op.RECV_ACT))
        if op in (R, B, I):
            needs.append(done.get((s, F, mb)))
        if op in (B, I):
            if (s, mb) in recomputed:
                needs.append(done.get((s, R, mb)))
            if s < num_stages - 1:
                needs.append(arrival((s + 1, grad_op(s + 1, mb), mb), Op.SEND_GRAD, s, Op.RECV_GRAD))
        if op == W:
            needs.append(done.get((s, I, mb)))
        if any(t is None for t in needs):
            return None
        return max(needs, default=0)

    remaining = sum(len(acts) for acts in lists.values())
    while remaining:
        progressed = False
        for r, acts in lists.items():
            while cursor[r] < len(acts):
                action = acts[cursor[r]]
                key = (action.stage, action.op, action.microbatch)
                if action.op.is_comm:
                    posted[key] = clock[r]
                else:
                    t = ready(action)
                    if t is None:
                        break
                    start = max(clock[r], t)
                    clock[r] = start + cost(action)
                    starts[key], done[key] = start, clock[r]
                    events.append((r, start, clock[r], action))
                cursor[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = {r: str(acts[cursor[r]]) for r, acts in lists.items() if cursor[r] < len(acts)}
            raise ValueError("schedule deadlocks: no rank can progress; blocked at "
                             + ", ".join(f"rank {r}: {a}" for r, a in blocked.items())
                             + " (each needs data that comes only after another rank's blocked action, or never)")

    makespan = max((e[2] for e in events), default=0)
    busy: dict[int, float] = defaultdict(int)
    for r, start, end, action in events:
        if action.op.is_compute:
            busy[r] += end - start
    bubble = {r: (1 - busy[r] / makespan) if makespan > 0 else 0 for r in lists}
    peak, stash = _live(done, starts, split, num_stages, num_microbatches)
    events.sort(key=lambda e: (e[1], e[0], e[2]))
    return Timeline(events=events, makespan=makespan, bubble=bubble, peak_activations=peak, stashed_inputs=stash)


def _live(done, starts, split, num_stages, num_microbatches) -> tuple[dict[int, int], dict[int, int]]:
    """Peak live activations per stage: F end (or R start) to B end (or W end).

    On a recomputing stage the forward keeps only its inputs, from the F's end until the
    backward is done: those count as stashed inputs, the rebuilt activations as live.
    """
    peak, stash = {}, {}
    for s in range(num_stages):
        full, inputs = [], []
        for mb in range(num_microbatches):
            if (s, F, mb) not in done:
                continue
            last = done.get((s, W, mb)) if (s, mb) in split else done.get((s, B, mb))
            if (s, R, mb) in starts:
                inputs.append((done[(s, F, mb)], last))
                full.append((starts[(s, R, mb)], last))
            else:
                full.append((done[(s, F, mb)], last))
        peak[s], stash[s] = _max_overlap(full), _max_overlap(inputs)
    return peak, stash


def _max_overlap(intervals: list[tuple[float, float | None]]) -> int:
    """Most intervals alive at once; one ending at t and another starting at t do not overlap."""
    points = []
    for start, end in intervals:
        points.append((start, 1))
        points.append((end if end is not None else float("inf"), -1))
    points.sort(key=lambda p: (p[0], p[1]))  # ends (-1) before starts (+1) at the same time
    best = live = 0
    for _, delta in points:
        live += delta
        best = max(best, live)
    return best


def timeline_from_events(events: list[tuple[int, float, float, Action]]) -> Timeline:
    """A Timeline from measured (rank, start, end, action) events, in seconds from the step start.

    Used by `autopar train --trace`, so measured and simulated timelines share one format.
    Peak activations are not measured here (metrics.jsonl has per-stage peak memory instead).
    """
    compute = [e for e in events if e[3].op.is_compute]
    makespan = max((end for _, _, end, _ in compute), default=0.0)
    busy: dict[int, float] = {}
    for rank, start, end, _ in compute:
        busy[rank] = busy.get(rank, 0.0) + (end - start)
    bubble = {rank: (1.0 - b / makespan if makespan else 0.0) for rank, b in busy.items()}
    return Timeline(events=sorted(compute, key=lambda e: (e[0], e[1])), makespan=makespan, bubble=bubble,
                    peak_activations={})
