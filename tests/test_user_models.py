"""Ordinary user modules, as people write them, train under pp=2 and tp=2 like one process.

Each case is compared with a world of one on the same global batches: losses within 1e-5
relative over 3 steps, the same eval loss, and the same parameters once tensor-parallel
slices are gathered (1e-5 absolute). The cases: a token model whose blocks sit in an
nn.Sequential (the README's style), a plain MLP that is itself an nn.Sequential, a ViT-shaped classifier with bare cls/position
parameters built on meta with an init method, the same ViT built for real (its bare
parameters meet the float images in one op: tracing used to mix meta and real devices), a U-Net with long skip connections built for
real on float images with a custom MSE loss, and a model with no stack at all under tp.
Models that cannot train are refused with a message naming the cause, on every rank: bare
parameters no rule initialises, and a loss that becomes NaN.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.errors import ModelError
from autopar.models import materialize, materialize_partial
from autopar.partition import partition
from autopar.trace import trace
from helpers import max_relative_difference
from user_models import BareViT, NoStackMlp, SequentialLM, TinyViT, error_of, train_user_model

_references: dict = {}


def reference(rank_pool, tmp_path_factory, kind: str) -> dict:
    if kind not in _references:
        out = str(tmp_path_factory.mktemp(f"reference-{kind}"))
        _references[kind] = rank_pool(1).run(train_user_model, kind, out)[0]
    return _references[kind]


def assert_matches(expected: dict, results: list[dict]) -> None:
    assert all(expected["finite"] and got["finite"] for got in results)
    for rank, got in enumerate(results):
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, expected["losses"], got["losses"])
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5, rank
        assert got["params"].keys() <= expected["params"].keys()
        for name, value in got["params"].items():
            assert (value - expected["params"][name]).abs().max() < 1e-5, (rank, name)


@pytest.mark.parametrize("kind,strategy", [
    ("sequential-lm", {"pp": 2}), ("sequential-lm", {"tp": 2}),
    ("root-sequential", {"pp": 2, "partition": "uniform"}),
    ("vit", {"pp": 2}), ("vit", {"tp": 2}),
    ("vit-real", {"pp": 2}), ("vit-real", {"tp": 2}),
    ("unet", {"pp": 2}), ("unet", {"tp": 2}),
    ("no-stack", {"tp": 2}),
], ids=lambda v: str(v))
def test_user_model_matches_one_process(rank_pool, tmp_path, tmp_path_factory, kind, strategy):
    expected = reference(rank_pool, tmp_path_factory, kind)
    results = rank_pool(2).run(train_user_model, kind, str(tmp_path), strategy=strategy)
    assert_matches(expected, results)
    whole = sum(v.numel() for v in expected["params"].values())
    held = [got["local_numel"] for got in results]
    if "pp" in strategy:  # each stage holds a real part of the model
        assert all(0 < n < whole for n in held) and sum(held) >= whole, (held, whole)
    elif kind in ("sequential-lm", "no-stack"):  # tp: the linears are really sliced
        assert all(n < 0.8 * whole for n in held), (held, whole)


def test_sequential_blocks_are_the_pipeline_blocks():
    with torch.device("meta"):
        model = SequentialLM(depth=3)
    graph = trace(model, (torch.zeros(2, 8, dtype=torch.long, device="meta"),))
    assert graph.layers_path == "blocks"
    assert [b.name for b in graph.blocks] == ["prelude", "blocks.0", "blocks.1", "blocks.2", "postlude"]
    stages = partition(graph, 2, method="uniform").specs
    assert stages[0].blocks[0] == "prelude" and stages[1].blocks[-1] == "postlude"
    assert all(any(name.startswith("blocks.") for name in stage.blocks) for stage in stages)


def test_a_model_without_a_stack_is_one_block_and_cannot_be_pipelined():
    with torch.device("meta"):
        model = NoStackMlp()
    graph = trace(model, (torch.zeros(4, 8, device="meta"),))
    assert graph.layers_path is None and [b.name for b in graph.blocks] == ["model"]
    assert partition(graph, 1).num_stages == 1
    with pytest.raises(ModelError, match="nn.ModuleList or an nn.Sequential"):
        partition(graph, 2)


def test_bare_parameters_without_an_init_rule_are_named():
    with torch.device("meta"):
        model = BareViT()
    for build in (lambda m: materialize(m, seed=0), lambda m: materialize_partial(m, {"head.weight"}, seed=0)):
        with pytest.raises(ModelError, match="'cls_token'.*'pos_embed'.*init_weights"):
            build(copy.deepcopy(model))


def test_meta_init_method_sets_bare_parameters_and_stages_equal_the_whole():
    with torch.device("meta"):
        model = TinyViT()
    whole = materialize(copy.deepcopy(model), seed=3)
    assert all(torch.isfinite(p).all() for p in whole.parameters())
    assert whole.pos_embed.std() > 0.01  # set by init_weights, not left at zero or NaN
    for keep in ({"cls_token", "pos_embed"}, {"blocks.1.fc_in.weight", "head.bias"}):
        part = materialize_partial(copy.deepcopy(model), keep, seed=3)
        for name in keep:  # same ops, same order, same generator state: bitwise
            assert torch.equal(part.get_parameter(name), whole.get_parameter(name)), name


def test_an_init_that_leaves_a_buffer_or_parameter_unwritten_is_named():
    class Partial(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))
            self.bias = torch.nn.Parameter(torch.zeros(3))
            self.register_buffer("causal", torch.ones(3, 3, dtype=torch.bool).tril())

        def _init_weights(self):
            self.scale.data.fill_(1.0)

    with torch.device("meta"):
        model = Partial()
    with pytest.raises(ModelError, match="'bias', buffer 'causal': the model's init leaves them unwritten"):
        materialize(model, seed=0)


def test_module_reset_methods_cover_torch_attention():
    with torch.device("meta"):
        model = torch.nn.TransformerEncoderLayer(8, 2, 16)
    materialize(model, seed=0)  # MultiheadAttention initialises through _reset_parameters
    assert model.self_attn.in_proj_weight.std() > 0.1


@pytest.mark.parametrize("kind,strategy,match", [
    ("vit-no-init", {"pp": 2}, "'cls_token', parameter 'pos_embed'"),
    ("vit-part-init", {"pp": 2}, "'cls_token', parameter 'pos_embed'.*unwritten"),
    ("nan", {"dp": 2}, "the loss is nan at step 1"),
    ("nan", {"tp": 2}, "the loss is nan at step 1"),
], ids=lambda v: str(v))
def test_untrainable_models_stop_with_a_message_on_every_rank(rank_pool, tmp_path, kind, strategy, match):
    import re
    messages = rank_pool(2).run(error_of, train_user_model, kind, str(tmp_path), strategy=strategy, timeout=120)
    for text in messages:
        assert re.search(match, text), text


def test_data_dependent_control_flow_gets_that_hint():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

        def forward(self, x):
            y = self.layers[0](x)
            if y.sum() > 0:
                return y
            return -y

    with pytest.raises(ModelError, match=r"branches on a tensor's values \(at .*test_user_models.py:\d+: if y.sum"):
        trace(Branchy(), (torch.zeros(2, 4),))
