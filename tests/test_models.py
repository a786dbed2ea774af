"""Tests for autopar.models: the reference GPT, the HF factory and meta materialisation.

Everything runs on CPU in one process; the large GPT presets are shrunk to two layers
where they are materialised so the whole file stays within a few seconds.
"""

from __future__ import annotations

import sys

import pytest
import tomli_w
import torch

from autopar.errors import ModelError
from autopar.models import ModelInfo, available_models, build_model, materialize
from autopar.models.materialize import tied_groups
from autopar.models.registry import GPT_SIZES

HF = ["hf:gpt2", "hf:llama", "hf:bert"]


def logits_of(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def small_args(name: str) -> dict:
    """Keep the big GPT presets cheap to materialise (small/medium keep their width; the billion-parameter
    presets, meant for meta-only planning, are shrunk to a toy width: their shapes are checked on meta)."""
    if name in ("gpt-small", "gpt-medium"):
        return {"n_layer": 2}
    if name.startswith("gpt-") and name[-1] == "b":
        return {"n_layer": 1, "n_head": 2, "d_model": 64}
    return {}


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    """Bitwise: used only for states made by the same seeded init ops in the same order."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- reference GPT


def test_gpt_forward_shape():
    model, info = build_model("gpt-tiny", vocab_size=100)
    materialize(model, seed=0)
    out = model(torch.randint(0, 100, (3, 10)))
    assert out.shape == (3, 10, 100)
    assert isinstance(info, ModelInfo)
    assert (info.name, info.task, info.vocab_size, info.max_seq_len) == (
        "gpt-tiny", "causal-lm", 100, 256
    )
    assert info.args["vocab_size"] == 100


def test_gpt_is_causal():
    model, _ = build_model("gpt-tiny")
    materialize(model, seed=0)
    x = torch.randint(0, 256, (2, 12))
    y = x.clone()
    y[:, 8] = (y[:, 8] + 1) % 256
    a, b = model(x), model(y)
    assert torch.equal(a[:, :8], b[:, :8])  # bitwise: same model, same shapes, rows that see the same tokens
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_gpt_tie_survives_build_and_materialize():
    model, _ = build_model("gpt-tiny")
    assert model.lm_head.weight is model.tok_emb.weight
    materialize(model, seed=0)
    assert model.lm_head.weight is model.tok_emb.weight
    assert not model.tok_emb.weight.is_meta
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    grad = model.tok_emb.weight.grad
    assert grad is model.lm_head.weight.grad
    # Row 200 never appears in the input: its gradient can only come through the head.
    assert grad[200].abs().sum() > 0


def test_materialize_is_deterministic_and_seed_dependent():
    states = []
    for seed in (7, 7, 8):
        model, _ = build_model("gpt-tiny")
        states.append(state(materialize(model, seed=seed)))
    assert same_state(states[0], states[1])
    assert not same_state(states[0], states[2])


def test_materialize_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    model, _ = build_model("gpt-tiny")
    materialize(model, seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_meta_build_allocates_nothing_until_materialize():
    model, info = build_model("gpt-medium")  # 300M parameters, but on meta
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.is_meta for t in tensors)
    assert info.num_params > 300_000_000


def test_materialize_of_real_module_only_moves_it():
    model, _ = build_model("gpt-tiny", device="cpu")
    before = state(model)
    assert materialize(model, "cpu", seed=99) is model
    assert same_state(before, state(model))
    assert model.lm_head.weight is model.tok_emb.weight


def test_gpt_init_scales_residual_projections():
    model, _ = build_model("gpt-mini", {"n_layer": 8, "d_model": 256})
    materialize(model, seed=0)
    block = model.blocks[0]
    assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.out_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert block.mlp.fc_out.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(block.ln_1.weight, torch.ones(256))  # exact: constant init, no arithmetic
    assert torch.equal(block.attn.q_proj.bias, torch.zeros(256))


def test_num_params_counts_tied_weight_once():
    model, info = build_model("gpt-tiny")
    every = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert info.num_params == every - model.tok_emb.weight.numel()
    _, gpt2 = build_model("hf:gpt2")
    assert gpt2.num_params == info.num_params  # same shapes as gpt-tiny, one shared weight


def test_size_table_and_defaults():
    for name, size in GPT_SIZES.items():
        _, info = build_model(name)
        assert {k: info.args[k] for k in size} == size
        assert info.vocab_size == 256 and info.max_seq_len == size["max_seq_len"]
    _, small = build_model("gpt-small")
    assert 85e6 < small.num_params < 86.1e6  # GPT-2 small body with a 256-token vocab


def test_string_arguments_are_coerced():
    _, info = build_model(
        "gpt-mini",
        {"n_layer": "3", "dropout": "0.1", "bias": "false", "d_ff": "0", "vocab_size": "64"},
        vocab_size=1000,
    )
    assert info.args["n_layer"] == 3 and info.args["dropout"] == 0.1
    assert info.args["bias"] is False and info.args["d_ff"] == 512
    assert info.vocab_size == 64  # explicit model_args beat the caller's vocab_size


# --------------------------------------------------------------------------- every model


@pytest.mark.parametrize("name", available_models())
def test_every_model_builds_materializes_and_runs(name):
    model, info = build_model(name, small_args(name), vocab_size=96)
    assert all(p.is_meta for p in model.parameters())
    materialize(model, seed=0)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    logits = logits_of(model(torch.randint(0, 96, (2, 16))))
    assert logits.shape == (2, 16, 96) and info.vocab_size == 96
    assert torch.isfinite(logits).all()
    assert info.task == ("masked-lm" if name == "hf:bert" else "causal-lm")
    assert info.num_params == sum(p.numel() for p in model.parameters())
    tomli_w.dumps({"model": info.args})  # goes into the run's config file


@pytest.mark.parametrize("name", HF)
def test_hf_materialize_is_deterministic(name):
    a, _ = build_model(name)
    b, _ = build_model(name)
    assert same_state(state(materialize(a, seed=3)), state(materialize(b, seed=3)))


def test_hf_gpt2_stays_tied():
    model, _ = build_model("hf:gpt2")
    groups = tied_groups(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    materialize(model, seed=0)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert tied_groups(model) == groups


def test_hf_bert_keeps_both_ties():
    model, _ = build_model("hf:bert")
    params, _ = tied_groups(model)
    assert len(params) == 2  # decoder weight <-> word embeddings, decoder bias <-> bias
    materialize(model, seed=0)
    assert tied_groups(model)[0] == params
    position_ids = model.bert.embeddings.position_ids
    assert torch.equal(position_ids[0], torch.arange(256))


def test_hf_llama_rotary_buffers_match_a_cpu_build():
    meta, info = build_model("hf:llama")
    materialize(meta, seed=0)
    cpu, _ = build_model("hf:llama", device="cpu")
    got, want = dict(meta.named_buffers()), dict(cpu.named_buffers())
    assert got.keys() == want.keys() and any("inv_freq" in k for k in got)
    for key in got:
        assert torch.equal(got[key], want[key]), key  # bitwise: the same buffer formula on the same shapes
    config = meta.config
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    assert config.use_cache is False and info.max_seq_len == 256


def test_hf_arguments_override_config_and_aliases_resolve():
    model, info = build_model("hf:gpt2", {"hidden_size": "32", "n_layer": "3"})
    assert model.config.n_embd == 32 and model.config.n_layer == 3
    assert info.args["n_embd"] == 32 and "hidden_size" not in info.args


def test_hf_model_type_arguments_reach_the_config_constructor():
    """`--model hf:qwen2 --model-arg num_hidden_layers=4`: fields derived from an argument follow it (Qwen2's
    layer_types, one entry per layer), through the command line's own parsing."""
    from autopar.cli import build_parser, resolve_job
    job = resolve_job(build_parser().parse_args(["train", "--model", "hf:qwen2", "--model-arg", "num_hidden_layers=4"]))
    model, info = build_model(job.model.name, job.model.args)
    assert len(model.model.layers) == 4 and len(model.config.layer_types) == 4
    assert info.args["num_hidden_layers"] == 4 and model.config.hidden_size == 64  # the small defaults stay


def test_hf_construction_failure_names_the_model_and_the_argument():
    """A failure inside the model's own construction code (an unknown activation: a KeyError in a layer's
    __init__) is one ModelError that names the model and the argument, never a transformers traceback."""
    with pytest.raises(ModelError, match=r"cannot build hf:qwen2 with model arguments \{'hidden_act': 'nope'\}: "
                                         r"KeyError"):
        build_model("hf:qwen2", {"hidden_act": "nope"})


# --------------------------------------------------------------------------- bad input


def test_unknown_model_lists_available():
    with pytest.raises(ModelError) as err:
        build_model("gpt-huge")
    assert str(err.value) == (
        "unknown model 'gpt-huge'; available: "
        "{gpt-tiny, gpt-mini, gpt-small, gpt-medium, gpt-1.5b, gpt-2.5b, gpt-8.3b, gpt-20b, word-lstm, word-gpt, "
        "hf:gpt2, hf:llama, hf:bert}"
    )


def test_unknown_model_argument():
    with pytest.raises(ModelError) as err:
        build_model("gpt-mini", {"n_layers": 3})
    assert str(err.value) == (
        "unknown model argument 'n_layers' for gpt-mini; valid: "
        "{bias, d_ff, d_model, dropout, max_seq_len, n_head, n_layer, norm_eps, vocab_size}"
    )
    with pytest.raises(ModelError, match="argument 'foo' for hf:llama; valid: .*hidden_size"):
        build_model("hf:llama", {"foo": 1})


@pytest.mark.parametrize(
    "name, args, pattern",
    [
        ("gpt-mini", {"n_layer": "abc"}, "value 'abc' for model argument 'n_layer' of gpt-mini"),
        ("gpt-mini", {"bias": "maybe"}, "'bias' of gpt-mini: expected true/false"),
        ("gpt-mini", {"n_head": 5}, "d_model 128 is not divisible by n_head 5"),
        ("hf:llama", {"num_attention_heads": "x"}, "'num_attention_heads' of hf:llama: expected"),
        ("hf:llama", {"num_attention_heads": 5}, "cannot build hf:llama with model arguments"),
    ],
)
def test_bad_argument_values(name, args, pattern):
    with pytest.raises(ModelError, match=pattern):
        build_model(name, args)


def test_sequence_too_long_names_both_lengths():
    model, _ = build_model("gpt-tiny", {"max_seq_len": 8})
    materialize(model, seed=0)
    with pytest.raises(ModelError, match="sequence length 9 .* max_seq_len 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_missing_transformers_explains_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModelError) as err:
        build_model("hf:llama")
    assert str(err.value) == (
        "hf:llama needs the transformers package: pip install 'autopar[hf]' "
        "(or pip install transformers)"
    )
    build_model("gpt-tiny")  # GPT never needs transformers


def test_bad_vocab_size_and_device():
    with pytest.raises(ModelError, match="vocab_size must be a positive integer, got 0"):
        build_model("gpt-tiny", vocab_size=0)
    with pytest.raises(ModelError, match="invalid device 'nowhere'"):
        build_model("gpt-tiny", device="nowhere")
