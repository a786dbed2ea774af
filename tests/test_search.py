"""The strategy search: cluster costs, the bubble, the memory pieces, the search against brute force,
MCMC against exhaustive enumeration, refusals of bad cluster files and impossible memory limits."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest

from autopar.config import Strategy
from autopar.errors import ConfigError
from autopar.pipeline.schedules import build_schedule
from autopar.search.cluster import Cluster, Link, cluster_from_dict, preset, resolve_cluster
from autopar.search.cost import PARTITIONS, RECOMPUTE, SPLIT_OVERHEAD, SPLIT_SCHEDULES, Candidate, StepModel
from autopar.search.memory import stage_memory
from autopar.search.profile import ModelProfile, TPProfile
from autopar.search.search import (SearchSpace, enumerate_candidates, enumerate_mcmc_space, exhaustive, mcmc,
                                   require_fit, why)
from autopar.search.timeline import StageCosts, pipeline_times, simulated


def toy_cluster(**changes) -> Cluster:
    base = Cluster(name="toy", source="test", num_devices=4, devices_per_node=2, memory_per_device_gb=1.0,
                   flops_per_s={"fp32": 1e9}, compute_efficiency=1.0, memory_bandwidth_bytes_per_s=1e10,
                   intra_node=Link(1e-5, 1e9), inter_node=Link(1e-4, 1e8), per_action_overhead_s=1e-4)
    return base.replace(**changes)


def toy_profile(layers: int = 4) -> ModelProfile:
    """A made-up transformer: an embedding, `layers` equal layers, a head; tp=2 halves the layers' work."""
    n = layers + 2
    flops = (1e5,) + (4e6,) * layers + (2e6,)
    saved = (2e4,) + (1e5,) * layers + (5e4,)
    params = (50_000,) + (120_000,) * layers + (1_000,)
    tp1 = TPProfile(1, flops, params, saved, (0.0,) * n, (0,) * n)
    tp2 = TPProfile(2, (1e5,) + (2e6,) * layers + (1e6,), (25_000,) + (60_000,) * layers + (1_000,),
                    (2e4,) + (6e4,) * layers + (5e4,), (8e3,) + (1.6e4,) * layers + (0.0,), (1,) + (2,) * layers + (0,))
    return ModelProfile(name="toy", seq_len=32, block_names=tuple(f"b{i}" for i in range(n)), flops=flops,
                        saved_bytes=saved, params=params, boundary_bytes=(8e3,) * (n - 1), shared_params=0,
                        tp={1: tp1, 2: tp2}, tp_refused={4: "made up"})


# ----------------------------------------------------------------------------- cluster


def test_all_reduce_cost_by_hand():
    c = toy_cluster()
    # ring over 2 ranks inside a node: 2 (n-1) alpha + 2 (n-1)/n S / beta
    assert c.all_reduce(1e6, 2) == pytest.approx(2 * 1e-5 + 1.0 * 1e6 / 1e9)
    # 4 ranks span two nodes of 2: the inter-node link
    assert c.all_reduce(1e6, 4) == pytest.approx(6 * 1e-4 + 1.5 * 1e6 / 1e8)
    assert c.all_gather(1e6, 4) == pytest.approx(3 * 1e-4 + 0.75 * 1e6 / 1e8)
    assert c.p2p(1e6, inter_node=False) == pytest.approx(1e-5 + 1e-3)
    assert c.all_reduce(1e6, 1) == 0.0  # exact: a group of one sends nothing (defined as zero)
    measured = c.replace(allreduce_table={2: Link(3e-5, 2e9)})
    assert measured.all_reduce(1e6, 2) == pytest.approx(2 * 3e-5 + 1e6 / 2e9)


def test_presets_say_where_their_figures_come_from():
    for name in ("v100-16gb-nvlink", "a100-40gb", "a100-80gb", "h100-80gb", "rtx3090-24gb-pcie"):
        c = preset(name)
        assert "datasheet" in c.source and c.memory_per_device_gb in (16, 24, 40, 80)
    assert "calibrate" in preset("cpu-local").source
    assert resolve_cluster("a100-80gb", nproc=64).num_devices == 64
    # a cluster survives its own TOML form
    import tomllib
    again = cluster_from_dict(tomllib.loads(preset("h100-80gb").to_toml()))
    assert again == preset("h100-80gb")


@pytest.mark.parametrize("change, field", [
    (lambda d: d.pop("memory_per_device_gb"), "memory_per_device_gb"),
    (lambda d: d["intra_node"].update(bandwidth_bytes_per_s=-1), "intra_node.bandwidth_bytes_per_s"),
    (lambda d: d.update(devices_per_node=128), "devices_per_node"),
    (lambda d: d.update(compute_efficiency=1.5), "compute_efficiency"),
    (lambda d: d["flops_per_s"].update(fp32="fast"), "flops_per_s.fp32"),
    (lambda d: d.pop("inter_node"), "inter_node"),
    (lambda d: d.update(num_devices=3.5), "num_devices"),
])
def test_bad_cluster_files_are_refused_with_the_field_named(tmp_path, change, field):
    data = json.loads(json.dumps(preset("a100-40gb").to_dict()))
    change(data)
    import tomli_w
    path = tmp_path / "bad.toml"
    path.write_text(tomli_w.dumps(data))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        resolve_cluster(str(path))


# ----------------------------------------------------------------------------- timeline


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_matches_the_textbook_formula(schedule):
    pp, m, f, b = 4, 8, 1.0, 2.0
    costs = StageCosts((f,) * pp, (b,) * pp, (f,) * pp, (0.0,) * pp, (0.0,) * pp)
    times = pipeline_times(schedule, pp=pp, chunks=1, num_microbatches=m, recompute=frozenset(), costs=costs)
    assert times.makespan == pytest.approx((m + pp - 1) * (f + b))
    assert times.bubble == pytest.approx((pp - 1) / (m + pp - 1))
    expected = [m] * pp if schedule == "gpipe" else [pp - s for s in range(pp)]
    assert list(times.in_flight) == expected


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved-1f1b", 2),
                                              ("eager-1f1b", 1)])
def test_extrapolated_timeline_equals_full_simulation(schedule, chunks):
    pp = 3
    s = pp * chunks
    costs = StageCosts(tuple(1 + 0.2 * i for i in range(s)), tuple(2 + 0.5 * i for i in range(s)), (1.0,) * s,
                       (0.1,) * s, (0.15,) * s, tuple(1.3 + 0.1 * i for i in range(s)), (0.9,) * s)
    full = pipeline_times(schedule, pp=pp, chunks=chunks, num_microbatches=24, recompute=frozenset(), costs=costs,
                          limit=10**9)
    short = pipeline_times(schedule, pp=pp, chunks=chunks, num_microbatches=24, recompute=frozenset(), costs=costs,
                           limit=1)
    assert short.makespan == pytest.approx(full.makespan, rel=1e-9)
    assert short.in_flight == full.in_flight and short.busy == pytest.approx(full.busy)
    assert short.split_held == full.split_held
    # the compiled sweep equals the simulator itself, I and W priced apart included
    sim = simulated(schedule, pp, chunks, 24, frozenset(), costs)
    assert full.makespan == pytest.approx(sim.makespan) and full.busy == pytest.approx(sim.busy)
    assert full.split_held == sim.split_held and any(sim.split_held) == (schedule in SPLIT_SCHEDULES)


def test_schedules_with_an_input_weight_split_are_the_ones_the_cost_model_splits():
    from autopar.pipeline.actions import Op
    from autopar.pipeline.schedules import SCHEDULES
    for name in SCHEDULES:
        try:
            lists = build_schedule(name, pp=2, num_microbatches=4, chunks=2 if name in ("interleaved-1f1b", "zbv")
                                   else 1)
        except ConfigError:
            continue
        splits = any(a.op == Op.BACKWARD_INPUT for acts in lists.values() for a in acts)
        assert splits == (name in SPLIT_SCHEDULES), name


def test_zero_bubble_prices_input_and_weight_halves_by_hand():
    """zb-h1's I and W are the measured halves (+ the per-action overhead each), not half a backward each; the
    first stage (token ids in: no input gradient) has an empty I and its W is the whole backward; each rank is
    busy m(F + I + W). From FLOPs, W is the weight ops' FLOPs and I the rest of 2x forward, both
    x (1 + SPLIT_OVERHEAD)."""
    from autopar.search.measure_profile import BlockCosts
    profile = toy_profile(layers=4)
    n = profile.num_blocks
    block = BlockCosts(forward_fixed_s=1e-3, forward_per_seq_s=1e-3, backward_fixed_s=2e-3, backward_per_seq_s=2e-3,
                       saved_per_seq=1e4, transient_fixed=0.0, transient_per_seq=0.0, input_fixed_s=2e-3,
                       input_per_seq_s=1.5e-3, weight_fixed_s=1e-3, weight_per_seq_s=1e-3, held_per_seq=3e3,
                       split_transient_fixed=0.0, split_transient_per_seq=0.0)
    measured = dataclasses.replace(profile, measured=(block,) * n, boundary_bytes=(0.0,) * (n - 1))
    cluster = toy_cluster(intra_node=Link(0.0, 1e15), inter_node=Link(0.0, 1e15), num_devices=2, devices_per_node=2)
    model = StepModel(measured, cluster, global_batch_size=8)
    pp, mbs, m, overhead = 2, 2, 4, cluster.per_action_overhead_s
    e = model.evaluate(Candidate(dp=1, tp=1, pp=pp, micro_batch_size=mbs, num_microbatches=m, schedule="zb-h1",
                                 partition="uniform"))
    assert e.bounds == (0, 3, 6)
    per_stage = 3  # blocks
    f = per_stage * (1e-3 + mbs * 1e-3) + overhead
    i = per_stage * (2e-3 + mbs * 1.5e-3) + overhead
    w = per_stage * (1e-3 + mbs * 1e-3) + overhead
    whole = per_stage * (2e-3 + mbs * 2e-3) + overhead  # the first stage's W: its fused backward
    costs = model.stage_costs(e.candidate, [(0, 3), (3, 6)], (0, 0))
    assert costs.backward_input == pytest.approx((overhead, i)) and costs.backward_weight == pytest.approx((whole, w))
    # busy per rank (rel 1e-3: stage costs rounded to 3 digits, timeline.normalised)
    assert e.parts["busy_s"] == pytest.approx(m * max(f + overhead + whole, f + i + w), rel=1e-3)
    # memory: at pp=2 the last stage's W follows its I at once: one micro-batch's held gradients; none on the first
    assert [s.weight_pending for s in e.memory_per_stage] == pytest.approx([0.0, per_stage * 3e3 * mbs])
    one = model.evaluate(Candidate(dp=1, tp=1, pp=pp, micro_batch_size=mbs, num_microbatches=m, schedule="1f1b",
                                   partition="uniform"))
    assert all(s.weight_pending == 0 for s in one.memory_per_stage)
    # from FLOPs: W = the weight ops' FLOPs at the rate, I = 2x forward - W, both x (1 + overhead)
    flops = dataclasses.replace(profile, weight_flops=tuple(0.75 * x for x in profile.flops))
    inputs, weights = StepModel(flops, toy_cluster(), global_batch_size=8).block_split_times(1, mbs)
    rate = toy_cluster().rate("fp32")
    assert weights == pytest.approx([0.75 * x * mbs / rate * (1 + SPLIT_OVERHEAD) for x in profile.flops])
    assert inputs == pytest.approx([1.25 * x * mbs / rate * (1 + SPLIT_OVERHEAD) for x in profile.flops])


# ----------------------------------------------------------------------------- memory


def test_memory_pieces_by_hand():
    saved, inputs = [100.0, 200.0, 300.0], [10.0, 20.0, 30.0]
    m = stage_memory(param_elements=1000, saved=saved, inputs=inputs, output_bytes=40.0, micro_batch_size=2,
                     in_flight=3, stashed=0, recompute_blocks=1, whole_stage=False, activation_scale=1.0,
                     optimizer="adamw", dp=2, headroom=1.5)
    assert (m.params, m.grads, m.optimizer) == (4000, 4000, 8000)
    assert m.activations == 3 * (10 + 200 + 300) * 2  # block 0 recomputed: only its input kept
    assert m.stashed_inputs == 3 * 10 * 2
    assert m.transient == (300 + 100) * 2  # gradients of the largest block + the rebuilt block
    # one micro-batch: its activation sent and its gradient coming in; data-parallel buckets are the gradients
    assert m.buffers == 2 * 40 * 2
    assert m.total == pytest.approx(1.5 * (4000 + 4000 + 8000 + 3060 + 60 + 800 + 160))
    # 8 micro-batches, 3 in flight: every sent tensor is kept to the step's end (p2p.wait_sends), so at the last
    # forward 8 activations out (+ 1 gradient in) and the input gradients of the 5 backwards already done
    eight = stage_memory(param_elements=1000, saved=saved, inputs=inputs, output_bytes=40.0, micro_batch_size=2,
                         in_flight=3, stashed=0, recompute_blocks=1, whole_stage=False, activation_scale=1.0,
                         optimizer="adamw", dp=2, headroom=1.5, num_microbatches=8)
    assert eight.buffers == (8 + 1) * 40 * 2 + 5 * 10 * 2
    whole = stage_memory(param_elements=0, saved=saved, inputs=inputs, output_bytes=0.0, micro_batch_size=1,
                         in_flight=1, stashed=4, recompute_blocks=0, whole_stage=True, activation_scale=0.5,
                         optimizer="sgd", dp=1, headroom=1.0)
    assert whole.activations == 600 * 0.5 and whole.stashed_inputs == 4 * 10 * 0.5 and whole.optimizer == 0
    # whole-stage recomputation with 6 micro-batches: one rebuilt at a time (in_flight 1), but the warm-up still
    # ran 4 forwards before the first backward (stashed 4), so 6 - 4 = 2 input gradients were sent before the
    # last forward (not 6 - 1 = 5)
    six = stage_memory(param_elements=0, saved=saved, inputs=inputs, output_bytes=40.0, micro_batch_size=1,
                       in_flight=1, stashed=4, recompute_blocks=0, whole_stage=True, activation_scale=1.0,
                       optimizer="sgd", dp=1, headroom=1.0, num_microbatches=6)
    assert six.buffers == (6 + 1) * 40 + 2 * 10


# ----------------------------------------------------------------------------- search


def _brute_force(model: StepModel, nproc: int):
    """Every raw combination of values, invalid ones skipped by what the runtime would refuse."""
    best = None
    g = model.global_batch_size
    for dp, tp, pp, mbs, schedule, chunks, rc, method, zero in itertools.product(
            range(1, nproc + 1), (1, 2, 4), range(1, nproc + 1), range(1, g + 1),
            ("gpipe", "1f1b", "interleaved-1f1b", "eager-1f1b", "zb-h1"), (1, 2), RECOMPUTE, PARTITIONS, range(4)):
        if dp * tp * pp != nproc or g % (dp * mbs) or tp not in model.profile.tp or pp * chunks > 6:
            continue
        if zero and dp == 1 or zero == 3 and (tp > 1 or pp > 1):  # strategies.py refuses these
            continue
        m = g // (dp * mbs)
        if pp == 1 and (schedule, chunks) != ("1f1b", 1):
            continue
        try:
            build_schedule(schedule, pp=pp, num_microbatches=m, chunks=chunks)
        except ConfigError:
            continue
        e = model.evaluate(Candidate(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=m,
                                     schedule=schedule, chunks=chunks, recompute=rc, partition=method, zero=zero))
        if e.fits and (best is None or e.step_time_s < best.step_time_s):
            best = e
    return best


def test_search_pick_is_the_brute_force_optimum_of_its_cost_model():
    model = StepModel(toy_profile(), toy_cluster(memory_per_device_gb=4.5e6 / 2**30), global_batch_size=8)
    result = exhaustive(model, SearchSpace(nproc=4))
    best = _brute_force(model, 4)
    assert result.pruned > 0  # the memory limit bites, so pruning is exercised
    assert result.ranked[0].step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    assert result.ranked[0].peak_memory <= model.cluster.memory_bytes
    assert all(e.fits for e in result.ranked)
    sentence = why(result.ranked[0], result.ranked[1])
    assert "faster than the runner-up" in sentence


def test_mcmc_reaches_the_exhaustive_optimum_of_its_space():
    model = StepModel(toy_profile(3), toy_cluster(memory_per_device_gb=4.5e6 / 2**30), global_batch_size=4)
    space = SearchSpace(nproc=2, schedules=("gpipe", "1f1b"), chunks=(1,))
    oracle = exhaustive(model, space, list(enumerate_mcmc_space(model, space)))
    assert oracle.evaluated > 100
    found, states = mcmc(model, space, steps=3000, seed=0)
    assert found is not None and states < oracle.evaluated * 2
    assert found.step_time_s == pytest.approx(oracle.ranked[0].step_time_s, rel=1e-12)


def test_impossible_memory_limit_names_the_smallest_that_works():
    profile = toy_profile()
    model = StepModel(profile, toy_cluster(memory_per_device_gb=0.001), global_batch_size=8)
    result = exhaustive(model, SearchSpace(nproc=4))
    with pytest.raises(ConfigError, match=r"smallest memory per device that works is [0-9.e-]+ GiB") as err:
        require_fit(result, model)
    need = float(str(err.value).split("works is ")[1].split(" GiB")[0])
    roomy = StepModel(profile, toy_cluster(memory_per_device_gb=need * 1.001), global_batch_size=8)
    assert exhaustive(roomy, SearchSpace(nproc=4)).ranked  # that much memory does fit


def test_enumeration_respects_tp_within_node_and_planner_refusals():
    model = StepModel(toy_profile(), toy_cluster(), global_batch_size=8)
    cands = list(enumerate_candidates(model, SearchSpace(nproc=4)))
    assert {c.tp for c in cands} == {1, 2}  # 4 is refused by the "planner", and exceeds a node of 2
    assert all(c.dp * c.tp * c.pp == 4 and c.dp * c.micro_batch_size * c.num_microbatches == 8 for c in cands)


# ----------------------------------------------------------------------------- real model, CLI


def test_plan_auto_json_is_a_strategy(capsys):
    from autopar.cli import main
    code = main(["plan", "--auto", "--model", "gpt-tiny", "--nproc", "2", "--seq-len", "32", "--global-batch-size",
                 "4", "--json", "--top", "2"])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    strategy = Strategy(**plan["strategy"]).resolved(2)
    assert strategy.dp * strategy.tp * strategy.pp == 2
    train = plan["train"]
    assert train["global_batch_size"] == strategy.dp * train["micro_batch_size"] * train["micro_batches"]
    assert plan["prediction"]["step_time_s"] > 0  # --top 2: the other plan; the searched best too when the default runs
    # --top 2 less the plan that runs (the searched best is listed when the default runs); the default layout is
    # never an alternative, so where it ranked second there is one fewer
    alternatives, runs_default = plan["alternatives"], plan["decision"]["runs"] == "default"
    assert (1 if runs_default else 0) <= len(alternatives) <= (2 if runs_default else 1)
    default_plan = (plan["default_layout"]["strategy"], plan["default_layout"]["train"])
    assert all((a["strategy"], a["train"]) != default_plan for a in alternatives)
    assert math.isfinite(plan["prediction"]["bubble_fraction"])
    assert plan["search"]["costs"].startswith("block times and activation bytes measured")  # cpu-local: measured
    default = plan["default_layout"]  # 4 sequences over dp=2: the whole per-replica batch (2) is its micro-batch
    assert default["runnable"] and default["strategy"]["dp"] == 2 and default["train"]["micro_batch_size"] == 2
    assert plan["decision"]["runs"] in ("search", "default") and plan["search"]["collapsed_equivalent"] >= 0


def test_profile_scaled_from_two_layers_equals_a_full_trace():
    from autopar.search.profile import profile_model
    full = profile_model("gpt-tiny", seq_len=32, tp_degrees=(1, 2), model_args={"n_layer": 3})
    scaled = profile_model("gpt-tiny", seq_len=32, tp_degrees=(1, 2), layers=3)
    for name in ("flops", "saved_bytes", "params", "boundary_bytes", "shared_params", "shared_blocks", "ops"):
        assert getattr(scaled, name) == pytest.approx(getattr(full, name)), name
    assert full.ops[1] > 5  # a layer's traced ops (each pays a dispatch, search/tp_fixed.py)
    assert scaled.tp[2].allreduce_bytes == pytest.approx(full.tp[2].allreduce_bytes)
    from autopar.data import build_tokenizer, padded_vocab_size
    from autopar.models import build_model
    model, info = build_model("gpt-tiny", {"n_layer": 3}, vocab_size=padded_vocab_size(build_tokenizer("byte").vocab_size))
    assert full.num_params == info.num_params  # a tied weight counted once, where first used
    # each block's largest parameter on one rank (clipping's float64 copy, search/update_memory.py)
    assert scaled.tp[2].largest_params == full.tp[2].largest_params
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    whole, split = full.tp[1].largest_params, full.tp[2].largest_params
    assert whole[0] == max(v for n, v in sizes.items() if n.endswith("emb.weight"))
    assert whole[1] == max(v for n, v in sizes.items() if n.startswith("blocks.0."))
    assert whole[1] // 2 <= split[1] < whole[1]  # its largest weight split in two (or a replicated one, if larger)


def test_calibrate_measures_gloo_links_on_two_ranks():
    from autopar.search.calibrate import measure_links
    links = measure_links(2, per_rank=True)
    assert links["p2p"]["bandwidth_bytes_per_s"] > 0 and links["p2p"]["latency_s"] >= 0
    # --per-rank: each rank's own matmul rate and the link of every pair (a mixed cluster's [[devices]], [[links]])
    assert len(links["rank_rates"]) == 2 and min(links["rank_rates"]) > 0
    assert set(links["pair_links"]) == {"0,1"} and links["pair_links"]["0,1"]["bandwidth_bytes_per_s"] > 0
    assert set(links["allreduce"]) == {"2"} and links["allreduce"]["2"]["bandwidth_bytes_per_s"] > 0
    assert links["aggregate"]["bandwidth_bytes_per_s"] > 0  # both ranks sending at once: the node's total
    for name in ("reduce_scatter", "all_gather", "all_to_all"):  # ZeRO's and ep's collectives, wall time
        assert set(links[name]) == {"2"} and links[name]["2"]["bandwidth_bytes_per_s"] > 0
    # the CPU they take (time-sharing ranks pay it), how many cores two ranks get, and each blocking wait's CPU
    assert set(links["allreduce_cpu"]) == {"2"} and links["allreduce_cpu"]["2"]["bandwidth_bytes_per_s"] > 0
    assert links["p2p_cpu"]["latency_s"] >= 0 and 0 < links["effective_cores"] <= 2 and links["sync_cpu_s"] >= 0
    assert links["reference_step_s"] > 0  # the step model's level: a small GPT's step (search/reference_step.py)
    # scaled to a quiet machine by the cores other jobs took meanwhile (machine_load.py): never slower than measured
    assert links["reference_step_s"] <= links["reference_step_measured_s"] * (1 + 1e-9)
    assert links["reference_others_cores"] >= 0 and links["sharing_others_cores"] >= 0


def test_cost_model_measures_this_machine_only():
    """plan --auto measures block costs where the cluster is this machine; a GPU preset keeps the FLOP model and
    --cost-model measured is refused there with the reason; an unknown cost model is refused."""
    from autopar.errors import ConfigError
    from autopar.search.cluster import resolve_cluster
    from autopar.search.measure_profile import with_cost_model
    from autopar.search.profile import profile_model
    profile = profile_model("gpt-tiny", seq_len=32)
    calls = []

    def measure():
        calls.append(1)
        raise AssertionError("not measured on a GPU preset")
    same, why = with_cost_model(profile, resolve_cluster("a100-80gb"), "auto", measure)
    assert same is profile and "FLOPs" in why and "a100-80gb" in why and not calls
    with pytest.raises(ConfigError, match="cost-model measured.*a100-80gb"):
        with_cost_model(profile, resolve_cluster("a100-80gb"), "measured", measure)
    with pytest.raises(ConfigError, match="cost model must be one of"):
        with_cost_model(profile, resolve_cluster("cpu-local"), "exact", measure)
    assert with_cost_model(profile, resolve_cluster("cpu-local"), "flops", measure)[0] is profile


# ----------------------------------------------------------------------------- time-shared pipelines


def _compiled(schedule: str, pp: int, m: int):
    from autopar.pipeline.schedules import build_schedule
    from autopar.search.timeline import compile_schedule
    return compile_schedule(build_schedule(schedule, pp=pp, num_microbatches=m, chunks=1, recompute=frozenset()),
                            pp=pp, chunks=1, m=m)


def test_shared_makespan_by_hand():
    """timeline.CompiledSchedule.shared_makespan, hand-computed (F=1, B=2 per stage, free transfers): with a core
    per ready rank it is the plain timeline; on one core nothing overlaps, so it is the whole work; on 1.5 cores
    the ranks share when both are ready and run alone otherwise (the sequence below)."""
    costs = StageCosts(forward=(1.0, 1.0), backward=(2.0, 2.0), recompute=(0.0, 0.0), send_activation=(0.0, 0.0),
                       send_gradient=(0.0, 0.0))
    for schedule, m in (("gpipe", 2), ("1f1b", 4)):
        compiled = _compiled(schedule, 2, m)
        assert compiled.shared_makespan(costs, lambda k: 1.0) == pytest.approx(compiled.times(costs).makespan)
        assert compiled.shared_makespan(costs, lambda k: 1.0 / k) == pytest.approx(m * 2 * 3.0)
    # gpipe, pp=2, m=2 on 1.5 cores: F0a alone [0,1]; F0b and F1a together at 0.75: both done at 1 + 4/3; F1b
    # alone [7/3, 10/3]; gpipe's backward on stage 1 runs b then a: B1b alone [10/3, 16/3]; B1a beside B0b
    # (both ready at 16/3) at 0.75 each: done at 16/3 + 8/3 = 8; B0a alone [8, 10]
    compiled = _compiled("gpipe", 2, 2)
    got = compiled.shared_makespan(costs, lambda k: min(1.0, 1.5 / k))
    assert got == pytest.approx(10.0)


def test_a_ranks_update_pays_the_per_call_part_once_whatever_it_holds():
    """Blocks' updates are timed one block at a time, each with the optimizer call's own fixed part
    (BlockCosts.update_call_s); a rank updates all its blocks in one call, so a replica of the whole model pays it
    once, not once per block (which priced data parallelism's update high against a pipeline stage's), and ZeRO's
    shard divides only the rest."""
    from autopar.search.measure_profile import BlockCosts
    profile = toy_profile(layers=4)
    n = profile.num_blocks
    block = BlockCosts(forward_fixed_s=1e-3, forward_per_seq_s=1e-3, backward_fixed_s=2e-3, backward_per_seq_s=2e-3,
                       saved_per_seq=1e4, transient_fixed=0.0, transient_per_seq=0.0, update_s=1e-3,
                       update_call_s=2e-4)
    model = StepModel(dataclasses.replace(profile, measured=(block,) * n), toy_cluster(), global_batch_size=8)
    assert model.update_time([(0, n)], 0.0) == pytest.approx(n * 8e-4 + 2e-4)
    assert model.update_time([(0, 2), (4, 6)], 0.0) == pytest.approx(4 * 8e-4 + 2e-4)  # two chunks, one call
    assert model.update_time([(0, n)], 0.0, zero=1, dp=2) == pytest.approx(n * 8e-4 / 2 + 2e-4)
    # one rank of a tp group updates its share of each block's parameters
    share = [mine / whole if whole else 1.0 for mine, whole in zip(profile.at_tp(2).params, profile.params)]
    assert any(r < 1 for r in share)
    assert model.update_time([(0, n)], 0.0, tp=2) == pytest.approx(sum(share) * 8e-4 + 2e-4)
    # the data-parallel engine's foreach norm, where measured, instead of the float64 one
    foreach = dataclasses.replace(block, update_foreach_norm_s=5e-4)
    model = StepModel(dataclasses.replace(profile, measured=(foreach,) * n), toy_cluster(), global_batch_size=8)
    assert model.update_time([(0, n)], 0.0, foreach_norm=True) == pytest.approx(n * 3e-4 + 2e-4)
    assert model.update_time([(0, n)], 0.0) == pytest.approx(n * 8e-4 + 2e-4)
    replicas = model.evaluate(Candidate(dp=2, tp=1, pp=1, micro_batch_size=4, num_microbatches=1))
    assert replicas.parts["optimizer_s"] == pytest.approx(n * 3e-4 + 2e-4)  # the data-parallel engine's
    sharded = model.evaluate(Candidate(dp=2, tp=1, pp=1, micro_batch_size=4, num_microbatches=1, zero=1))
    zero1 = model.update_time([(0, n)], sum(profile.params), zero=1, dp=2)  # ZeRO's engine: the float64 norm
    assert sharded.parts["optimizer_s"] == pytest.approx(zero1) and zero1 > n * 8e-4 / 2 + 2e-4
