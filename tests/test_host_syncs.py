"""No hidden host-device synchronisation in the step loop, counted on CPU.

tests/sync_helpers.py counts autopar's calls that read a tensor's value on the host during
the second of three steps; each must be one of trainer.HOST_SYNCS_PER_STEP, once.
"""

from __future__ import annotations

from autopar.timing import Clock, StepTimer
from autopar.trainer import HOST_SYNCS_PER_STEP
from sync_helpers import count_host_syncs

STRATEGIES = [{"dp": 2}, {"pp": 2, "schedule": "1f1b"}, {"tp": 2}]


def test_a_step_reads_the_device_only_where_documented(rank_pool, tmp_path):
    per_rank = rank_pool(2).run(count_host_syncs, str(tmp_path), STRATEGIES)
    for rank, counts in enumerate(per_rank):
        for strategy, found in zip(STRATEGIES, counts):
            where = {key.split(" ")[0].split(":")[1]: n for key, n in found.items()}
            assert len(where) == len(found), (rank, strategy, found)  # one read per documented function
            assert where == dict.fromkeys(HOST_SYNCS_PER_STEP, 1), (rank, strategy, found)


def test_cpu_timing_is_the_host_clock():
    timer = StepTimer("cpu")
    timer.start()
    sum(range(10000))
    timer.stop()
    assert timer.seconds() > 0
    clock = Clock("cpu")
    marks = [clock.mark() for _ in range(3)]
    assert clock.seconds(marks) == marks and marks == sorted(marks)
