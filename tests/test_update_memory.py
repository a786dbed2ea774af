"""The memory model's update phase and the pipeline stage's transient, by hand (search/update_memory.py, cost.py).

Measured per phase with search/live_memory.py on gpt-small (2 of its layers, 8 x 64 tokens): dp=4 ZeRO-1 peaked
at its model state + the all-gathered parameters (232.1 MiB, the activation walk said 197.7); a pipeline stage
holding only the embeddings peaked in clipping's float64 copy of the position table (27.8 MiB, walk 22.7); under
--dtype bf16 a whole bucket's fp32 gradient is squared in float64 (198 MiB on 13M elements). Pure Python."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.search.cluster import Cluster, Link
from autopar.search.cost import Candidate, StepModel
from autopar.search.measure_profile import BlockCosts
from autopar.search.profile import Crossing, ModelProfile, TPProfile
from autopar.search.update_memory import BUCKET_BYTES, CLIP_BYTES_PER_ELEMENT, update_bytes

PSI = 10_000_000  # parameters of a stage: more than one fp32 bucket (25 MiB = 6.55 M elements)
CAP = BUCKET_BYTES / 4


@pytest.mark.parametrize("case, want", [
    # (zero, dp, tp, pipelined, bf16, clip) -> bytes beyond the model state
    ((0, 4, 1, False, False, True), 0.0),  # data-parallel engine, replicated: torch's per-tensor norms, no copies
    ((0, 1, 1, True, False, True), CLIP_BYTES_PER_ELEMENT * 2e6),  # pipeline engine: the largest gradient, float64
    ((1, 4, 1, False, False, True), 4.0 * PSI),  # ZeRO-1: the all-gather's output (clipping: 16 x CAP / 4 is less)
    ((1, 4, 1, False, False, False), 4.0 * PSI),
    ((2, 2, 1, True, False, True), max(4.0 * PSI, CLIP_BYTES_PER_ELEMENT * CAP / 2)),
    ((1, 2, 2, True, False, True), 4.0 * PSI),  # under tp one piece is squared at a time: at most the largest
    ((3, 4, 1, False, False, True), CLIP_BYTES_PER_ELEMENT * 2e6 / 4),  # FSDP2: the largest gradient shard
    ((0, 4, 1, False, True, True), CLIP_BYTES_PER_ELEMENT * PSI),  # bf16: the whole stage, in one bf16 bucket
    ((0, 4, 1, False, True, False), 2.0 * PSI),  # bf16 without clipping: the masters cast back to bf16
    ((1, 2, 1, False, True, False), 2.0 * PSI + 2.0 * PSI / 2),  # bf16 ZeRO-1: the gather and each shard's cast
])
def test_update_bytes_by_engine_and_level(case, want):
    zero, dp, tp, pipelined, bf16, clip = case
    got = update_bytes(PSI, 2e6, zero=zero, dp=dp, tp=tp, pipelined=pipelined, bf16_master=bf16, clip=clip)
    assert got == pytest.approx(want)


def _cluster() -> Cluster:
    return Cluster(name="toy", source="test", num_devices=4, devices_per_node=4, memory_per_device_gb=64.0,
                   flops_per_s={"fp32": 1e9, "bf16": 2e9}, compute_efficiency=1.0, memory_bandwidth_bytes_per_s=1e10,
                   intra_node=Link(1e-5, 1e9), inter_node=Link(1e-4, 1e8), per_action_overhead_s=1e-4,
                   memory_headroom=1.0)


def _profile(measured=None, saved=(1e3,) * 4) -> ModelProfile:
    n = 4
    flops = (1e5,) * n
    params, largest = (1_000_000, 3_000_000, 3_000_000, 1_000), (800_000, 1_000_000, 1_000_000, 1_000)
    tp1 = TPProfile(1, flops, params, saved, (0.0,) * n, (0,) * n, largest)
    return ModelProfile(name="toy", seq_len=8, block_names=tuple(f"b{i}" for i in range(n)), flops=flops,
                        saved_bytes=saved, params=params, boundary_bytes=(4e3,) * (n - 1), shared_params=0,
                        crossings=(Crossing(4e3, 0.0, 4e3, 0.0),) * (n - 1), tp={1: tp1}, measured=measured)


def test_zero1_peak_is_the_update_when_activations_are_small():
    """dp=4 ZeRO-1, tiny activations: the rank's peak is its model state + every parameter all-gathered."""
    psi = 7_001_000
    e = StepModel(_profile(), _cluster(), global_batch_size=4).evaluate(
        Candidate(dp=4, tp=1, pp=1, micro_batch_size=1, num_microbatches=1, zero=1))
    stage = e.memory_per_stage[0]
    assert (stage.activations, stage.transient, stage.update) == (0.0, 0.0, pytest.approx(4.0 * psi))
    state = (4 + (4 + 4 / 4) + 12 / 4) * psi  # parameters, full + shard gradient, masters and AdamW's moments
    assert e.memory_per_rank[0] == pytest.approx(state + 4.0 * psi)


def test_a_pipeline_stage_of_embeddings_peaks_in_clipping():
    """pp=4, one block each: the first stage's largest gradient (800 k elements) is squared in float64 after its
    backward; without clipping (--grad-clip 0) the walk's peak stays."""
    c = Candidate(dp=1, tp=1, pp=4, micro_batch_size=1, num_microbatches=1, partition="uniform")
    clipped = StepModel(_profile(), _cluster(), global_batch_size=1).evaluate(c)
    assert clipped.memory_per_stage[0].update == pytest.approx(CLIP_BYTES_PER_ELEMENT * 800_000)
    assert clipped.memory_per_rank[0] == pytest.approx(16 * 1_000_000 + CLIP_BYTES_PER_ELEMENT * 800_000)
    plain = StepModel(_profile(), _cluster(), global_batch_size=1, clip_gradients=False).evaluate(c)
    assert plain.memory_per_stage[0].update == 0.0 and plain.memory_per_rank[0] < clipped.memory_per_rank[0]


def test_a_stage_with_a_successor_prices_its_output_and_its_gradient_once():
    """The measured transient of a block holds its own output and output gradient through its backward; a stage
    that sends its output and receives that gradient counts both as buffers, so its last block's transient
    leaves them out (hf:llama pp=4: stage 0 read +11.7% over its peak). The last stage sends nothing: all kept.
    An earlier block's backward runs after the later blocks freed their activations (hf:llama dp=4 pp=2's first
    stage of three blocks: +10.9%, now +7.4%)."""
    block = BlockCosts(forward_fixed_s=1e-3, forward_per_seq_s=1e-3, backward_fixed_s=2e-3, backward_per_seq_s=2e-3,
                       saved_per_seq=1e3, transient_fixed=0.0, transient_per_seq=5e4)
    # the first stage's first block works as much, but the second's activations (4e4 per sequence) are freed by
    # then, which the walk still counts: the stage's working set is the larger of 1e5 - 8e4 and 1e5 - 1.6e4
    profile = _profile(measured=(block,) * 4, saved=(1e3, 4e4, 1e3, 1e3))
    e = StepModel(profile, _cluster(), global_batch_size=2, clip_gradients=False).evaluate(
        Candidate(dp=1, tp=1, pp=2, micro_batch_size=2, num_microbatches=1, partition="uniform"))
    assert e.bounds == (0, 2, 4)
    first, last = e.memory_per_stage
    assert first.transient == pytest.approx(2 * 5e4 - 2 * (4e3 + 4e3))
    assert last.transient == pytest.approx(2 * 5e4)


def test_sequence_parallel_head_keeps_its_whole_activations_and_its_gathered_input():
    """Under --sp a split layer keeps 1/tp of its activations, but the head all-gathers its input to the whole
    sequence and keeps it: its block is priced whole plus that input (gpt-small tp=2 pp=4, last stage: 8.7 and
    15.0 MiB measured at micro-batch 8 and 16; 1/tp priced 6.4 and 10.2)."""
    from autopar.search.dimensions import dimension_profile
    n, tp = 4, 2
    flops, saved, params = (1e5,) * n, (1e3, 3.4e4, 3.4e4, 6e3), (1000,) * n
    split = tuple(s * (10 + 24 / tp) / 34 for s in saved)
    tp2 = TPProfile(tp, flops, params, split, (1e3,) * n, (0, 2, 2, 1), (500,) * n)
    profile = ModelProfile(name="toy", seq_len=8, block_names=tuple(f"b{i}" for i in range(n)), flops=flops,
                           saved_bytes=saved, params=params, boundary_bytes=(4e3, 4e3, 2e3), shared_params=0,
                           tp={1: TPProfile(1, flops, params, saved, (0.0,) * n, (0,) * n), tp: tp2})
    c = Candidate(dp=1, tp=tp, pp=2, micro_batch_size=1, num_microbatches=1, sp=True)
    got = dimension_profile(profile, _cluster(), c, 1e9).tp[tp].saved_bytes
    assert got[1:3] == pytest.approx((3.4e4 / tp,) * 2)  # a layer: all / tp
    assert got[3] == pytest.approx(6e3 + 2e3)  # the head: whole, and its gathered input
    # its measured transient is its own, not scaled up with those bytes (a tp share is at most 1)
    block = BlockCosts(forward_fixed_s=1e-3, forward_per_seq_s=1e-3, backward_fixed_s=2e-3, backward_per_seq_s=2e-3,
                       saved_per_seq=6e3, transient_fixed=0.0, transient_per_seq=5e3)
    measured = dataclasses.replace(profile, measured=(block,) * n, crossings=())
    e = StepModel(measured, _cluster(), global_batch_size=1, clip_gradients=False).evaluate(
        dataclasses.replace(c, partition="uniform"))
    assert e.memory_per_stage[1].transient == pytest.approx(5e3)


def test_memory_gate_counts_the_update_exactly_in_its_low_figure():
    """The gate's low figure halves only the traced activations; the update's temporaries are exact bytes."""
    from autopar.search.memory_fit import RankFigures
    update_peak = RankFigures(rank=0, stages=(0,), pieces={"params": 100.0, "grads": 100.0, "update": 400.0},
                              total=600.0)
    assert update_peak.low == pytest.approx(600.0)
    walk_peak = RankFigures(rank=0, stages=(0,), pieces={"params": 100.0, "grads": 100.0, "activations": 400.0},
                            total=600.0)
    assert walk_peak.low == pytest.approx(400.0)
