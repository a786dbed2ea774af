"""Pipeline schedules as the runtime executes them: communication posted as numbered steps (both neighbours post
one exchange as one step, in one order, as NCCL needs), and the runtime's timing of a forward's compute and
of its waits."""

from __future__ import annotations

import pytest

from autopar.pipeline.actions import Action, Op
from autopar.pipeline.comm_steps import batch_communication
from autopar.pipeline.schedules import build_schedule
from autopar.pipeline.simulate import check, step_mismatches

F, B = Op.FORWARD, Op.BACKWARD


# --- batched communication steps (NCCL-safe) ----------------------------------------------------

def test_neighbours_post_their_exchange_as_one_step_in_one_order():
    """1F1B, pp=2: rank 0 sends F1 and awaits B0 while rank 1 sends B0 and awaits F1. Posted one by
    one in list order, each side's send waits behind a receive the other has not posted (NCCL
    deadlocks); as steps, both ranks post the same steps in the same order."""
    batched = build_schedule("1f1b", pp=2, num_microbatches=3, batched=True)
    steps = {r: [a.step for a in acts if a.op.is_comm] for r, acts in batched.items()}
    assert steps[0] == sorted(steps[0]) and steps[1] == sorted(steps[1])
    ends = {(a.stage, a.op, a.microbatch): a.step for acts in batched.values() for a in acts if a.op.is_comm}
    for (s, op, mb), step in ends.items():
        if op in (Op.SEND_ACT, Op.SEND_GRAD):
            assert ends[(s + 1 if op == Op.SEND_ACT else s - 1, Op.RECV_ACT if op == Op.SEND_ACT else Op.RECV_GRAD,
                         mb)] == step
    # the lists without steps, numbered in each rank's own posting order, disagree: the hazard
    naive = build_schedule("1f1b", pp=2, num_microbatches=3)
    numbered = {r: [] for r in naive}
    for r, acts in naive.items():
        count = 0
        for a in acts:
            if a.op.is_comm:
                numbered[r].append(Action(a.stage, a.op, a.microbatch, peer=a.peer, step=count))
                count += 1
            else:
                numbered[r].append(a)
    assert any("must be posted in one group" in p for p in step_mismatches(numbered))


def test_check_catches_mismatched_communication_steps():
    def broken(edit):
        schedule = build_schedule("1f1b", pp=2, num_microbatches=3, batched=True)
        check(schedule, pp=2, num_stages=2, num_microbatches=3)
        edit(schedule)
        with pytest.raises(ValueError) as info:
            check(schedule, pp=2, num_stages=2, num_microbatches=3)
        return str(info.value)

    def restep(rank, index, step):
        def edit(s):
            a = s[rank][index]
            s[rank][index] = Action(a.stage, a.op, a.microbatch, peer=a.peer, step=step)
        return edit

    comm0 = [i for i, a in enumerate(build_schedule("1f1b", pp=2, num_microbatches=3, batched=True)[0]) if a.op.is_comm]
    assert "must be posted in one group" in broken(restep(0, comm0[0], 99))
    assert "steps must be adjacent and increase" in broken(restep(0, comm0[1], 0))

    def swap_order_within_a_step(s):  # two sends to one peer in one step, listed in the other order on one side
        for r, acts in s.items():
            s[r] = [Action(a.stage, a.op, a.microbatch, peer=a.peer, step=0 if a.op.is_comm else None)
                    for a in acts if a.op.is_comm] + [a for a in acts if a.op.is_compute]
        sends = [i for i, a in enumerate(s[0]) if a.op == Op.SEND_ACT][:2]
        s[0][sends[0]], s[0][sends[1]] = s[0][sends[1]], s[0][sends[0]]
    assert "one order at both ends" in broken(swap_order_within_a_step)
    with pytest.raises(ValueError, match="compute-only"):
        batch_communication(build_schedule("1f1b", pp=2, num_microbatches=3), pp=2, num_stages=2, num_microbatches=3)


def test_a_forwards_timed_compute_leaves_out_its_scope():
    """The busy time behind the measured bubble counts forwards and backwards only: what a forward scope does
    on entry (2BW applies a deferred optimizer update there) is not the forward's compute. A fake clock that a
    scope advances by 100 makes the check exact."""
    import contextlib

    import torch

    from autopar.pipeline.runtime import PipelineRuntime

    class FakeClock:
        now = 0.0

        def mark(self):
            return self.now

        def reset(self):
            pass

    class NoP2P:
        device = torch.device("cpu")

        def wait_sends(self):
            pass

    runtime = PipelineRuntime(stages={0: torch.nn.Linear(3, 1)}, num_stages=1, pp=1, pp_rank=0, p2p=NoP2P(),
                              first_input=lambda b: (b["x"],))
    runtime.clock = FakeClock()

    @contextlib.contextmanager
    def slow_scope(stage, mb):
        runtime.clock.now += 100  # e.g. an optimizer update applied before the forward
        yield

    step = runtime.run([Action(0, F, 0), Action(0, B, 0)], [{"x": torch.ones(2, 3)}],
                       loss_fn=lambda out, batch: out.sum(), record=True, forward_scope=slow_scope)
    assert [(str(a), end - began) for began, end, a in step.marks] == [("0F0", 0.0), ("0B0", 0.0)]


def test_a_wait_tally_counts_nested_waits_once_and_forgets_them_at_a_step():
    """timing.WaitTally: the runtime times a receive's wait and the transfer layer the metadata wait inside it;
    the outer one alone counts. A fake clock makes the sums exact."""
    from autopar.timing import WaitTally

    class FakeClock:
        now = 0.0

        def mark(self):
            return self.now

        def seconds(self, marks):
            return list(marks)

        def reset(self):
            pass

    tally = WaitTally("cpu")
    tally._clock = clock = FakeClock()
    with tally.timed("pipeline"):
        clock.now += 2
        with tally.timed("data_parallel"):  # nested: part of the outer wait
            clock.now += 3
    with tally.timed("data_parallel"):
        clock.now += 5
    assert (tally.seconds("pipeline"), tally.seconds("data_parallel")) == (5, 5)
    tally.start_step()
    assert tally.seconds("pipeline") == 0
    silent = WaitTally()  # engines that report no waits
    with silent.timed("pipeline"):
        pass
    assert silent.seconds("pipeline") == 0
