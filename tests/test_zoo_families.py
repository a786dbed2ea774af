"""What the mixture-of-experts families of the zoo (tests/zoo_families.py) do under tensor parallelism, and
how a forward that loops over the router's choices is refused.

The families themselves (18 beyond zoo_models' 13: Mixtral, Qwen2-MoE, Gemma 2 and 3 with sliding
windows, GPT-NeoX, GPT-J, Falcon, StableLM, StarCoder2, Mistral, Qwen2, Phi, Mamba, ELECTRA, BART,
Whisper, ViT, CLIP's vision classifier) train in tests/test_model_zoo.py, built on meta and for
real, under dp2, pp2 and tp2 against one process. These tests need no ranks: they trace.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from zoo_families import MORE_HF_FAMILIES, config_of, more_hf_data, more_hf_model

MICRO = 4


def _traced_on_meta(model):
    """`model` traced on a micro-batch of its family's data as a pipeline on the CPU traces it."""
    from autopar.models.hf import turn_off_kv_cache
    from autopar.trace import trace
    from autopar.train.fields import traced_call

    turn_off_kv_cache(model)
    return trace(model, *traced_call(default_collate(more_hf_data(model.config.model_type)[:MICRO])),
                 device=torch.device("cpu"))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_experts_stay_whole_under_tp_and_the_plan_says_so(family):
    """Under tp the experts (3-d weights read by a grouped matrix product) and the router are whole on every
    rank, and the plan's table names them; attention (and Qwen2-MoE's shared expert) is split. Traced on meta
    as if on the CPU, as a pipeline traces it: the routing's histogram takes the CPU's branch."""
    from autopar.tensor_parallel import plan_tensor_parallel

    head, widths = MORE_HF_FAMILIES[family]
    with torch.device("meta"):
        model = more_hf_model(family, head, **widths)
    graph = _traced_on_meta(model)
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

    from autopar.errors import ModelError
    from autopar.models.hf import quiet_transformers

    with quiet_transformers(transformers), torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config_of("mixtral", MORE_HF_FAMILIES["mixtral"][1]),
                                                              experts_implementation="eager")
    with pytest.raises(ModelError, match=r"loops over a tensor's values \(at .*modeling_mixtral.py:\d+: for expert_idx "
                                         r"in .*pp=1 and tp=1.*experts_implementation='grouped_mm'"):
        _traced_on_meta(model)
