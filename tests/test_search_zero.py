"""The ZeRO level as a dimension of the strategy search (issues 14 and 16): its communication by hand,
a memory-bound model that only fits (or fits fastest) with a zero level, a roomy one that does not
pay for one it does not need, and the levels the runtime refuses never proposed. Pure Python, no ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.config import Strategy, TrainConfig
from autopar.data.tokenizer import padded_vocab_size
from autopar.models import build_model
from autopar.search.cluster import Cluster, Link, cluster_from_dict, preset
from autopar.search.cost import Candidate, StepModel
from autopar.search.memory import stage_memory
from autopar.search.profile import ModelProfile, TPProfile
from autopar.search.search import SearchSpace, enumerate_candidates, exhaustive, mcmc
from autopar.search.zero_cost import data_parallel_cpu_s, data_parallel_exposed_s
from autopar.search.zero_memory import zero_model_state_bytes
from autopar.strategies import resolve


def cluster(memory_bytes: float, flops: float = 1e9) -> Cluster:
    return Cluster(name="toy", source="test", num_devices=4, devices_per_node=4, memory_per_device_gb=memory_bytes / 2**30,
                   flops_per_s={"fp32": flops, "bf16": 2 * flops}, compute_efficiency=1.0, memory_bandwidth_bytes_per_s=1e12,
                   intra_node=Link(1e-5, 1e9), inter_node=Link(1e-4, 1e8), per_action_overhead_s=1e-4)


def heavy_profile(layers: int = 8) -> ModelProfile:
    """Parameters heavy, activations light: the model states decide whether it fits. No tensor parallelism."""
    n = layers + 2
    flops = (1e5,) + (4e6,) * layers + (2e6,)
    saved = (2e3,) + (1e4,) * layers + (5e3,)
    params = (50_000,) + (200_000,) * layers + (1_000,)
    tp1 = TPProfile(1, flops, params, saved, (0.0,) * n, (0,) * n)
    return ModelProfile(name="heavy", seq_len=32, block_names=tuple(f"b{i}" for i in range(n)), flops=flops,
                        saved_bytes=saved, params=params, boundary_bytes=(8e2,) * (n - 1), shared_params=0,
                        tp={1: tp1}, tp_refused={2: "made up", 4: "made up"})


def test_zero_communication_by_hand():
    cl = cluster(1e9)
    n, nbytes, lat, bw = 4, 4e6, 1e-5, 1e9
    ring = 3 * lat + 3 / 4 * nbytes / bw  # reduce-scatter or all-gather of 4 MB over 4 ranks
    args = dict(dp=n, span=n, param_elements=1e6, element_bytes=4.0, overlap_s=0.0)
    assert data_parallel_exposed_s(cl, zero=0, **args) == pytest.approx(2 * ring)  # the all-reduce
    assert data_parallel_exposed_s(cl, zero=1, **args) == pytest.approx(2 * ring)  # reduce-scatter + all-gather
    # zero 2 in the data-parallel engine reduces each of 3 micro-batches; the pipeline engine once per step
    assert data_parallel_exposed_s(cl, zero=2, num_microbatches=3, per_micro_batch=True, **args) == \
        pytest.approx(4 * ring)
    assert data_parallel_exposed_s(cl, zero=2, num_microbatches=3, per_micro_batch=False, **args) == \
        pytest.approx(2 * ring)
    # the reduce-scatter hides behind a long backward; the all-gather after the step cannot
    hidden = dict(args, overlap_s=1.0)
    assert data_parallel_exposed_s(cl, zero=1, **hidden) == pytest.approx(2 * ring)  # one bucket: the last shows
    # zero 3: 2 units of 0.5 M parameters gathered in forward and backward, compute too short to hide the second;
    # one reduce-scatter per unit (each pays the ring's latencies)
    blocks = dict(block_params=(5e5, 5e5), block_forward_s=(0.0, 0.0), block_backward_s=(0.0, 0.0))
    half = 3 * lat + 3 / 4 * nbytes / 2 / bw
    assert data_parallel_exposed_s(cl, zero=3, num_microbatches=1, **args, **blocks) == \
        pytest.approx(2 * half + 4 * half)
    slow = dict(blocks, block_forward_s=(1.0, 1.0), block_backward_s=(1.0, 1.0))  # prefetch hides the second
    assert data_parallel_exposed_s(cl, zero=3, num_microbatches=2, **args, **slow) == \
        pytest.approx(2 * half + 2 * 2 * half)
    assert data_parallel_exposed_s(cl, zero=1, **dict(args, dp=1)) == 0.0


def test_zero_communication_cpu_by_hand():
    """The CPU the data-parallel collectives take as gloo runs them: zero 1 all-reduces (gloo's reduce-scatter is
    slower) then all-gathers; zero 2 reduce-scatters (an all-reduce's CPU) per micro-batch in the data-parallel
    engine, once with a pipeline, then all-gathers; an all-gather is half an all-reduce."""
    cl = dataclasses.replace(cluster(1e9), allreduce_cpu_table={4: Link(1e-4, 1e9)})
    whole = (6 * 1e-4 + 6 / 4 * 4e6 / 1e9) * 1  # one all-reduce of 4 MB over 4 ranks, CPU summed over them
    args = dict(dp=4, nbytes=4e6)
    assert data_parallel_cpu_s(cl, zero=0, **args) == pytest.approx(whole)
    assert data_parallel_cpu_s(cl, zero=1, num_microbatches=3, per_micro_batch=True, **args) == \
        pytest.approx(1.5 * whole)
    assert data_parallel_cpu_s(cl, zero=2, num_microbatches=3, per_micro_batch=True, **args) == \
        pytest.approx(3.5 * whole)
    assert data_parallel_cpu_s(cl, zero=2, num_microbatches=3, per_micro_batch=False, **args) == \
        pytest.approx(1.5 * whole)
    assert data_parallel_cpu_s(cl, zero=2, **dict(args, dp=1)) == 0.0
    # zero 3: per FSDP2 unit, a reduce-scatter (an all-reduce's CPU) and each micro-batch's two all-gathers (half
    # one each); two units of 1 and 3 MB pay the fixed cost twice, one unit of 4 MB once
    unit = lambda b: 6 * 1e-4 + 6 / 4 * b / 1e9  # noqa: E731
    assert data_parallel_cpu_s(cl, zero=3, num_microbatches=3, unit_bytes=[1e6, 3e6], **args) == \
        pytest.approx(4 * unit(1e6) + 4 * unit(3e6))
    assert data_parallel_cpu_s(cl, zero=3, num_microbatches=3, **args) == pytest.approx(4 * whole)
    # calibrated reduce-scatter and all-gather tables (calibrate_ranks measures them): each in the ring's
    # alpha-beta form, 3 steps and 3/4 of the bytes over 4 ranks
    tables = dataclasses.replace(cl, reduce_scatter_cpu_table={4: Link(5e-4, 2e8)},
                                 all_gather_cpu_table={4: Link(2e-4, 5e8)})
    scatter = 3 * 5e-4 + 3 / 4 * 4e6 / 2e8
    gather = 3 * 2e-4 + 3 / 4 * 4e6 / 5e8
    assert data_parallel_cpu_s(tables, zero=1, **args) == pytest.approx(whole + gather)
    assert data_parallel_cpu_s(tables, zero=1, element_bytes=2.0, **args) == pytest.approx(scatter + gather)  # bf16
    assert data_parallel_cpu_s(tables, zero=2, num_microbatches=3, per_micro_batch=True, **args) == \
        pytest.approx(3 * scatter + gather)
    assert data_parallel_cpu_s(tables, zero=3, num_microbatches=2, **args) == pytest.approx(scatter + 4 * gather)
    assert tables.reduce_scatter_cpu(4e6, 8) == pytest.approx(2 * scatter)  # a larger group: the largest, per rank
    assert cluster_from_dict(tables.to_dict()) == tables


def test_each_level_priced_by_the_collective_it_runs():
    """ZeRO-1/2 reduce-scatter then all-gather, ZeRO-3 all-gathers per unit and reduce-scatters, each at the
    cluster's measured figure for that call where it has one (gloo's are far from the ring's half an all-reduce,
    benchmarks/gloo_collectives.py); ZeRO-1's fp32 gradients are all-reduced on gloo (zero/grads.py)."""
    ar, rs, ag = Link(1e-4, 1e9), Link(4e-4, 2.5e8), Link(2e-4, 5e8)
    measured = dataclasses.replace(cluster(1e9), allreduce_table={4: ar}, reduce_scatter_table={4: rs},
                                   all_gather_table={4: ag})
    nbytes = 4e6
    all_reduce = 6 * ar.latency_s + 6 / 4 * nbytes / ar.bandwidth_bytes_per_s
    scatter = 3 * rs.latency_s + 3 / 4 * nbytes / rs.bandwidth_bytes_per_s
    gather = 3 * ag.latency_s + 3 / 4 * nbytes / ag.bandwidth_bytes_per_s
    assert measured.reduce_scatter(nbytes, 4) == pytest.approx(scatter)
    assert measured.all_gather(nbytes, 4) == pytest.approx(gather)
    assert measured.all_gather(nbytes, 4, span=8) == cluster(1e9).all_gather(nbytes, 4, span=8)  # not measured there
    args = dict(dp=4, span=4, param_elements=1e6, element_bytes=4.0, overlap_s=0.0)
    assert data_parallel_exposed_s(measured, zero=0, **args) == pytest.approx(all_reduce)
    assert data_parallel_exposed_s(measured, zero=2, **args) == pytest.approx(scatter + gather)
    assert data_parallel_exposed_s(measured, zero=3, num_microbatches=2, **args) == pytest.approx(scatter + 4 * gather)
    # zero 1: a reduce-scatter on NCCL (a cluster without CPU cores), an all-reduce on gloo unless bf16 buckets
    assert data_parallel_exposed_s(measured, zero=1, **args) == pytest.approx(scatter + gather)
    gloo = measured.replace(cores_per_node=4.0)
    assert gloo.gloo and not measured.gloo and preset("cpu-local").gloo and not preset("a100-80gb").gloo
    assert data_parallel_exposed_s(gloo, zero=1, **args) == pytest.approx(all_reduce + gather)
    assert data_parallel_exposed_s(gloo, zero=2, **args) == pytest.approx(scatter + gather)
    half = dict(args, element_bytes=2.0, param_elements=2e6)
    assert data_parallel_exposed_s(gloo, zero=1, **half) == pytest.approx(scatter + gather)


def test_measured_slow_zero_collectives_make_zero_cost_more_in_the_step_model():
    """With the ring rule ZeRO-1/2 move what an all-reduce moves, so they cost about zero 0's step; with
    reduce-scatter and all-gather measured 4x slower than the ring says, zero 2 and zero 3 cost more than zero 0,
    and on a gloo cluster zero 1 (an all-reduce) differs from zero 2 (a reduce-scatter)."""
    ring = cluster(1e12, flops=1e12)  # compute too short to hide any collective: the step is the communication
    slow = Link(1e-5, 2.5e8)  # the ring's latency, a quarter of its bandwidth
    measured = ring.replace(allreduce_table={4: ring.intra_node}, reduce_scatter_table={4: slow},
                            all_gather_table={4: slow})

    def step(cl: Cluster, zero: int) -> float:
        model = StepModel(heavy_profile(), cl, global_batch_size=8)
        candidate = Candidate(dp=4, tp=1, pp=1, micro_batch_size=2, num_microbatches=1, zero=zero)
        return model.evaluate(candidate).step_time_s

    assert step(ring, 2) == pytest.approx(step(ring, 0), rel=0.02)
    for zero in (2, 3):
        assert step(measured, zero) > 1.05 * step(measured, 0), f"zero {zero} priced as cheap as zero 0"
    gloo = measured.replace(cores_per_node=4.0)  # 4 ranks on 4 cores: gloo, no time-sharing

    def exposed(zero: int) -> float:
        model = StepModel(heavy_profile(), gloo, global_batch_size=8)
        return model.evaluate(Candidate(dp=4, tp=1, pp=1, micro_batch_size=2, num_microbatches=1,
                                        zero=zero)).parts["dp_exposed_s"]
    assert exposed(1) < exposed(2), "zero 1 on gloo all-reduces; priced as zero 2's reduce-scatter"


def test_clusters_without_the_zero_collective_tables_still_load():
    """A cluster file or cache entry written before reduce-scatter and all-gather were measured loads, priced by
    the ring rule; one with them keeps them through its file form."""
    old = cluster(1e9).to_dict()
    del old["reduce_scatter_table"], old["all_gather_table"]
    loaded = cluster_from_dict(old)
    assert loaded == cluster(1e9) and loaded.reduce_scatter(4e6, 4) == pytest.approx(3e-5 + 3e-3)
    tables = cluster(1e9).replace(reduce_scatter_table={2: Link(1e-4, 3e8)}, all_gather_table={4: Link(2e-4, 5e8)})
    assert cluster_from_dict(tables.to_dict()) == tables


def test_stage_memory_uses_the_zero_formula():
    psi = 1000
    common = dict(param_elements=psi, saved=[0.0], inputs=[0.0], output_bytes=0.0, micro_batch_size=1, in_flight=1,
                  stashed=0, recompute_blocks=0, whole_stage=False, activation_scale=1.0, optimizer="adamw", dp=4,
                  headroom=1.0)
    for zero in range(4):
        for bf16 in (False, True):
            m = stage_memory(**common, zero=zero, bf16_master=bf16, largest_block_params=100)
            states = zero_model_state_bytes(psi, zero=zero, dp=4, optimizer_bytes=8, bf16=bf16)
            # ZeRO-3's sharded gradient exists only after the activations are gone (the end-of-backward count)
            grads = 0.0 if zero == 3 else states.grads
            assert (m.params, m.grads, m.optimizer) == (states.params, grads, states.optimizer)
    assert stage_memory(**common).params == 4 * psi and stage_memory(**common).optimizer == 8 * psi  # zero 0, fp32
    z2 = stage_memory(**common, zero=2)
    assert z2.transient == 4 * psi  # the full fp32 gradient, until the end-of-backward reduction
    # ZeRO-3, no activations: the end of the backward dominates. One micro-batch, per-block units (dp alone):
    # 2 blocks gathered while activations peak; at the end the block's unsharded gradient, its reduce-scatter
    # copy and the shard (psi / 4 x 4 bytes), i.e. 400 + 400 + 1000 = 1800, of which buffers hold 800
    z3 = stage_memory(**common, zero=3, largest_block_params=100)
    assert z3.buffers == 2 * 100 * 4 and z3.grads == 0
    assert z3.transient == 1800 - 800
    # the whole stage as one unit (pp or tp), 4 micro-batches: gathered 4000 and the accumulating unsharded gradient
    # 4000 while activations peak (8000); at the end 4000 + 4000 + 1000 = 9000: the transient adds 1000
    stage = stage_memory(**dict(common, num_microbatches=4), zero=3, largest_block_params=psi, gathered_units=1)
    assert stage.buffers == 8000 and stage.transient == 1000
    assert stage.total == 4 * psi / 4 + 8 * psi / 4 + 9000
    # with activations larger than the end's count, nothing is added
    big = stage_memory(**dict(common, saved=[1e5], num_microbatches=4), zero=3, largest_block_params=psi,
                       gathered_units=1)
    assert big.transient == 1e5 and big.buffers == 8000


def test_memory_bound_model_picks_a_zero_level():
    model = StepModel(heavy_profile(), cluster(13e6), global_batch_size=8)
    result = exhaustive(model, SearchSpace(nproc=4))
    winner = result.ranked[0]
    assert winner.candidate.zero > 0, winner.candidate.describe()
    assert winner.peak_memory <= model.cluster.memory_bytes
    without = exhaustive(model, SearchSpace(nproc=4, zero_levels=(0,)))
    assert not without.ranked or without.ranked[0].step_time_s > winner.step_time_s
    # the same configuration at zero 0 would not fit
    plain = model.evaluate(dataclasses.replace(winner.candidate, zero=0))
    assert not plain.fits


def test_roomy_model_does_not_pay_for_zero():
    # communication-bound (fast compute): ZeRO-3's extra gathers cannot hide behind the blocks' compute.
    # (Where compute hides them, the model rightly finds zero 3 free: its reduce-scatter moves half an all-reduce.)
    model = StepModel(heavy_profile(), cluster(1e9, flops=1e12), global_batch_size=8)
    winner = exhaustive(model, SearchSpace(nproc=4)).ranked[0]
    best_plain = exhaustive(model, SearchSpace(nproc=4, zero_levels=(0,))).ranked[0]
    assert winner.step_time_s <= best_plain.step_time_s
    assert winner.candidate.zero in (0, 1)  # zero 1 moves what zero 0 moves; 2 and 3 cost more here
    for zero in (2, 3):  # the winner's degrees with a costlier level are slower
        c = dataclasses.replace(winner.candidate, zero=zero)
        if zero == 3:
            c = Candidate(dp=4, tp=1, pp=1, micro_batch_size=2, num_microbatches=1, zero=3)
        assert model.evaluate(c).step_time_s > winner.step_time_s


def test_refused_levels_are_never_proposed_and_mcmc_finds_the_zero_winner():
    model = StepModel(heavy_profile(4), cluster(13e6), global_batch_size=4)
    candidates = list(enumerate_candidates(model, SearchSpace(nproc=4)))
    assert {c.zero for c in candidates} == {0, 1, 2, 3}
    assert all(c.dp > 1 for c in candidates if c.zero)
    zero3 = [c for c in candidates if c.zero == 3]  # FSDP2 per stage: not with interleaved chunks or zb-h1
    assert all(c.chunks == 1 and c.schedule != "zb-h1" for c in zero3 if c.pp > 1 or c.tp > 1)
    assert any(c.pp > 1 for c in zero3) and any(c.chunks > 1 or c.schedule == "zb-h1" for c in candidates if c.pp > 1)
    sgd = StepModel(heavy_profile(4), cluster(13e6), global_batch_size=4, optimizer="sgd")
    assert {c.zero for c in enumerate_candidates(sgd, SearchSpace(nproc=4))} == {0}  # no state to shard
    space = SearchSpace(nproc=4, schedules=("1f1b",), chunks=(1,), recompute=("none",))
    best = exhaustive(model, space).ranked[0]
    found, _ = mcmc(model, space, steps=1500, seed=0)
    assert found is not None and found.step_time_s <= best.step_time_s * (1 + 1e-12)


def test_strategy_auto_with_a_fixed_zero_level_searches_the_rest():
    model, _ = build_model("gpt-tiny", {"n_layer": 2}, vocab_size=padded_vocab_size(258), device="meta")
    example = lambda: ((torch.zeros(1, 32, dtype=torch.long, device="meta"),), {})  # noqa: E731
    resolved = resolve(Strategy.auto(zero=1), TrainConfig(global_batch_size=8), 4, model=model, example=example)
    assert resolved.strategy.replicas.zero == 1 and resolved.strategy.dp > 1  # zero 1 needs replicas to shard over
    assert resolved.plan.record["strategy"]["zero"] == 1 and resolved.plan.record["search"]["fixed"] == {"zero": 1}
    assert "zero 1" in resolved.plan.describe()


def test_precision_modes_set_the_model_state_bytes():
    c = Candidate(dp=4, tp=1, pp=1, micro_batch_size=2, num_microbatches=1)
    psi = sum(heavy_profile().params)
    states = {}
    for dtype in ("fp32", "bf16", "bf16-autocast"):  # autocast keeps fp32 parameters; bf16 adds fp32 masters
        memory = StepModel(heavy_profile(), cluster(1e9), global_batch_size=8, dtype=dtype).evaluate(c).memory_per_stage[0]
        states[dtype] = (memory.params + memory.grads + memory.optimizer) / psi
    assert states == {"fp32": 16.0, "bf16": 20.0, "bf16-autocast": 16.0}
