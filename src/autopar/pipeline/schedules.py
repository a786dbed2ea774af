"""Pipeline schedules as data: per-rank ordered action lists built from general rules.

`generate` emits compute actions only (F, B, I, W, R) for every rank; `add_communication`
lowers them by inserting the sends and receives that cross-rank neighbours need;
`build_schedule` does both. Stages are global indices (num_stages = pp * chunks), placed on
ranks by `stage_to_rank`. Every schedule is written as a rule over (stage, micro-batch) — a
warm-up count and an ordering — never as a table of per-stage special cases, so it works for
any pp and number of micro-batches, and `simulate.check` can verify it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from autopar.config.schedules import ASYNC_SCHEDULES, SCHEDULE_SPECS, SCHEDULES, ScheduleSpec, schedule_spec  # noqa: F401
from autopar.errors import ConfigError
from autopar.pipeline.actions import Action, Op, Schedule, stage_to_rank

F, B, I, W, R = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.RECOMPUTE

def minimum_microbatches(name: str, pp: int, chunks: int = 1) -> int:
    """Smallest number of micro-batches `name` supports (interleaving needs whole groups of pp)."""
    return schedule_spec(name).minimum_microbatches(pp)


def placement(name: str) -> str:
    """How `name` places stages on ranks (the schedule table's `placement`)."""
    return schedule_spec(name).placement


def build_schedule(name: str, *, pp: int, num_microbatches: int, chunks: int = 1,
                   recompute: frozenset[int] | set[int] = frozenset(), prefetch: bool = False,
                   batched: bool = False) -> Schedule:
    """`generate` then `add_communication`: the lists a runtime executes.

    `batched=True` lowers into communication steps instead (comm_steps.py: every transfer in
    one batched group at both ends, NCCL-safe); the runtime uses that; `prefetch` then has no
    effect (receives are already posted as early as the simulated timeline allows).
    """
    schedule = generate(name, pp=pp, num_microbatches=num_microbatches, chunks=chunks, recompute=recompute)
    style = placement(name)
    if batched:
        from autopar.pipeline.comm_steps import batch_communication  # it simulates; simulate imports nothing here
        return batch_communication(schedule, pp=pp, num_stages=pp * chunks, num_microbatches=num_microbatches,
                                   style=style)
    return add_communication(schedule, pp=pp, num_stages=pp * chunks, prefetch=prefetch, style=style)


def generate(name: str, *, pp: int, num_microbatches: int, chunks: int = 1,
             recompute: frozenset[int] | set[int] = frozenset()) -> Schedule:
    """Compute-only action lists, rank -> [Action], for schedule `name`.

    `recompute` holds the global stages whose forwards keep only their inputs; each of their
    micro-batches gets an R (a forward rerun that rebuilds the graph) before its B or I.
    """
    spec = schedule_spec(name)
    m = num_microbatches
    for label, value in (("pp", pp), ("chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{label} must be a positive integer, got {value!r}; use e.g. {label}=1")
    if not spec.accepts_chunks(chunks):
        several = [s.name for s in SCHEDULE_SPECS.values() if s.accepts_chunks(chunks)] if chunks > 1 else []
        raise ConfigError(f"schedule {name!r} runs {spec.chunks_text()} chunk(s) per rank (placed as "
                          f"{'a V' if spec.placement == 'v' else 'a loop'}), got chunks={chunks}; use "
                          f"chunks={spec.chunks[0]}" + (f", or schedule {' or '.join(map(repr, several))} for "
                                                        f"{chunks} chunks per rank" if several else ""))
    minimum = spec.minimum_microbatches(pp)
    if not isinstance(m, int) or m < minimum:
        raise ConfigError(f"schedule {name!r} with pp={pp} needs at least {minimum} micro-batches, "
                          f"got num_microbatches={m!r}; use num_microbatches >= {minimum}")
    if spec.microbatches == "multiple of pp" and m % pp:
        raise ConfigError(f"schedule {name!r} runs micro-batches in groups of pp={pp}, so "
                          f"num_microbatches must be a multiple of {pp}, got {m}; use e.g. {m + pp - m % pp}")
    num_stages = pp * chunks
    recompute = frozenset(recompute)
    bad = sorted(s for s in recompute if not isinstance(s, int) or not 0 <= s < num_stages)
    if bad:
        raise ConfigError(f"recompute stages must be in 0..{num_stages - 1} (pp*chunks stages), got {bad}")
    return GENERATORS[spec.generator](pp, m, chunks, recompute)


def recomputed_stages(schedule: Schedule) -> frozenset[int]:
    """The stages that recompute, read from the schedule (scp drops the last stage from the request)."""
    return frozenset(a.stage for actions in schedule.values() for a in actions if a.op == R)


def _one_forward_one_backward(stage: int, m: int, depth: int) -> list[Action]:
    """`depth` forwards, then alternate backward and forward, then drain the backwards.

    Every single-chunk schedule here is this shape and differs only in `depth`, the number of
    micro-batches in flight on the stage: GPipe m; 1F1B pp-stage (just enough to keep the
    pipeline full); eager 1F1B 2(pp-stage)-1 (one forward slot ahead, so a forward transfer
    overlaps the next stage's backward instead of delaying it); SCP one more than 1F1B on
    recomputing stages. Depths must drop by at least one per stage, or a stage would wait for
    a forward that is queued behind its own successor's backward.
    """
    order = [Action(stage, F, mb) for mb in range(depth)]
    for mb in range(m):
        order.append(Action(stage, B, mb))
        if mb + depth < m:
            order.append(Action(stage, F, mb + depth))
    return order


def _scp_depth(stage: int, pp: int, m: int, recompute: frozenset[int]) -> int:
    """Merak's shifted critical path as rules over 1F1B with recomputation.

    1. The last stage never recomputes (`generate` drops it from the set): it runs F and B back
       to back with one micro-batch alive, so recomputing there only adds time.
    2. Each R sits right before its B, and `add_communication` posts the gradient receive before
       the R: the recompute runs while the stage waits for its gradient (Merak's pre-recompute;
       with asynchronous receives this holds for every micro-batch, not just the drain).
    3. Without its recompute the last stage is the fastest, so the critical path shifts to the
       stages before it, which would idle waiting for their first gradient. Every stage up to
       the last recomputing one runs one more forward than 1F1B (pp-stage+1): the extra forward
       fills that wait, and on a recomputing stage it costs only a stashed input. Stages before
       a recomputing one take the extra forward too: each stage must stay one micro-batch ahead
       of the next, or its next forward would wait behind the next stage's backward.
    Never slower than 1F1B with the same recomputation (in our tests), up to one forward faster.
    """
    return min(m, pp - stage + (stage <= max(recompute, default=-1)))


def _recompute_before_backward(order: Iterable[Action], recompute: frozenset[int]) -> list[Action]:
    """Put R(stage, mb) immediately before the B or I of each micro-batch of a recomputing stage.

    Runtimes post receives asynchronously and `add_communication` posts a recomputed
    micro-batch's gradient receive before its R, so the recompute runs while the gradient is
    in flight: the placement Merak's shifted-critical-path schedule introduced.
    R goes no earlier: rebuilt activations would then be alive longer for no gain in time
    (the drain is bound by the gradient chain, not by R).
    """
    out: list[Action] = []
    for action in order:
        if action.op in (B, I) and action.stage in recompute:
            out.append(Action(action.stage, R, action.microbatch))
        out.append(action)
    return out


def _zb_h1(stage: int, pp: int, m: int) -> list[Action]:
    """ZB-H1 under the rule that a micro-batch's activations live until its W.

    The backward is split: I (input gradient) goes upstream at once, W (weight gradient) runs
    after it, off the critical path. As in 1F1B the stage admits pp-stage micro-batches, and
    the W of the oldest runs before the next F, so no more than pp-stage are ever alive.
    Only I's are on the gradient chain, so warm-up and drain shrink: with costs F, I, W the
    step takes m(F+I+W) + (pp-1)(F+I), against m(F+I+W) + (pp-1)(F+I+W) for 1F1B. (The paper's
    ZB-H1 lets W's wait longer to also hide them in the drain, which needs more micro-batches
    alive under this rule.)
    """
    depth = min(m, pp - stage)
    order = [Action(stage, F, mb) for mb in range(depth)]
    for mb in range(m):
        order += [Action(stage, I, mb), Action(stage, W, mb)]
        if mb + depth < m:
            order.append(Action(stage, F, mb + depth))
    return order


def _zbv(pp: int, m: int) -> Schedule:
    """ZB-V: two chunks per rank as a V (stages r and 2pp-1-r), the backward split into I and W.

    A micro-batch goes down the ranks on chunk 0 and back up on chunk 1, so the loss and the
    first stage share rank 0 and every rank turns a micro-batch around after the same
    number of hops as its chunk-0 depth. The order is a rule played on unit costs (F = I = W):
    at each moment a rank runs its first ready action by priority I, then F, then W (oldest
    micro-batch first, the later stage first), and starts a new micro-batch (a chunk-0 F)
    only while its two chunk activations (each alive from F to W) fit beside those alive and
    those promised to micro-batches already started: at most 2pp chunk activations per
    rank, 1F1B's first-rank memory, on every rank. W's fill what would be waits, so only the first micro-batch's hops
    remain as bubble. The lists are fixed orders, so they run under any real timing (the
    simulator and torch's validator check them).
    """
    num_stages, cap = 2 * pp, 2 * pp
    rank_of = {s: stage_to_rank(s, pp, num_stages, "v") for s in range(num_stages)}
    done: dict[tuple[int, Op, int], int] = {}  # (stage, op, mb) -> round it ran
    todo = {r: [(s, mb) for mb in range(m) for s in range(num_stages) if rank_of[s] == r] for r in range(pp)}
    order: Schedule = {r: [] for r in range(pp)}
    alive = {r: 0 for r in range(pp)}  # chunk activations from F to W
    reserved = {r: 0 for r in range(pp)}  # chunk-1 activations of micro-batches started here, still to come
    pending_w: dict[int, list[tuple[int, int]]] = {r: [] for r in range(pp)}
    t = 0
    while any(todo.values()) or any(pending_w.values()):
        picks = {}
        for r in range(pp):
            def ready(s, op, mb):
                if op == F:
                    return s == 0 or done.get((s - 1, F, mb), t) < t
                return (s, F, mb) in done and (s == num_stages - 1 or done.get((s + 1, I, mb), t) < t)
            forwards = sorted(((mb, -s) for s, mb in todo[r] if (s, F, mb) not in done and ready(s, F, mb)
                               and (s >= pp or alive[r] + reserved[r] + 2 <= cap)))
            inputs = sorted(((mb, -s) for s, mb in todo[r] if (s, F, mb) in done and ready(s, I, mb)))
            if inputs:
                mb, s = inputs[0]
                picks[r] = Action(-s, I, mb)
            elif forwards:
                mb, s = forwards[0]
                picks[r] = Action(-s, F, mb)
            elif pending_w[r]:
                picks[r] = Action(*_stage_mb(pending_w[r].pop(0), W))
        for r, a in picks.items():
            done[(a.stage, a.op, a.microbatch)] = t
            order[r].append(a)
            if a.op == F:
                alive[r] += 1
                reserved[r] += 1 if a.stage < pp else -1
            elif a.op == I:
                todo[r].remove((a.stage, a.microbatch))
                pending_w[r].append((a.stage, a.microbatch))
            else:
                alive[r] -= 1
        if not picks:
            raise RuntimeError(f"zbv rule stalled at round {t} (pp={pp}, m={m}): a bug in the rule")
        t += 1
    return order


def _interleaved(rank: int, pp: int, chunks: int, m: int) -> list[Action]:
    """Interleaved 1F1B (virtual stages): rank r holds stages r, r+pp, ..., r+(chunks-1)pp.

    Micro-batches go through in groups of pp: a rank runs the forward of a group on chunk 0,
    then on chunk 1, ..., and backwards in the reverse chunk order. Warm-up: micro-batch 0
    must pass (chunks-1) full rounds of pp stages before reaching this rank's last chunk, and
    its gradient needs a round trip through the 2(pp-1-r) later stage slots, so the rank runs
    (chunks-1)pp + 2(pp-1-r) forwards first, then one forward and one backward in turn.
    Each chunk is 1/chunks of the rank's layers, so the bubble shrinks by the chunk count:
    (pp-1)/(m*chunks + pp-1) of the step. The 2(pp-1-r) (not 1F1B's pp-1-r) gives each hop a
    forward slot of slack, as in eager 1F1B, so transfers can hide; with chunks=1 this is
    eager 1F1B.
    """
    total = m * chunks

    def virtual(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, pp * chunks)
        chunk, offset = divmod(within, pp)
        if backward:
            chunk = chunks - 1 - chunk
        return chunk * pp + rank, group * pp + offset

    warmup = min(total, (chunks - 1) * pp + 2 * (pp - 1 - rank))
    order = [Action(*_stage_mb(virtual(k, False), F)) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(Action(*_stage_mb(virtual(warmup + k, False), F)))
        order.append(Action(*_stage_mb(virtual(k, True), B)))
    order += [Action(*_stage_mb(virtual(k, True), B)) for k in range(total - warmup, total)]
    return order


def _stage_mb(stage_mb: tuple[int, int], op: Op) -> tuple[int, Op, int]:
    return stage_mb[0], op, stage_mb[1]


# The generators the schedule table names (config/schedules.py `generator`): (pp, m, chunks, recompute) -> the
# compute lists of one step, each R placed before its backward. Written as rules, never per-stage tables.
Generator = Callable[[int, int, int, frozenset], Schedule]


def _single_chunk(depth: Callable[[int, int, int, frozenset], int]) -> Generator:
    """A one-stage-per-rank schedule given by its depth(stage, pp, m, recompute): see _one_forward_one_backward."""
    def lists(pp: int, m: int, chunks: int, recompute: frozenset) -> Schedule:
        return {s: _recompute_before_backward(_one_forward_one_backward(s, m, depth(s, pp, m, recompute)), recompute)
                for s in range(pp)}
    return lists


def _scp(pp: int, m: int, chunks: int, recompute: frozenset) -> Schedule:
    return _single_chunk(_scp_depth)(pp, m, chunks, recompute - {pp - 1})  # the last stage never recomputes


GENERATORS: dict[str, Generator] = {
    "gpipe": _single_chunk(lambda s, pp, m, recompute: m),
    # one step of PipeDream-2BW or PipeDream run alone (warm-up and drain) is 1F1B; their engines run
    # the no-flush lists of pipeline/async_schedules.py across steps
    "1f1b": _single_chunk(lambda s, pp, m, recompute: min(m, pp - s)),
    "eager-1f1b": _single_chunk(lambda s, pp, m, recompute: min(m, 2 * (pp - s) - 1)),
    "scp": _scp,
    "interleaved": lambda pp, m, chunks, recompute: {
        r: _recompute_before_backward(_interleaved(r, pp, chunks, m), recompute) for r in range(pp)},
    "zb-h1": lambda pp, m, chunks, recompute: {
        s: _recompute_before_backward(_zb_h1(s, pp, m), recompute) for s in range(pp)},
    "zbv": lambda pp, m, chunks, recompute: {
        r: _recompute_before_backward(acts, recompute) for r, acts in _zbv(pp, m).items()},
}
missing = {spec.generator for spec in SCHEDULE_SPECS.values()} - set(GENERATORS)
assert not missing, f"schedule table names generators not registered here: {missing}"


def add_communication(schedule: Schedule, *, pp: int, num_stages: int, style: str = "loop",
                      prefetch: bool = False) -> Schedule:
    """Insert sends and receives for every cut between stages on different ranks.

    Neighbouring stages on one rank hand data over locally, with no action. A forward's output
    is sent right after it (SEND_F) and received right before the next stage's forward
    (RECV_F); an input gradient is sent right after the B or I that makes it (SEND_B). The
    output-gradient receive (RECV_B) is posted right before the first action of that
    micro-batch's backward work: before its R if the stage recomputes it (so the recompute
    overlaps the transfer; receives are asynchronous and waited only by the B or I), else
    right before its B or I.

    A transfer starts only once both ends are posted, so a receive posted right before its
    consumer puts the whole transfer on the critical path. `prefetch=True` posts every receive
    one compute action earlier, so the transfer overlaps that compute (this is what lets eager
    1F1B and interleaving hide forward transfers); a receive buffer then lives one action longer.
    Receives keep their relative order either way, so sends and receives still pair up in order.
    """
    if style not in ("loop", "v"):
        raise ConfigError(f"unknown stage placement style {style!r}; use 'loop' or 'v'")

    def rank(stage: int) -> int:
        return stage_to_rank(stage, pp, num_stages, style)

    def remote(a: int, b: int) -> bool:
        return 0 <= b < num_stages and rank(a) != rank(b)

    lowered: Schedule = {}
    for r, actions in schedule.items():
        recomputed = {(a.stage, a.microbatch) for a in actions if a.op == R}
        out: list[Action] = []
        for a in actions:
            s, mb = a.stage, a.microbatch
            grad_first = a.op == R or (a.op in (B, I) and (s, mb) not in recomputed)
            if a.op == F and remote(s, s - 1):
                out.append(Action(s, Op.RECV_ACT, mb, peer=rank(s - 1)))
            if grad_first and remote(s, s + 1):
                out.append(Action(s, Op.RECV_GRAD, mb, peer=rank(s + 1)))
            out.append(a)
            if a.op == F and remote(s, s + 1):
                out.append(Action(s, Op.SEND_ACT, mb, peer=rank(s + 1)))
            if a.op in (B, I) and remote(s, s - 1):
                out.append(Action(s, Op.SEND_GRAD, mb, peer=rank(s - 1)))
        lowered[r] = _post_receives_earlier(out) if prefetch else out
    return lowered


def _post_receives_earlier(actions: list[Action]) -> list[Action]:
    """Move each receive in front of the compute action that precedes it."""
    out: list[Action] = []
    last_compute = None
    for a in actions:
        if a.op in (Op.RECV_ACT, Op.RECV_GRAD) and last_compute is not None:
            out.insert(last_compute, a)
            last_compute += 1
        else:
            out.append(a)
            if a.op.is_compute:
                last_compute = len(out) - 1
    return out
