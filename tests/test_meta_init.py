"""A model whose constructor initialises it (nanoGPT style), built on meta, trains under every layout.

tests/nanogpt_style.py: `__init__` runs `apply(_init_weights)`, then re-initialises `c_proj.weight`
by name; its LayerNorms hold bare parameters. On meta no rule autopar follows can reproduce that, so
without help it is refused with a message naming the ways that work. With
`init_fn=autopar.replay_init(lambda: GPT(config))` every layout (one process, dp2, pp2, tp2) trains to
the losses of the model built for real after `torch.manual_seed(seed)`; with a user's init function,
to one process with that function.
"""

from __future__ import annotations

import math

import pytest
import torch

import nanogpt_style as cases
from autopar.errors import ModelError
from autopar.models.materialize import attach_init_fn, materialize, materialize_partial, replay_init

LOSS_RTOL = 1e-5
_reference: dict = {}


def relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 2, (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def reference(rank_pool, tmp_path_factory) -> dict:
    if not _reference:
        _reference.update(rank_pool(1).run(cases.train_many, ["real", "replay", "init_fn", "no_init"],
                                           str(tmp_path_factory.mktemp("one")), micro_batch_size=8, timeout=300)[0])
    return _reference


def test_replay_gives_the_constructors_values():
    """Every tensor bit-identical to the model built for real from the seed, whole or only a stage's share."""
    real = dict(cases.for_real().named_parameters())
    whole = cases.on_meta()
    attach_init_fn(whole, replay_init(lambda: cases.GPT(cases.GPTConfig())))
    whole = materialize(whole, seed=cases.SEED)
    for name, p in whole.named_parameters():
        assert torch.equal(p, real[name]), name
    assert whole.lm_head.weight is whole.transformer.wte.weight  # still tied
    std = float(whole.transformer.h[0].mlp.c_proj.weight.detach().std())  # the by-name re-init, kept
    assert abs(std - 0.02 / math.sqrt(4)) < 0.003, std
    keep = {"transformer.h.1.attn.c_proj.weight", "transformer.h.1.ln_2.weight"}
    part = cases.on_meta()
    attach_init_fn(part, replay_init(lambda: cases.GPT(cases.GPTConfig())))
    part = materialize_partial(part, keep, seed=cases.SEED)
    for name, p in part.named_parameters():
        assert p.is_meta == (name not in keep), name
        if name in keep:
            assert torch.equal(p, real[name]), name


def test_init_fn_that_misses_a_tensor_is_named():
    model = cases.on_meta()
    attach_init_fn(model, lambda m: m.apply(m._init_weights))  # forgets the LayerNorms
    with pytest.raises(ModelError, match="ln_1.weight.*init_fn leaves"):
        materialize(model, seed=0)
    with pytest.raises(ModelError, match="real weights"):
        attach_init_fn(cases.for_real(), cases.user_init)


def test_one_process(rank_pool, tmp_path_factory):
    got = reference(rank_pool, tmp_path_factory)
    assert relative(got["replay"]["losses"], got["real"]["losses"]) < LOSS_RTOL, got
    assert "losses" in got["init_fn"], got["init_fn"]
    refused = got["no_init"]
    assert refused["error"] == "ModelError", refused
    for words in ("ln_1.weight", "init_fn=autopar.replay_init(lambda: GPT(...))", "init_fn=a function"):
        assert words in refused["message"], (words, refused["message"])


@pytest.mark.parametrize("layout", [{"dp": 2}, {"pp": 2}, {"tp": 2}], ids=["dp2", "pp2", "tp2"])
def test_layouts_match_one_process(rank_pool, tmp_path, tmp_path_factory, layout):
    want = reference(rank_pool, tmp_path_factory)
    results = rank_pool(2).run(cases.train_many, ["replay", "init_fn"], str(tmp_path), strategy=layout,
                               micro_batch_size=4, timeout=300)
    for rank, got in enumerate(results):
        assert relative(got["replay"]["losses"], want["real"]["losses"]) < LOSS_RTOL, (rank, got, want)
        assert relative(got["init_fn"]["losses"], want["init_fn"]["losses"]) < LOSS_RTOL, (rank, got, want)
