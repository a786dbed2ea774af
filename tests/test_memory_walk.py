"""The memory model's walk over a schedule's actions: the peak of what is live, by hand (no ranks)."""

from __future__ import annotations

import pytest

from autopar.pipeline.schedules import build_schedule
from autopar.search.memory import StageUnits
from autopar.search.memory_walk import COUNTS, rank_peaks, walk_schedule

# bytes of one of each: activations, stashed input, pending weight work, sent output, sent input gradient,
# received gradient, transient (COUNTS order); the last stage sends no output and receives no gradient
FIRST = (100.0, 10.0, 50.0, 40.0, 10.0, 40.0, 300.0)
LAST = (100.0, 10.0, 50.0, 0.0, 10.0, 0.0, 300.0)


def priced(counts, units) -> float:
    return sum(c * u for c, u in zip(counts, units))


def term_maxima(schedule: str, stage: int, units) -> float:
    """Each term's own largest bytes over the walk, added up: what the model did before the walk."""
    walk = walk_schedule(build_schedule(schedule, pp=2, num_microbatches=4), pp=2, num_stages=2)[stage]
    return sum(max(snap[0][i] for snap in walk.snapshots) * units[i] for i in range(len(COUNTS)))


@pytest.mark.parametrize("schedule, first, last", [
    # 1F1B: stage 0 peaks at B2 (F3 done): 2 micro-batches of activations and inputs, all 4 outputs sent, the
    # gradient of micro-batch 2 in, its transient: 200 + 20 + 160 + 40 + 300. The last stage holds one
    # micro-batch at a time; at B3 it has sent 3 input gradients (the 4th after it): 100 + 10 + 30 + 300
    ("1f1b", 720.0, 440.0),
    # GPipe: all 4 forwards, then B0: stage 0 has 4 micro-batches, 4 outputs sent, 1 gradient in, the transient:
    # 400 + 40 + 160 + 40 + 300; the last stage at B0: 4 micro-batches, no gradient sent yet: 400 + 40 + 300
    ("gpipe", 940.0, 740.0),
])
def test_walk_peak_by_hand_below_the_sum_of_term_maxima(schedule, first, last):
    peaks = rank_peaks(schedule, pp=2, chunks=1, num_microbatches=4, recompute=frozenset(),
                       unit_bytes={0: FIRST, 1: LAST})
    assert priced(peaks[0][0], FIRST) == first
    assert priced(peaks[1][1], LAST) == last
    # the last stage's input gradients peak at the step's end (all 4 sent), its activations earlier: the sum of
    # each term's maximum counts one more gradient (1F1B) or all four (GPipe) than is ever live with the rest
    assert term_maxima(schedule, 1, LAST) == last + (10.0 if schedule == "1f1b" else 40.0)
    assert term_maxima(schedule, 0, FIRST) == first  # stage 0: every term peaks at the same backward


def test_zero_bubble_held_and_received_gradient_peak_at_different_actions():
    """zb-h1, pp=2, m=4: stage 0's I of micro-batch 2 holds the received gradient (and no pending W yet), its
    W right after holds the pending work and no gradient in: the peak takes the larger, 730, not both (770)."""
    walk = walk_schedule(build_schedule("zb-h1", pp=2, num_microbatches=4), pp=2, num_stages=2)
    snaps = sorted(snap[0] for snap in walk[0].snapshots)
    assert snaps == [(2.0, 2.0, 0.0, 4.0, 0.0, 1.0, 1.0), (2.0, 2.0, 1.0, 4.0, 0.0, 0.0, 1.0)]
    peaks = rank_peaks("zb-h1", pp=2, chunks=1, num_microbatches=4, recompute=frozenset(),
                       unit_bytes={0: FIRST, 1: LAST})
    assert priced(peaks[0][0], FIRST) == 200 + 20 + 50 + 160 + 300
    assert term_maxima("zb-h1", 0, FIRST) == 200 + 20 + 50 + 160 + 40 + 300
    # the last stage: its W follows its I, so one micro-batch pending; during W3 all 4 input gradients are sent
    assert priced(peaks[1][1], LAST) == 100 + 10 + 50 + 40 + 300


def test_a_rank_with_two_stages_peaks_once():
    """Interleaved 1F1B: a rank runs one backward at a time, so its peak holds one transient, not one per stage,
    and its stages' other terms at the same action; the breakdown of each stage adds up to the rank's peak."""
    units = {s: FIRST if s < 3 else LAST for s in range(4)}
    peaks = rank_peaks("interleaved-1f1b", pp=2, chunks=2, num_microbatches=4, recompute=frozenset(),
                       unit_bytes=units)
    for rank, stages in peaks.items():
        assert sum(counts[COUNTS.index("transient")] for counts in stages.values()) == 1
        own = sum(priced(rank_peaks("interleaved-1f1b", pp=2, chunks=2, num_microbatches=4, recompute=frozenset(),
                                    unit_bytes=units, only=s)[rank][s], units[s]) for s in stages)
        joint = sum(priced(counts, units[s]) for s, counts in stages.items())
        assert joint < own
        memory = [StageUnits(params=1.0, grads=2.0, optimizer=3.0, per_count=units[s], headroom=1.0).at(counts)
                  for s, counts in stages.items()]
        assert sum(m.total for m in memory) == pytest.approx(joint + 6.0 * len(stages))


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_long_schedule_from_two_short_walks_equals_the_full_walk(schedule, chunks):
    pp, m = 2, 14
    units = {s: FIRST if s < pp * chunks - 1 else LAST for s in range(pp * chunks)}
    lists = build_schedule(schedule, pp=pp, num_microbatches=m, chunks=chunks)
    full = walk_schedule(lists, pp=pp, num_stages=pp * chunks)
    short = rank_peaks(schedule, pp=pp, chunks=chunks, num_microbatches=m, recompute=frozenset(), unit_bytes=units)
    for rank, walk in full.items():
        want = max(sum(priced(c, units[s]) for s, c in zip(walk.stages, snap)) for snap in walk.snapshots)
        got = sum(priced(c, units[s]) for s, c in short[rank].items())
        assert got == pytest.approx(want)


def test_step_model_prices_each_rank_at_its_peak_action():
    """StepModel.evaluate: with two stages per rank the old sum of per-stage peaks counted a backward's transient
    once per stage; the walk counts the one backward that runs, and the stages' terms still add up per rank."""
    from autopar.search.cluster import Cluster, Link
    from autopar.search.cost import Candidate, StepModel
    from autopar.search.profile import ModelProfile, TPProfile

    n = 6
    flops, saved, params = (1e5,) + (4e6,) * 4 + (2e6,), (2e4,) + (1e5,) * 4 + (5e4,), (50_000,) + (120_000,) * 5
    profile = ModelProfile(name="toy", seq_len=32, block_names=tuple(f"b{i}" for i in range(n)), flops=flops,
                           saved_bytes=saved, params=params, boundary_bytes=(8e3,) * (n - 1), shared_params=0,
                           tp={1: TPProfile(1, flops, params, saved, (0.0,) * n, (0,) * n)}, tp_refused={})
    cluster = Cluster(name="toy", source="test", num_devices=2, devices_per_node=2, memory_per_device_gb=1.0,
                      flops_per_s={"fp32": 1e9}, compute_efficiency=1.0, memory_bandwidth_bytes_per_s=1e10,
                      intra_node=Link(1e-5, 1e9), inter_node=Link(1e-4, 1e8), per_action_overhead_s=1e-4)
    e = StepModel(profile, cluster, global_batch_size=8).evaluate(
        Candidate(dp=1, tp=1, pp=2, micro_batch_size=2, num_microbatches=4, schedule="interleaved-1f1b", chunks=2,
                  partition="uniform"))
    for rank in range(2):
        mine = [e.memory_per_stage[s] for s in (rank, rank + 2)]
        assert sum(m.transient > 0 for m in mine) == 1
        assert e.memory_per_rank[rank] == pytest.approx(sum(m.total for m in mine))
