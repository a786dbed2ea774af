"""More Hugging Face families (tests/zoo_families.py) train under dp=2, pp=2 and tp=2 to one process's results.

18 families beyond the zoo's 13: mixture of experts (Mixtral, Qwen2-MoE: a router, top-k and
experts run as grouped matrix products sized by a histogram of the routing), sliding windows
and soft-capping (Gemma 2 and 3), partial rotary and parallel blocks (GPT-NeoX, GPT-J, Falcon
with its multi-query head split by index lists, StableLM, Phi), StarCoder2, Mistral, Qwen2, a
selective state-space scan (Mamba), ELECTRA, BART, Whisper (log-mel features, a convolutional
front end, an encoder-decoder), ViT and CLIP's vision tower as image classifiers. Each is built
from its default config (dropout and use_cache as they come) both on meta (autopar
initialises it) and for real (seeded, the same in every process), and trains 2 steps of 8
samples through autopar.Trainer; every layout runs 2 micro-batches of 4 on 2 ranks and must
equal one process on one micro-batch of 8: losses within 1e-5 relative, parameters within 1e-4.

A pool task costs a start-up of its own, so each layout trains every case in one pool task
(zoo_families.train_families), and the references once in another; the tests read the results.
"""

from __future__ import annotations

import math

import pytest
import torch

from zoo_families import BUILDS, KNOWN_FAILURES, MORE_HF_FAMILIES, train_families

LAYOUTS = {"dp2": {}, "pp2": {"pp": 2}, "tp2": {"tp": 2}}
MICRO = 4
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-4  # as in test_model_zoo: Adam moves a gradient that is zero up to rounding by a fraction of lr
CASES = [(family, how) for family in MORE_HF_FAMILIES for how in BUILDS]

_results: dict = {}


def _run(rank_pool, tmp_path_factory, layout: str | None) -> dict:
    """Every case under `layout` (None: the one-process reference), trained once per test session."""
    if layout not in _results:
        out = str(tmp_path_factory.mktemp(f"families-{layout or 'reference'}"))
        if layout is None:
            _results[layout] = rank_pool(1).run(train_families, CASES, out, timeout=900)
        else:
            _results[layout] = rank_pool(2).run(train_families, CASES, out, strategy=LAYOUTS[layout],
                                                micro_batch_size=MICRO, timeout=900)
    return _results[layout]


def _succeeded(got: dict, what: str) -> dict:
    assert "error" not in got, f"{what}: {got['error']}\n{got.get('traceback', '')}"
    return got


def _relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family,how", CASES, ids=[f"{f}-{h}" for f, h in CASES])
def test_family_layout_matches_single_process(rank_pool, tmp_path_factory, family, how, layout, request):
    if (family, how, layout) in KNOWN_FAILURES:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_FAILURES[(family, how, layout)], strict=True))
    expected = _succeeded(_run(rank_pool, tmp_path_factory, None)[0][(family, how)], "the one-process reference")
    assert all(math.isfinite(x) for x in expected["losses"]), expected["losses"]
    results = [_succeeded(r[(family, how)], f"rank {rank}")
               for rank, r in enumerate(_run(rank_pool, tmp_path_factory, layout))]
    for rank, got in enumerate(results):
        assert _relative_difference(expected["losses"], got["losses"]) < LOSS_RTOL, \
            (rank, expected["losses"], got["losses"])
        assert got["params"], rank
        # the same names as one process's state: nothing a trace made up (a constant made in forward) is saved
        made_up = sorted(set(got["params"]) - set(expected["params"]))
        assert not made_up, (rank, made_up)
        for key, value in got["params"].items():  # pp: this rank's stage; tp: slices gathered
            want = expected["params"][key]
            assert value.shape == want.shape, (rank, key, value.shape, want.shape)
            assert (value.float() - want.float()).abs().max() < PARAM_ATOL, \
                (rank, key, float((value.float() - want.float()).abs().max()))
    if layout != "pp2":  # dp and tp: both ranks hold every parameter, bitwise alike
        first, second = (r["params"] for r in results)
        assert first.keys() == second.keys()
        for key in first:
            assert torch.equal(first[key], second[key]), (key, float((first[key] - second[key]).abs().max()))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_experts_stay_whole_under_tp_and_the_plan_says_so(family):
    """Under tp the experts (3-d weights read by a grouped matrix product) and the router are whole on every
    rank, and the plan's table names them; attention (and Qwen2-MoE's shared expert) is split. Traced on meta
    as if on the CPU, as a pipeline traces it: the routing's histogram takes the CPU's branch."""
    from torch.utils.data import default_collate

    from autopar.models.hf import turn_off_kv_cache
    from autopar.tensor_parallel import plan_tensor_parallel
    from autopar.trace import trace
    from autopar.train.fields import traced_call
    from zoo_families import build, more_hf_data

    model = build(family, "meta")
    turn_off_kv_cache(model)
    graph = trace(model, *traced_call(default_collate(more_hf_data(family)[:MICRO])), device=torch.device("cpu"))
    histograms = [n for n in graph.graph.nodes if "histc" in str(n.target)]
    assert histograms and all(n.args[0].meta["val"].dtype.is_floating_point for n in histograms)
    plan = plan_tensor_parallel(graph, 2)
    experts = [name for name, _ in model.named_parameters() if ".experts." in name]
    assert experts and set(experts) <= set(plan.replicated_params), sorted(set(experts) - set(plan.replicated_params))
    assert "model.layers.0.mlp.experts.gate_up_proj" in plan.table()
    assert "model.layers.0.mlp.gate.weight" in plan.replicated_params
    assert "model.layers.0.self_attn.q_proj.weight" in plan.params


def test_experts_looped_over_by_the_data_are_refused_with_the_way_out():
    """Mixtral loaded with experts_implementation='eager' loops over the experts the router picked: a count only
    the data knows, which no traced graph (pp, tp) can hold. One autopar error, at the trace (before any step),
    names the loop and what works: pp=1 tp=1, or the grouped experts."""
    import transformers
    from torch.utils.data import default_collate

    from autopar.errors import ModelError
    from autopar.models.hf import quiet_transformers, turn_off_kv_cache
    from autopar.trace import trace
    from autopar.train.fields import traced_call
    from zoo_families import config_of, more_hf_data

    with quiet_transformers(transformers), torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config_of("mixtral", MORE_HF_FAMILIES["mixtral"][1]),
                                                              experts_implementation="eager")
    turn_off_kv_cache(model)
    with pytest.raises(ModelError, match=r"loops over a tensor's values \(at .*modeling_mixtral.py:\d+: for expert_idx "
                                         r"in .*pp=1 and tp=1.*experts_implementation='grouped_mm'"):
        trace(model, *traced_call(default_collate(more_hf_data("mixtral")[:MICRO])), device=torch.device("cpu"))
