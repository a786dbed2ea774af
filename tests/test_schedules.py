"""Pipeline schedules: every schedule is complete and deadlock-free, and its timing and memory
match the closed forms (bubble fractions, live activations) with simple costs."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from autopar.errors import ConfigError
from autopar.pipeline.actions import Action, Op, stage_to_rank
from autopar.pipeline.schedules import (SCHEDULES, add_communication, build_schedule, generate,
                                        minimum_microbatches, placement, recomputed_stages)
from autopar.pipeline.comm_steps import batch_communication
from autopar.pipeline.simulate import check, simulate

F, B, I, W, R = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.RECOMPUTE
COMM = (Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD)


def costs(**by_op):
    """A cost function from per-op costs, e.g. costs(F=1, B=2); exact (Fraction) so formulas compare with ==."""
    table = {Op(k): Fraction(v) for k, v in by_op.items()}
    return lambda action: table[action.op]


def run(name, pp, m, chunks=1, recompute=frozenset(), cost=None, lowered=False, comm_cost=None):
    make = build_schedule if lowered else generate
    schedule = make(name, pp=pp, num_microbatches=m, chunks=chunks, recompute=recompute)
    return schedule, simulate(schedule, pp=pp, num_stages=pp * chunks, num_microbatches=m, cost=cost,
                              comm_cost=comm_cost)


def order(schedule, rank):
    return " ".join(str(a) for a in schedule[rank] if a.op.is_compute)


def cases():
    for name in SCHEDULES:
        chunks = 2 if name in ("interleaved-1f1b", "zbv") else 1
        for pp in (1, 2, 4):
            low = minimum_microbatches(name, pp, chunks)
            for m in sorted({low, low + 1, 2 * pp, 3 * pp + 1, 8}):
                if name == "interleaved-1f1b" and m % pp:
                    continue
                yield name, pp, chunks, m


@pytest.mark.parametrize("name,pp,chunks,m", list(cases()))
def test_every_schedule_is_complete_checked_and_runs(name, pp, chunks, m):
    num_stages, style = pp * chunks, placement(name)
    for recompute in (frozenset(), frozenset(range(num_stages))):
        compute_only = generate(name, pp=pp, num_microbatches=m, chunks=chunks, recompute=recompute)
        lowered = add_communication(compute_only, pp=pp, num_stages=num_stages, style=style)
        prefetched = add_communication(compute_only, pp=pp, num_stages=num_stages, prefetch=True, style=style)
        batched = batch_communication(compute_only, pp=pp, num_stages=num_stages, num_microbatches=m, style=style)
        for schedule in (compute_only, lowered, prefetched, batched):
            check(schedule, pp=pp, num_stages=num_stages, num_microbatches=m, style=style)
        assert all(a.step is not None for acts in batched.values() for a in acts if a.op.is_comm)
        assert [[a for a in acts if a.op.is_compute] for acts in batched.values()] == list(compute_only.values())
        assert all(a.op.is_compute for acts in compute_only.values() for a in acts)
        seen = [(a.stage, a.op, a.microbatch) for acts in compute_only.values() for a in acts]
        assert len(seen) == len(set(seen))
        for s in range(num_stages):
            for mb in range(m):
                assert (s, F, mb) in seen
                assert ((s, B, mb) in seen) != ((s, I, mb) in seen and (s, W, mb) in seen)
        timeline = simulate(lowered, pp=pp, num_stages=num_stages, num_microbatches=m, style=style)
        assert len(timeline.compute_events()) == len(seen)
        assert timeline.makespan > 0


# --- exact bubble fractions -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b"])
@pytest.mark.parametrize("fb", [(1, 2), (1, 1)])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 1), (2, 5), (4, 3), (4, 8), (8, 16)])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, fb, pp, m):
    f, b = fb
    _, t = run(name, pp, m, cost=costs(F=f, B=b))
    assert t.makespan == (m + pp - 1) * (f + b)
    assert all(t.bubble[r] == Fraction(pp - 1, m + pp - 1) for r in range(pp))


@pytest.mark.parametrize("fb", [(1, 1), (1, 2), (1, 3)])
@pytest.mark.parametrize("pp,v,m", [(2, 2, 2), (2, 2, 6), (4, 2, 4), (4, 2, 8), (4, 3, 12), (8, 2, 16), (1, 2, 3)])
def test_interleaved_bubble_shrinks_by_the_chunk_count(fb, pp, v, m):
    """With per-chunk costs f, b: makespan (m*v + pp - 1)(f + b), bubble (pp-1)/(m*v + pp-1).

    Each chunk is 1/v of a rank's layers, so against 1F1B on the same model (chunk costs v
    times larger) the idle time (pp-1)(f+b) is v times smaller: (pp-1)/v of a full F+B.
    """
    f, b = fb
    _, t = run("interleaved-1f1b", pp, m, chunks=v, cost=costs(F=f, B=b))
    assert t.makespan == (m * v + pp - 1) * (f + b)
    assert all(t.bubble[r] == Fraction(pp - 1, m * v + pp - 1) for r in range(pp))
    _, plain = run("1f1b", pp, m, cost=costs(F=f * v, B=b * v))
    assert plain.makespan - t.makespan == (pp - 1) * (f + b) * (v - 1)
    if pp > 1:
        assert max(t.bubble.values()) < min(plain.bubble.values())


def test_zb_h1_beats_1f1b_without_more_live_activations():
    """zb-h1: m(F+I+W) + (pp-1)(F+I): the weight gradients leave the warm-up and drain."""
    for f, i, w in [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, Fraction(1, 2))]:
        for pp in (1, 2, 4, 8):
            for m in (1, 2, pp, 2 * pp + 1):
                cost = costs(F=f, I=i, W=w, B=i + w)
                _, zb = run("zb-h1", pp, m, cost=cost)
                _, ofob = run("1f1b", pp, m, cost=cost)
                assert zb.makespan == m * (f + i + w) + (pp - 1) * (f + i)
                assert ofob.makespan == (m + pp - 1) * (f + i + w)
                if pp > 1:
                    assert all(zb.bubble[r] < ofob.bubble[r] for r in range(pp))
                assert all(zb.peak_activations[s] <= ofob.peak_activations[s] for s in range(pp))


def _torch_check(schedule, pp, num_stages, m, style):
    """torch.distributed.pipelining's own checks on our compute lists: its validator (every F, I, W once,
    in a valid order per stage) and its communication lowering and dry run (raises on a deadlock)."""
    from torch.distributed.pipelining import schedules as ts
    kind = {F: ts.FORWARD, B: ts.FULL_BACKWARD, I: ts.BACKWARD_INPUT, W: ts.BACKWARD_WEIGHT}
    theirs = {r: [ts._Action(a.stage, kind[a.op], a.microbatch) for a in acts] for r, acts in schedule.items()}
    ts._validate_schedule(theirs, pp, num_stages, m)
    to_rank = lambda s: stage_to_rank(s, pp, num_stages, style)
    ts._simulate_comms_compute(ts._add_send_recv(theirs, to_rank, num_stages), to_rank, num_stages)


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 2), (2, 8), (4, 4), (4, 8), (4, 13), (8, 16)])
def test_zbv_is_a_v_that_beats_zb_h1_within_1f1b_memory(pp, m):
    """zbv against the same model run as one stage per rank (its chunk costs doubled):
    faster than zb-h1 and 1f1b, at most 2pp chunk activations (1F1B's first rank) on each rank."""
    schedule, t = run("zbv", pp, m, chunks=2, cost=costs(F=1, I=1, W=1))
    _torch_check(schedule, pp, 2 * pp, m, "v")
    for r, acts in schedule.items():
        assert {a.stage for a in acts} == {r, 2 * pp - 1 - r}  # the V: rank 0 holds the first and the last stage
        alive = peak = 0
        for a in acts:  # activations live from F to W whatever the timing: the list order bounds them
            alive += {F: 1, W: -1}.get(a.op, 0)
            peak = max(peak, alive)
        assert peak <= 2 * pp
    _, zb = run("zb-h1", pp, m, cost=costs(F=2, I=2, W=2, B=4))
    _, ofob = run("1f1b", pp, m, cost=costs(F=2, B=4))
    assert t.makespan <= zb.makespan <= ofob.makespan
    if pp > 1 and m >= 2 * pp:
        assert t.makespan < zb.makespan and t.makespan <= 6 * m + 3 * pp  # little more than the work itself
    with pytest.raises(ConfigError, match="chunks=2"):
        generate("zbv", pp=pp, num_microbatches=m)


def test_existing_schedules_pass_torchs_validator():
    for name, chunks in (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("gpipe", 1)):
        _torch_check(generate(name, pp=4, num_microbatches=8, chunks=chunks), 4, 4 * chunks, 8, "loop")


# --- live activations -------------------------------------------------------------------------

@pytest.mark.parametrize("pp,m", [(1, 4), (2, 1), (2, 6), (4, 2), (4, 6), (4, 12), (8, 5)])
def test_live_activations(pp, m):
    expected = {
        "1f1b": lambda k: min(m, pp - k),
        "gpipe": lambda k: m,
        "eager-1f1b": lambda k: min(m, 2 * (pp - k) - 1),
        "zb-h1": lambda k: min(m, pp - k),
    }
    for name, formula in expected.items():
        for cost in (None, costs(F=1, B=1, I=1, W=1)):
            _, t = run(name, pp, m, cost=cost)
            assert t.peak_activations == {k: formula(k) for k in range(pp)}, name


# --- scp and recomputation --------------------------------------------------------------------

def test_scp_matches_the_worked_order_for_4_stages_6_microbatches():
    schedule = generate("scp", pp=4, num_microbatches=6, recompute={0, 1, 2, 3})
    assert order(schedule, 3) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"  # no recompute on the last stage
    assert order(schedule, 2) == "2F0 2F1 2F2 2R0 2B0 2F3 2R1 2B1 2F4 2R2 2B2 2F5 2R3 2B3 2R4 2B4 2R5 2B5"
    assert order(schedule, 0).startswith("0F0 0F1 0F2 0F3 0F4 0R0 0B0 0F5")
    plain = generate("1f1b", pp=4, num_microbatches=6, recompute={0, 1, 2, 3})
    assert order(plain, 2) == "2F0 2F1 2R0 2B0 2F2 2R1 2B1 2F3 2R2 2B2 2F4 2R3 2B3 2F5 2R4 2B4 2R5 2B5"


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 6), (3, 5), (4, 4), (4, 6), (4, 12), (6, 12)])
def test_scp_recomputes_ahead_of_the_gradient_and_is_never_slower(pp, m):
    everywhere, all_but_last = frozenset(range(pp)), frozenset(range(pp - 1))
    lowered = build_schedule("scp", pp=pp, num_microbatches=m, recompute=everywhere)
    assert recomputed_stages(lowered) == all_but_last  # what the runtime must be told
    for rank, actions in lowered.items():
        text = [str(a) for a in actions]
        for mb in range(m):
            if rank == pp - 1:
                assert f"{rank}R{mb}" not in text  # the last stage never recomputes
                continue
            recv, rec, back = (text.index(f"{rank}{x}{mb}") for x in ("RECV_B", "R", "B"))
            assert recv < rec < back  # gradient receive posted, recompute runs while it is in flight
    for f, b, r in [(1, 2, 1), (1, 1, 1), (2, 3, 1), (1, 2, Fraction(1, 2)), (1, 3, 2)]:
        cost = costs(F=f, B=b, R=r)
        _, fused = run("1f1b", pp, m, cost=costs(F=f, B=b + r))  # recompute inside a blocking backward
        _, plain_all = run("1f1b", pp, m, recompute=everywhere, cost=cost)
        _, plain = run("1f1b", pp, m, recompute=all_but_last, cost=cost)
        _, scp = run("scp", pp, m, recompute=everywhere, cost=cost)
        # Merak: moving R ahead of the gradient wait takes (S-1) recomputes off the critical path
        assert plain_all.makespan == (m + pp - 1) * (f + b) + m * r
        assert fused.makespan - plain_all.makespan == (pp - 1) * r
        # dropping the last stage's recompute and one extra warm-up forward: never slower
        assert scp.makespan <= plain.makespan < plain_all.makespan
        assert scp.peak_activations == {k: 1 for k in range(pp)}
        assert scp.stashed_inputs == {k: (min(m, pp - k + 1) if k < pp - 1 else 0) for k in range(pp)}


def test_scp_gains_one_forward_over_1f1b_when_backward_is_slower_than_forward():
    """F=1, B=2, R=1, 4 stages, 8 micro-batches: 1F1B+R 41, without the last stage's R 39, SCP 38."""
    assert run("1f1b", 4, 8, recompute={0, 1, 2, 3})[1].makespan == 41
    assert run("1f1b", 4, 8, recompute={0, 1, 2})[1].makespan == 39
    assert run("scp", 4, 8, recompute={0, 1, 2, 3})[1].makespan == 38


def test_posting_the_gradient_receive_before_the_recompute_hides_the_transfer():
    lowered = build_schedule("1f1b", pp=4, num_microbatches=6, recompute={0, 1, 2})
    late = {}
    for rank, actions in lowered.items():  # move every RECV_B to just before its B
        late[rank] = [a for a in actions if a.op != Op.RECV_GRAD]
        for a in [a for a in actions if a.op == Op.RECV_GRAD]:
            late[rank].insert(late[rank].index(Action(a.stage, B, a.microbatch)), a)
    check(late, pp=4, num_stages=4, num_microbatches=6)
    kw = dict(pp=4, num_stages=4, num_microbatches=6, comm_cost=lambda a: Fraction(1, 2))
    assert simulate(lowered, **kw).makespan < simulate(late, **kw).makespan


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 16)])
def test_eager_1f1b_hides_forward_transfers_when_receives_are_posted_early(pp, m):
    """Alpa: same step time as 1F1B without communication cost; with it, each stage's forward
    is one slot ahead, so activation transfers overlap compute. A receive posted right before
    its forward cannot overlap anything, so the lowered lists need prefetch=True for this."""
    assert run("eager-1f1b", pp, m)[1].makespan == run("1f1b", pp, m)[1].makespan
    c = dict(comm_cost=lambda a: Fraction(1, 2) if a.op == Op.SEND_ACT else 0)
    for lowered in (False, True):
        make = (lambda n: build_schedule(n, pp=pp, num_microbatches=m, prefetch=True)) if lowered else (
            lambda n: generate(n, pp=pp, num_microbatches=m))
        eager, plain = (simulate(make(n), pp=pp, num_stages=pp, num_microbatches=m, **c).makespan
                        for n in ("eager-1f1b", "1f1b"))
        assert eager < plain
        assert eager == (m + pp - 1) * 3 + (pp - 1) * Fraction(1, 2)  # only the first micro-batch pays the hops
    late = build_schedule("eager-1f1b", pp=pp, num_microbatches=m)
    assert simulate(late, pp=pp, num_stages=pp, num_microbatches=m, **c).makespan > eager


# --- communication --------------------------------------------------------------------------

@pytest.mark.parametrize("name,pp,chunks,m", [("1f1b", 4, 1, 6), ("zb-h1", 3, 1, 4), ("interleaved-1f1b", 2, 2, 4),
                                              ("interleaved-1f1b", 4, 3, 8), ("scp", 4, 1, 6)])
def test_sends_and_receives_pair_up(name, pp, chunks, m):
    num_stages = pp * chunks
    lowered = build_schedule(name, pp=pp, num_microbatches=m, chunks=chunks, recompute={0})
    comm = [(r, a) for r, acts in lowered.items() for a in acts if a.op.is_comm]
    keys = {(a.stage, a.op, a.microbatch): r for r, a in comm}
    assert len(keys) == len(comm) == 4 * (num_stages - 1) * m
    pair = {Op.SEND_ACT: (1, Op.RECV_ACT), Op.SEND_GRAD: (-1, Op.RECV_GRAD)}
    for rank, a in comm:
        assert a.peer != rank
        if a.op in pair:
            step, op = pair[a.op]
            assert keys[(a.stage + step, op, a.microbatch)] == a.peer
    check(lowered, pp=pp, num_stages=num_stages, num_microbatches=m)


def test_same_rank_neighbours_exchange_without_actions():
    lowered = build_schedule("interleaved-1f1b", pp=1, num_microbatches=3, chunks=2)
    assert all(a.op.is_compute for a in lowered[0])
    # 'v' placement: with pp=2 and 4 stages, stages 1 and 2 share rank 1 (and 3 returns to rank 0)
    m, num_stages = 2, 4
    sequential = {0: [], 1: []}
    steps = [(s, F, mb) for mb in range(m) for s in range(num_stages)]
    steps += [(s, B, mb) for mb in range(m) for s in reversed(range(num_stages))]
    for s, op, mb in steps:
        sequential[stage_to_rank(s, 2, num_stages, "v")].append(Action(s, op, mb))
    lowered = add_communication(sequential, pp=2, num_stages=num_stages, style="v")
    check(lowered, pp=2, num_stages=num_stages, num_microbatches=m, style="v")
    comm = [a for acts in lowered.values() for a in acts if a.op.is_comm]
    assert {(a.stage, a.op) for a in comm} == {
        (0, Op.SEND_ACT), (1, Op.RECV_ACT), (2, Op.SEND_ACT), (3, Op.RECV_ACT),
        (3, Op.SEND_GRAD), (2, Op.RECV_GRAD), (1, Op.SEND_GRAD), (0, Op.RECV_GRAD)}
    with pytest.raises(ConfigError, match="placement"):
        add_communication(sequential, pp=2, num_stages=num_stages, style="zigzag")


# --- check catches broken schedules ------------------------------------------------------------

def lowered_1f1b(pp=2, m=3, **kw):
    return build_schedule("1f1b", pp=pp, num_microbatches=m, **kw)


def test_check_catches_a_missing_backward():
    schedule = lowered_1f1b()
    schedule[0].remove(Action(0, B, 1))
    with pytest.raises(ValueError, match=r"missing backward 0B1"):
        check(schedule, pp=2, num_stages=2, num_microbatches=3)


def test_check_catches_a_send_without_receive():
    schedule = lowered_1f1b()
    schedule[1].remove(Action(1, Op.RECV_ACT, 2, peer=0))
    with pytest.raises(ValueError, match=r"0SEND_F2 on rank 0 has no matching 1RECV_F2"):
        check(schedule, pp=2, num_stages=2, num_microbatches=3)


def test_check_catches_a_deadlock():
    schedule = generate("gpipe", pp=2, num_microbatches=2)
    acts = schedule[0]  # rank 0: F0 F1 B0 B1 -> F0 B0 F1 B1: B0 waits for rank 1, which waits for F1
    acts[1], acts[2] = acts[2], acts[1]
    with pytest.raises(ValueError, match=r"deadlock.*rank 0: 0B0.*rank 1: 1F1"):
        check(schedule, pp=2, num_stages=2, num_microbatches=2)
    with pytest.raises(ValueError, match="deadlock"):
        simulate(add_communication(schedule, pp=2, num_stages=2), pp=2, num_stages=2, num_microbatches=2)


def test_check_catches_order_placement_recompute_and_message_order():
    def broken(edit, **kw):
        schedule = lowered_1f1b(**kw)
        edit(schedule)
        with pytest.raises(ValueError) as info:
            check(schedule, pp=2, num_stages=2, num_microbatches=3)
        return str(info.value)

    def move(rank, action, before):
        return lambda s: (s[rank].remove(action), s[rank].insert(s[rank].index(before), action))

    assert "0F0 must come before 0B0" in broken(move(0, Action(0, B, 0), Action(0, F, 0)))
    assert "belongs to rank 1" in broken(lambda s: s[0].append(s[1].pop(s[1].index(Action(1, B, 2)))))
    assert "appears 2 times" in broken(lambda s: s[0].append(Action(0, F, 0)))
    assert "missing recompute 0R1" in broken(lambda s: s[0].remove(Action(0, R, 1)), recompute={0})
    assert "0R2 must come before 0B2" in broken(move(0, Action(0, B, 2), Action(0, R, 2)), recompute={0})
    sends = [a for a in lowered_1f1b()[0] if a.op == Op.SEND_ACT]

    def swap_sends(s):
        i, j = s[0].index(sends[0]), s[0].index(sends[1])
        s[0][i], s[0][j] = s[0][j], s[0][i]
    assert "another order" in broken(swap_sends)
    assert "must come before" in broken(lambda s: s[0].insert(0, s[0].pop(s[0].index(Action(0, Op.SEND_ACT, 2, 1)))))


# --- bad input ---------------------------------------------------------------------------------

def test_bad_input_raises_config_errors():
    with pytest.raises(ConfigError, match=r"unknown pipeline schedule 'pipedream-flush'.*1f1b.*zb-h1"):
        generate("pipedream-flush", pp=2, num_microbatches=4)
    with pytest.raises(ConfigError, match=r"at least 4 micro-batches.*got num_microbatches=2"):
        generate("interleaved-1f1b", pp=4, num_microbatches=2, chunks=2)
    with pytest.raises(ConfigError, match=r"at least 1 micro-batches"):
        generate("1f1b", pp=2, num_microbatches=0)
    with pytest.raises(ConfigError, match=r"chunks=2.*use chunks=1.*interleaved-1f1b"):
        generate("1f1b", pp=2, num_microbatches=4, chunks=2)
    with pytest.raises(ConfigError, match=r"multiple of 4, got 6"):
        generate("interleaved-1f1b", pp=4, num_microbatches=6, chunks=2)
    with pytest.raises(ConfigError, match=r"pp must be a positive integer, got 0"):
        generate("gpipe", pp=0, num_microbatches=4)
    with pytest.raises(ConfigError, match=r"chunks must be a positive integer, got 0"):
        generate("interleaved-1f1b", pp=2, num_microbatches=4, chunks=0)
    with pytest.raises(ConfigError, match=r"recompute stages must be in 0..3.*\[4\]"):
        generate("scp", pp=4, num_microbatches=4, recompute={4})
    with pytest.raises(ConfigError, match="unknown pipeline schedule"):
        minimum_microbatches("nope", 2)
    assert [minimum_microbatches(n, 4, 2 if n in ("interleaved-1f1b", "zbv") else 1) for n in SCHEDULES] == [1, 1, 4, 1, 1, 1, 1]


# --- exports ----------------------------------------------------------------------------------

def test_chrome_trace_and_png(tmp_path):
    schedule, t = run("zb-h1", 4, 6, lowered=True)
    trace_path = tmp_path / "trace.json"
    t.to_chrome_trace(trace_path)
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e["ph"] == "X"]
    n_compute = sum(a.op.is_compute for acts in schedule.values() for a in acts)
    assert len(events) == n_compute
    assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= set(events[0])
    assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(t.makespan * 1e6)
    _, with_comm = run("1f1b", 2, 2, lowered=True, comm_cost=lambda a: 0.5)
    assert len([e for e in with_comm.events if e[3].op in COMM]) == 4 * 2  # 2 transfers per micro-batch, both ends
    png = tmp_path / "gantt.png"
    t.to_png(png, title="zb-h1 pp=4 m=6")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
