"""Expert, sequence and context parallelism and compilation in the strategy search (search/dimensions.py):
which candidates are listed, how each is priced, and that the search picks them when they pay. Pure: no ranks."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from autopar.search.candidate import Candidate
from autopar.search.cluster import preset, sized
from autopar.search.cost import StepModel
from autopar.search.dimensions import EXPERT_IMBALANCE, longest_sequence
from autopar.search.profile import AttentionCosts
from autopar.search.search import SearchSpace, enumerate_candidates, exhaustive
from test_search import toy_cluster, toy_profile


@pytest.fixture(scope="module")
def moe_profile():
    """A one-layer MoELM whose 32 experts hold most of its parameters (tests/moe_models.py), traced on meta."""
    from moe_models import SEQ, MoELM
    from autopar.search.profile import profile_graph
    from autopar.trace import trace
    with torch.device("meta"):
        model = MoELM(depth=1, experts=32)
    graph = trace(model, (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),))
    return profile_graph(graph, name="moe", seq_len=SEQ, tp_degrees=(1, 2), model=model)


def test_ep_is_listed_on_an_moe_model_and_picked_when_only_sharded_experts_fit(moe_profile):
    experts = moe_profile.experts
    assert experts is not None and experts.num_experts == 32 and sum(experts.params) == 32 * 16 * 16
    model = StepModel(moe_profile, sized(preset("cpu-local"), nproc=2), global_batch_size=4)
    space = SearchSpace(nproc=2, zero_levels=(0,))  # ZeRO shards every parameter: out of the way here
    listed = list(enumerate_candidates(model, space))
    assert {c.ep for c in listed} == {1, 2} and all(c.pp == c.tp == 1 and c.dp == 2 for c in listed if c.ep > 1)
    roomy = exhaustive(model, space)
    assert roomy.ranked[0].candidate.ep == 1  # memory to spare: the all-to-alls and the imbalance only cost
    from autopar.search.dimensions import dimension_notes
    note = next(n for n in dimension_notes(roomy.ranked) if n.startswith("expert parallelism"))
    assert "slower" in note and "all-to-alls" in note and "MiB per rank instead of" in note
    estimates = [model.evaluate(c) for c in listed]
    sharded = min(e.peak_memory for e in estimates if e.candidate.ep > 1)
    whole = min(e.peak_memory for e in estimates if e.candidate.ep == 1)
    assert sharded < whole
    tight = model.cluster.replace(memory_per_device_gb=(sharded + whole) / 2 / 2**30)
    best = exhaustive(StepModel(moe_profile, tight, global_batch_size=4), space).ranked[0]
    assert best.candidate.ep == 2 and best.fits


def test_ep_prices_a_shard_of_the_experts_their_all_to_alls_and_the_imbalance(moe_profile):
    model = StepModel(moe_profile, sized(preset("cpu-local"), nproc=2), global_batch_size=4)
    plain = Candidate(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=1)
    e1, e2 = model.evaluate(plain), model.evaluate(dataclasses.replace(plain, ep=2))
    halved = sum(moe_profile.experts.params) // 2
    assert e1.memory_per_stage[0].params - e2.memory_per_stage[0].params == pytest.approx(halved * 4, rel=0.01)
    assert e2.parts["exchange_s"] > 0 and e1.parts.get("exchange_s", 0.0) == 0.0
    cl, hidden, tokens = model.cluster, 16, 2 * moe_profile.seq_len
    all_to_all = cl.all_to_all(tokens * moe_profile.experts.top_k * hidden * 4.0, 2)
    assert e2.parts["exchange_s"] == pytest.approx(4 * all_to_all, rel=0.01)  # dispatch + combine, both ways
    f1, _, _ = model.block_times(1, 2)
    f2, _, _ = model._variants[(2, False, 1, "ring", False, 1)].block_times(1, 2)
    share = moe_profile.experts.flops[0] / moe_profile.flops[0]  # one block: a single layer is no stack
    assert f2[0] - all_to_all * 2 == pytest.approx(f1[0] * (1 + (EXPERT_IMBALANCE - 1) * share), rel=1e-6)


def test_sp_splits_a_tensor_parallel_blocks_activations_and_doubles_its_collectives():
    model = StepModel(toy_profile(), toy_cluster(), global_batch_size=4)
    plain = Candidate(dp=1, tp=2, pp=1, micro_batch_size=4, num_microbatches=1)
    assert {c.sp for c in enumerate_candidates(model, SearchSpace(nproc=2)) if c.tp == 2} == {False, True}
    assert not any(c.sp for c in enumerate_candidates(model, SearchSpace(nproc=2)) if c.tp == 1)
    odd = StepModel(dataclasses.replace(toy_profile(), seq_len=31), toy_cluster(), global_batch_size=4)
    assert not any(c.sp for c in enumerate_candidates(odd, SearchSpace(nproc=2)))  # tp must divide the sequence
    e0, e1 = model.evaluate(plain), model.evaluate(dataclasses.replace(plain, sp=True))
    from autopar.search.command import plan_dict
    assert plan_dict(e1, model)["strategy"]["sp"] is True and "sp" not in plan_dict(e0, model)["strategy"]
    layers0 = e0.memory_per_stage[0].activations
    layers1 = e1.memory_per_stage[0].activations
    assert layers1 < layers0
    _, _, comm0 = model.block_times(2, 4)
    _, _, comm1 = model._variants[(1, True, 1, "ring", False, 2)].block_times(2, 4)
    latency = model.cluster.allreduce_table.get(2, model.cluster.intra_node).latency_s
    assert comm1[1] - comm0[1] == pytest.approx(2 * 2 * latency, rel=1e-6)  # 2 more ring latencies per split op


def _attention_profile(seq_len: int = 32):
    prof = toy_profile()
    n = prof.num_blocks
    layers = tuple(0 if i in (0, n - 1) else 1 for i in range(n))
    return dataclasses.replace(prof, seq_len=seq_len, attention=AttentionCosts(
        heads=4, kv_heads=4, layers=layers, kv_bytes=tuple(4e4 * x for x in layers),
        qkv_out_bytes=tuple(8e4 * x for x in layers), flops=tuple(1e6 * x for x in layers)))


def test_cp_divides_sequence_memory_and_prices_the_ring_against_all_to_all():
    model = StepModel(_attention_profile(), toy_cluster(), global_batch_size=2)
    listed = list(enumerate_candidates(model, SearchSpace(nproc=2)))
    assert {(c.cp, c.cp_mode) for c in listed} == {(1, "ring"), (2, "ring"), (2, "all-to-all")}
    assert all(c.dp * c.cp * c.tp * c.pp == 2 and c.tp == 1 and c.zero == 0 for c in listed if c.cp > 1)
    one = Candidate(dp=1, tp=1, pp=1, micro_batch_size=2, num_microbatches=1)
    ring = dataclasses.replace(one, cp=2)
    e1, er = StepModel(_attention_profile(), toy_cluster(), global_batch_size=2).evaluate(one), model.evaluate(ring)
    assert er.memory_per_stage[0].activations == pytest.approx(e1.memory_per_stage[0].activations / 2, rel=0.01)
    ea = model.evaluate(dataclasses.replace(ring, cp_mode="all-to-all"))
    assert er.parts["exchange_s"] > 0 and ea.parts["exchange_s"] > 0
    forward = {mode: model._variants[(1, False, 2, mode, False, 1)].block_times(1, 2)[0][1]
               for mode in ("ring", "all-to-all")}
    shown = {mode: model._variants[(1, False, 2, mode, False, 1)].profile.exchange_seconds(2)[0][1]
             for mode in ("ring", "all-to-all")}
    assert shown["ring"] != shown["all-to-all"]  # the exchange is part of the block's time, the rest alike
    assert forward["ring"] - shown["ring"] == pytest.approx(forward["all-to-all"] - shown["all-to-all"])
    swapped = model._variants[(1, False, 2, "all-to-all", False, 1)].profile.exchange[1]
    model.evaluate(dataclasses.replace(ring, cp_mode="all-to-all", tp=2))
    split = model._variants[(1, False, 2, "all-to-all", False, 2)].profile.exchange[1]
    assert split[1] == pytest.approx(swapped[1] / 2) and split[0] == pytest.approx(swapped[0])  # half the heads
    slow = toy_cluster(flops_per_s={"fp32": 1e6})  # attention's compute outlasts the ring's sends: only latency shows
    hidden = StepModel(_attention_profile(), slow, global_batch_size=2).evaluate(ring)
    latencies = 4 * slow.intra_node.latency_s * 4  # 4 attentions: 1 send forward, backward 1 block and 2 gradients
    assert hidden.parts["exchange_s"] == pytest.approx(latencies, rel=1e-6)
    odd = StepModel(_attention_profile(seq_len=6), toy_cluster(), global_batch_size=2)  # 2 x cp must divide 6
    assert {c.cp for c in enumerate_candidates(odd, SearchSpace(nproc=2))} == {1}


def test_all_to_all_is_listed_exactly_where_the_rewrite_accepts_it():
    """The search lists --cp-mode all-to-all at a tp x cp only where the runtime's rewrite runs it: each tp rank's
    share of the heads must split over cp (gpt-tiny's 4 heads: tp=2 cp=4 leaves 2 heads per tp rank for 4 cp
    ranks, which the rewrite refuses though 4 heads divide by 4)."""
    from autopar.context_parallel.rewrite import check_rewritable
    from autopar.errors import ModelError
    from autopar.models.registry import build_model
    from autopar.search.profile import profile_graph
    from autopar.trace import trace
    model, _ = build_model("gpt-tiny", {"n_layer": 1}, vocab_size=64, device="cpu")
    graph = trace(model, (torch.zeros(1, 16, dtype=torch.long),), device="cpu")
    prof = profile_graph(graph, name="gpt-tiny", seq_len=16, tp_degrees=(1, 2, 4))
    space = SearchSpace(nproc=8, schedules=("1f1b",), chunks=(1,), recompute=("none",), partitions=("uniform",),
                        zero_levels=(0,))
    listed = {(c.tp, c.cp, c.cp_mode) for c in enumerate_candidates(StepModel(prof, sized(preset("cpu-local"), nproc=8),
                                                                              global_batch_size=8), space)}
    layouts = {(tp, cp) for tp, cp, _ in listed if cp > 1}
    assert {(2, 4), (1, 8), (2, 2), (4, 2)} <= layouts  # the ring runs them all
    for tp, cp in layouts:
        try:
            check_rewritable(graph, cp, "all-to-all", tp)
            accepted = True
        except ModelError:
            accepted = False
        assert ((tp, cp, "all-to-all") in listed) == accepted, (tp, cp)
    assert (2, 4, "all-to-all") not in listed and (1, 4, "all-to-all") in listed and (2, 2, "all-to-all") in listed


@pytest.mark.parametrize("speedup, picked", [(0.0, None), (0.8, False), (2.0, True)])
def test_compile_is_searched_only_where_measured_and_kept_only_when_faster(speedup, picked):
    cluster = toy_cluster(compile_speedup=speedup, compile_seconds=1e-3)
    model = StepModel(toy_profile(), cluster, global_batch_size=4)
    space = SearchSpace(nproc=2)
    listed = {c.compile for c in enumerate_candidates(model, space)}
    assert listed == ({False} if picked is None else {False, True})
    if picked is None:
        return
    plain = Candidate(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=1)
    eager, compiled = model.evaluate(plain), model.evaluate(dataclasses.replace(plain, compile=True))
    assert compiled.parts["compile_amortised_s"] == pytest.approx(1e-3 / 1000)
    assert (compiled.step_time_s < eager.step_time_s) == picked
    assert exhaustive(model, space).ranked[0].candidate.compile == picked


def test_longest_sequence_is_the_memory_models_bisection_and_grows_with_cp():
    cluster = toy_cluster(memory_per_device_gb=0.05)
    model = StepModel(_attention_profile(), cluster, global_batch_size=2)
    one = Candidate(dp=1, tp=1, pp=1, micro_batch_size=2, num_microbatches=1)
    two = Candidate(dp=1, tp=1, pp=1, micro_batch_size=2, num_microbatches=1, cp=2)
    longest = longest_sequence(model, one)
    assert longest is not None

    def fits(c, tokens):
        from autopar.search.dimensions import scaled_sequence
        return StepModel(scaled_sequence(model.profile, tokens / 32), cluster, global_batch_size=2).evaluate(c).fits
    assert fits(one, longest) and not fits(one, longest + 1)
    assert longest_sequence(model, two) >= 1.8 * longest


def test_plan_auto_lists_expert_parallel_plans_for_a_tiny_mixtral(capsys):
    from autopar.cli import main
    tiny = ["hidden_size=32", "intermediate_size=64", "num_hidden_layers=1", "num_attention_heads=4",
            "num_key_value_heads=2", "num_local_experts=4", "num_experts_per_tok=2", "max_position_embeddings=64"]
    args = ["plan", "--auto", "--model", "hf:mixtral", *[x for a in tiny for x in ("--model-arg", a)], "--seq-len", "8",
            "--nproc", "2", "--global-batch-size", "2", "--cluster", "cpu-local", "--cost-model", "flops",
            "--top", "60", "--json"]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out)
    plans = [record, *record["alternatives"]]
    assert any(p["strategy"].get("ep") == 2 for p in plans)
    assert any(p["strategy"].get("cp") == 2 for p in plans)
    assert record["longest_seq_len"] > 8
    assert any(n.startswith("expert parallelism") for n in record["dimensions_not_picked"])
    assert not any(d["name"] in ("--ep", "--sp", "--cp / --cp-mode") for d in record["search"]["not_covered"])


def test_all_to_all_is_priced_from_its_measured_table_else_from_the_all_reduce_figures():
    from autopar.search.cluster import Link, cluster_from_dict
    derived = toy_cluster()
    assert derived.all_to_all(1e6, 2) == pytest.approx(derived.all_reduce(1e6, 2) / 2)  # half a ring all-reduce
    measured = toy_cluster(all_to_all_table={2: Link(3e-5, 2e8)})
    assert measured.all_to_all(1e6, 2) == pytest.approx(3e-5 + 0.5 * 1e6 / 2e8)
    assert cluster_from_dict(measured.to_dict()).all_to_all_table == {2: Link(3e-5, 2e8)}  # the cluster file keeps it


def test_cp_prices_each_modes_measured_attention_work_on_measured_blocks():
    """A cp rank's attention is the written-out ring, or the kernel wrapped in the all-to-all's swaps, not 1/cp of
    the model's fused kernel: with each mode's measured seconds (search/ring_cost.py) each attention's share
    changes by them, the other mode and layouts without cp do not."""
    from autopar.search.measure_profile import BlockCosts, with_measured_blocks
    from autopar.search.ring_cost import measure_ring_seconds
    base = _attention_profile()
    blocks = [BlockCosts(forward_fixed_s=1e-3, forward_per_seq_s=2e-3, backward_fixed_s=2e-3, backward_per_seq_s=4e-3,
                         saved_per_seq=1e3, transient_fixed=0.0, transient_per_seq=0.0)] * base.num_blocks
    measured = with_measured_blocks(base, blocks)
    extra, swapped = (3e-4, 1e-4, 5e-4, 2e-4), (7e-5, 3e-5, 9e-5, 4e-5)
    ringed = dataclasses.replace(measured, attention=dataclasses.replace(measured.attention, ring_seconds={2: extra}))
    both = dataclasses.replace(ringed, attention=dataclasses.replace(ringed.attention,
                                                                     all_to_all_seconds={2: swapped}))
    ring = Candidate(dp=1, tp=1, pp=1, micro_batch_size=2, num_microbatches=1, cp=2)
    key = (1, False, 2, "ring", False, 1)
    times = {}
    for name, prof in (("plain", measured), ("ringed", ringed), ("both", both)):
        model = StepModel(prof, toy_cluster(), global_batch_size=2)
        model.evaluate(ring)
        model.evaluate(dataclasses.replace(ring, cp_mode="all-to-all"))
        times[name] = {mode: model._variants[key[:3] + (mode,) + key[4:]].block_times(1, 2)[:2]
                       for mode in ("ring", "all-to-all")}
    layers = base.attention.layers
    for b, n in enumerate(layers):
        assert times["ringed"]["ring"][0][b] - times["plain"]["ring"][0][b] == pytest.approx(
            n * (extra[0] + 2 * extra[1]), abs=1e-12)
        assert times["ringed"]["ring"][1][b] - times["plain"]["ring"][1][b] == pytest.approx(
            n * (extra[2] + 2 * extra[3]), abs=1e-12)
    assert times["ringed"]["all-to-all"] == times["plain"]["all-to-all"]
    assert times["both"]["ring"] == times["ringed"]["ring"]
    for b, n in enumerate(layers):
        assert times["both"]["all-to-all"][0][b] - times["plain"]["all-to-all"][0][b] == pytest.approx(
            n * (swapped[0] + 2 * swapped[1]), abs=1e-12)
        assert times["both"]["all-to-all"][1][b] - times["plain"]["all-to-all"][1][b] == pytest.approx(
            n * (swapped[2] + 2 * swapped[3]), abs=1e-12)
    # the measurement itself: one tuple per degree that splits the sequence into 2 x cp chunks (and, all-to-all,
    # the 4 heads into cp groups)
    att = dataclasses.replace(base.attention, head_dim=4)
    seconds = measure_ring_seconds(att, 12, degrees=(2, 3, 4), repeats=1)
    assert set(seconds) == {2, 3} and all(len(v) == 4 for v in seconds.values())
    swaps = measure_ring_seconds(att, 12, degrees=(2, 3, 4), repeats=1, mode="all-to-all")
    assert set(swaps) == {2} and len(swaps[2]) == 4


def test_time_shared_cp_prices_the_rings_waits_and_the_tp_groups_it_couples():
    """Hand-computed: on cores the ranks time-share, each wait of ring attention idles them until the neighbour it
    waits on has run (Cluster.wait_idle_s(2)): per attention and micro-batch cp - 1 forward, 2 cp - 1 backward. An
    all-to-all adds none (its calibrated wall time was measured with every rank in it). With tp, a layer couples
    cp TP groups, so each TP all-reduce idles the cores until all tp x cp ranks have run (wait_idle_s(4) here)."""
    shared = toy_cluster(devices_per_node=4, cores_per_node=1)
    idle = shared.replace(wait_idle_table={2: 1e-3, 4: 5e-3})

    def added(c: Candidate) -> float:
        plain, waiting = (StepModel(_attention_profile(), cl, global_batch_size=2).evaluate(c) for cl in (shared, idle))
        assert plain.parts["time_shared_s"] >= plain.parts["timeline_step_s"]  # the bound rules
        return waiting.parts["time_shared_s"] - plain.parts["time_shared_s"]

    ring = Candidate(dp=2, tp=1, pp=1, micro_batch_size=1, num_microbatches=1, cp=2)
    assert added(ring) == pytest.approx(4 * (1 + 3) * 1e-3)  # 4 attentions, 1 wait forward and 3 backward
    assert added(dataclasses.replace(ring, cp_mode="all-to-all")) == pytest.approx(0.0, abs=1e-12)
    tp_waits = 2 * (2 * (1 + 2 * 4))  # micro-batches x (forward and backward x the tp=2 profile's 9 all-reduces)
    both = Candidate(dp=1, tp=2, pp=1, micro_batch_size=1, num_microbatches=2, cp=2, cp_mode="all-to-all")
    assert added(both) == pytest.approx(tp_waits * 5e-3)
    assert added(dataclasses.replace(both, cp_mode="ring")) == pytest.approx(tp_waits * 5e-3 + 2 * 4 * 4 * 1e-3)
    alone = Candidate(dp=2, tp=2, pp=1, micro_batch_size=1, num_microbatches=1)  # no cp: the TP group alone
    assert added(alone) == pytest.approx(tp_waits / 2 * 1e-3)
