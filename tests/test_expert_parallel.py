"""Expert parallelism (--ep): mixture-of-experts layers found in the graph, their experts sharded over ranks,
tokens exchanged by all-to-all, and training equal to one process holding every expert.

Equivalence: tiny Mixtral and Qwen2-MoE of the zoo (tests/zoo_families.py: 4 experts, top-2), a user
MoE with one 3-d expert weight and a sigmoid router (tests/moe_models.py) and Mixtral with its own
load-balancing loss on train 3 steps of 8 samples on one process (two micro-batches of 4), and on 2 ranks
with ep=2 (each rank holds 2 of the 4 experts of every layer and trains one micro-batch of 4): losses within
1e-5 relative, whole parameters (expert rows gathered) within the zoo's 1e-4. Mixtral and Qwen2-MoE also
train on 4 ranks as dp2 x ep2 x pp2 and dp2 x ep2 x tp2 (the pipeline engine, dispatch spliced into the
traced stages). The ep=2 run and the dp2 x ep2 x pp2 run of Mixtral save a checkpoint after step 2 that
one process (ep=1, pp=1) resumes for a third step, which must equal the third step of one process's own run.
"""

from __future__ import annotations

import pytest
import torch

from moe_models import MORE_MOE_FAMILIES, ROUTER_AUX, ROUTER_SCORES, LoopedExperts, MoELM, train_moe
from test_model_zoo import assert_matches_reference

# Mixtral again with its own load-balancing loss on (output_router_logits, weight 0.5): autopar's loss adds the
# model's aux_loss of each micro-batch weighted by its share of the batch, so every run trains micro-batches of 4
JOBS = [("hf:mixtral", "meta"), ("hf:qwen2_moe", "real"), ("user:moe", "real"), ("hf:mixtral" + ROUTER_AUX, "meta")]
RESUMED = JOBS[:1]  # the layout change on resume is the same for every family: one is enough


@pytest.fixture(scope="module")
def one_process(rank_pool, tmp_path_factory):
    """Every job's 3-step run on one process: the reference."""
    return rank_pool(1).run(train_moe, JOBS, str(tmp_path_factory.mktemp("moe-reference")), micro_batch_size=4,
                            steps=3, timeout=600)[0]


@pytest.mark.timeout(600)
def test_ep2_matches_one_process_and_resumes_under_ep1(rank_pool, tmp_path, one_process):
    ep2 = rank_pool(2).run(train_moe, JOBS, str(tmp_path / "ep2"), strategy={"ep": 2}, micro_batch_size=4, steps=3,
                           checkpoint_every=2, timeout=600)
    resumed = rank_pool(1).run(train_moe, RESUMED, str(tmp_path / "resumed"), steps=3,
                               resume_from=str(tmp_path / "ep2"), resume_checkpoint="checkpoints/step_00000002",
                               timeout=600)[0]
    for job in JOBS:
        reference = one_process[job]
        assert "error" not in reference, reference.get("error")
        ranks = [r[job] for r in ep2]
        for rank, got in enumerate(ranks):
            assert "error" not in got, (job, rank, got.get("error"))
            # each rank holds half of every expert weight's rows: sharded, not replicated
            assert got["expert_rows"] and set(got["expert_rows"].values()) == {2}, (job, got["expert_rows"])
            assert "each rank holds 2 of 4 experts" in got["banner"][0], got["banner"]
        assert_matches_reference(reference, ranks)
        if job[0].endswith(ROUTER_AUX):  # the same first weights: the aux loss (about top-k = 2 here) x 0.5 added
            assert reference["losses"][0] > one_process[JOBS[0]]["losses"][0] + 0.5, reference["losses"]
        # the global gradient norm (dense parts once, every expert once) as one process's, before clipping at 1
        norms = [[r["grad_norm"] for r in got["records"]] for got in (reference, *ranks)]
        assert all(abs(a - b) <= 1e-5 * a for ours in norms[1:] for a, b in zip(norms[0], ours)), (job, norms)
        # tokens per expert and per rank in metrics.jsonl: every (token, choice) counted once over both ranks
        stats = ranks[0]["records"][-1]["experts"]
        assert len(stats) == 2, stats
        for layer in stats.values():
            seq = 8 if job[0] == "user:moe" else 16
            assert sum(layer["tokens_per_expert"]) == 8 * seq * 2, layer  # 8 samples, top-2
            assert sum(layer["tokens_per_rank"]) == sum(layer["tokens_per_expert"]) and len(layer["tokens_per_rank"]) == 2
            assert layer["expert_imbalance"] >= 1.0
    for job in RESUMED:  # the checkpoint of step 2 (whole expert tensors) resumed by one process: its step 3
        reference, after = one_process[job], resumed[job]
        assert "error" not in after, after.get("error")
        assert len(after["losses"]) == 1 and abs(after["losses"][0] - reference["losses"][2]) \
            < 1e-5 * abs(reference["losses"][2]), (job, after["losses"], reference["losses"])
        assert not after["expert_rows"]  # ep=1: whole experts
        assert_matches_reference(reference, [after | {"losses": reference["losses"]}])


COMPOSED = {"pp2": {"ep": 2, "pp": 2}, "tp2": {"ep": 2, "tp": 2}}  # 4 ranks each: dp=2 (the ep group) x pp or tp


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", sorted(COMPOSED))
def test_ep2_with_pp_or_tp_matches_one_process(rank_pool, tmp_path, one_process, layout):
    """dp2 x ep2 x pp2 and dp2 x ep2 x tp2: the experts' dispatch spliced into the traced stage graphs (each stage
    holds 2 of 4 experts of its layers), equal to one process as plain ep=2 is."""
    jobs = JOBS[:2]
    runs = rank_pool(4).run(train_moe, jobs, str(tmp_path / layout), strategy=COMPOSED[layout], micro_batch_size=2,
                            steps=3, checkpoint_every=2 if layout == "pp2" else 0, timeout=600)
    for job in jobs:
        ranks = [r[job] for r in runs]
        for rank, got in enumerate(ranks):
            assert "error" not in got, (job, rank, got.get("error"))
            assert got["expert_rows"] and set(got["expert_rows"].values()) == {2}, (job, rank, got["expert_rows"])
            assert any("each rank holds 2 of 4 experts" in line for line in got["banner"]), got["banner"]
        assert_matches_reference(one_process[job], ranks)
        stats = ranks[0]["records"][-1]["experts"]  # both stages' layers, every (token, choice) counted once
        assert len(stats) == 2 and all(sum(layer["tokens_per_expert"]) == 8 * 16 * 2 for layer in stats.values()), stats
        norms = [[r["grad_norm"] for r in got["records"]] for got in (one_process[job], *ranks)]
        assert all(abs(a - b) <= 1e-5 * a for ours in norms[1:] for a, b in zip(norms[0], ours)), (job, norms)
    if layout == "pp2":  # the stages' checkpoint (whole expert tensors, both stages) resumed by one process
        after = rank_pool(1).run(train_moe, RESUMED, str(tmp_path / "resumed"), steps=3, resume_from=str(tmp_path / layout),
                                 resume_checkpoint="checkpoints/step_00000002", timeout=600)[0][RESUMED[0]]
        reference = one_process[RESUMED[0]]
        assert "error" not in after, after.get("error")
        assert abs(after["losses"][0] - reference["losses"][2]) < 1e-5 * abs(reference["losses"][2]), after["losses"]
        assert_matches_reference(reference, [after | {"losses": reference["losses"]}])


def test_plan_finds_the_user_moe_with_its_sigmoid_router_and_3d_weight():
    from autopar.experts import find_experts
    from autopar.trace import trace

    with torch.device("meta"):
        model = MoELM()
    plan = find_experts(trace(model, (torch.zeros(2, 8, dtype=torch.long, device="meta"),)), model)
    assert [layer.experts for layer in plan.layers] == ["blocks.0.experts", "blocks.1.experts"]
    assert plan.layers[0].score == "sigmoid" and plan.layers[0].top_k == 2 and not plan.layers[0].renormalised
    assert plan.expert_params == ["blocks.0.experts.weight", "blocks.1.experts.weight"]


def test_routing_without_batched_experts_stays_replicated_and_the_plan_says_why():
    from autopar.experts import find_experts
    from autopar.trace import trace

    with torch.device("meta"):
        model = torch.nn.Sequential(LoopedExperts(), LoopedExperts())
    plan = find_experts(trace(model, (torch.zeros(2, 8, 16, device="meta"),)), model)
    assert not plan.layers and len(plan.unrecognised) == 2, plan.table()
    assert "router 0.router picks 2 of 4, but no 3-d weight with 4 rows is read under its choices" in plan.table()


@pytest.mark.parametrize("family", sorted(MORE_MOE_FAMILIES))
def test_more_hf_families_experts_are_found(family):
    """DeepSeek-V3 (sigmoid scores with a correction bias and group-limited choice, a router
    weight cast to fp32) and gpt-oss (softmax of the chosen logits, expert biases): traced on meta, each layer's
    experts module and its 3-d (and per-expert bias) weights are found."""
    import transformers

    from autopar.experts import find_experts
    from autopar.models.hf import quiet_transformers, turn_off_kv_cache
    from autopar.trace import trace
    from zoo_families import config_of

    with quiet_transformers(transformers), torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config_of(family, MORE_MOE_FAMILIES[family]))
    turn_off_kv_cache(model)
    plan = find_experts(trace(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                              device=torch.device("cpu")), model)
    assert [layer.experts for layer in plan.layers] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(layer.num_experts == 4 and layer.top_k == 2 and layer.score == ROUTER_SCORES[family]
               for layer in plan.layers), plan.table()
    experts = {name for name, _ in model.named_parameters() if ".experts." in name}
    assert set(plan.expert_params) == experts and not plan.unrecognised


@pytest.mark.parametrize("skew", [False, True], ids=["spread", "rank-1-gets-nothing"])
def test_dispatch_equals_the_whole_experts_module(rank_pool, skew):
    """The all-to-all dispatch on 2 ranks against the whole module on each rank's tokens: outputs, input and
    router-weight gradients, and this rank's experts' gradient (both ranks' tokens). Skewed routing leaves
    rank 1's experts with no row: it still joins every exchange, forward and backward (no hang)."""
    from moe_models import dispatch_against_whole

    for rank, got in enumerate(rank_pool(2).run(dispatch_against_whole, skew, timeout=120)):
        for key in ("out", "x", "w", "weight"):
            torch.testing.assert_close(got["ep"][key], got["whole"][key], rtol=1e-5, atol=1e-5, msg=f"{rank} {key}")
        if skew and rank == 1:
            assert got["received"] == [0, 0]
