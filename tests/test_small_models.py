"""The smallest models a user tries first, and oddly shaped ones, under pp=2 and tp=2 like one process.

A plain nn.Sequential of two Linears with a GELU between them (built for real, on meta, and on meta
with an init_fn), one ending in log_softmax, one starting with an activation, one with a block whose
only state is a buffer: losses within 1e-5 relative over 2 steps, the same eval loss, the same
parameters (tp slices gathered). Parameter-free blocks (an activation, a log_softmax, an empty
prelude or postlude) never form a pipeline stage alone: the partitioner joins them to a
neighbour, and refuses more stages than blocks with parameters. Stages cut by hand anywhere
(no parameters at all, first, middle or last; a buffer only) still equal the whole model: a
stage is materialised on the device it is given, never on one guessed from a parameter.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from autopar.errors import ConfigError
from autopar.models import materialize, materialize_partial
from autopar.partition import partition
from autopar.partition.stages import StageModule, materialize_stage, plan_stages
from autopar.pipeline.build import check_stage_count
from autopar.trace import trace
from helpers import max_relative_difference
from small_models import FEATURES, build, train_small_models

CASES = [("mlp-real", {"pp": 2}), ("mlp", {"pp": 2}), ("mlp-init-fn", {"pp": 2}), ("log-softmax", {"pp": 2}),
         ("buffer", {"pp": 2, "partition": "parameters"}), ("mlp", {"tp": 2}), ("log-softmax", {"tp": 2})]


def traced(kind: str):
    model = build(kind)
    return model, trace(model, (torch.zeros(4, FEATURES, device="meta"),))


@pytest.mark.parametrize("kind", ["mlp", "log-softmax", "activation-first", "buffer"])
def test_every_stage_holds_a_block_with_parameters(kind):
    _, graph = traced(kind)
    for method in ("time", "parameters", "uniform"):
        specs = partition(graph, 2, method=method).specs
        assert all(spec.params for spec in specs), (method, [s.blocks for s in specs])
        assert specs[0].blocks[0] == "prelude" and specs[-1].blocks[-1] == "postlude"
    for pp, chunks in ((3, 1), (4, 1), (2, 2)):
        asked = f"pp={pp} x chunks=2 = 4 stages" if chunks > 1 else f"pp={pp} stages"
        with pytest.raises(ConfigError, match=rf"{asked}, but the model has only 2 parameterised blocks "
                                              rf"\(\d, \d\): every stage needs one.*use at most 2 stages \(pp <= 2\)"):
            check_stage_count(graph, pp, chunks)
        if chunks == 1:
            with pytest.raises(ConfigError, match="only 2 parameterised blocks"):
                partition(graph, pp)


@pytest.mark.parametrize("kind,bounds", [
    ("buffer", [0, 1, 2, 3, 4, 6]),  # [prelude] alone, [Linear], [Scale: a buffer only], [GELU], [Linear, postlude]
    ("log-softmax", [0, 2, 4, 6]),  # the last stage: log_softmax alone
    ("activation-first", [0, 2, 4, 6]),  # the first stage: an activation alone
])
def test_stages_cut_anywhere_equal_the_whole_model(kind, bounds):
    model, graph = traced(kind)
    whole = materialize(copy.deepcopy(model), seed=3)
    specs = plan_stages(graph, bounds)
    assert any(not spec.params for spec in specs)
    stages = []
    for spec in specs:  # each from a model where only its own parameters (maybe none) were materialised
        source = materialize_partial(copy.deepcopy(model), set(spec.params), "cpu", seed=3)
        stages.append(materialize_stage(StageModule(graph, spec, len(specs)), source, "cpu"))
    x = torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(1))
    values = (x,)
    for stage in stages[:-1]:
        values = stage(*values)
    out = stages[-1](*values)
    expected = whole(x)
    assert torch.allclose(out, expected, rtol=0, atol=1e-6)
    out.square().sum().backward()
    expected.square().sum().backward()
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.allclose(p.grad, whole.get_parameter(name).grad, rtol=0, atol=1e-6), name
        for name, b in stage.named_buffers():
            assert torch.equal(b, whole.get_buffer(name)), name


def test_small_models_match_one_process(rank_pool, tmp_path):
    kinds = sorted({kind for kind, _ in CASES})
    expected = dict(zip(kinds, rank_pool(1).run(train_small_models, [(k, {}) for k in kinds], str(tmp_path / "one"))[0]))
    per_rank = rank_pool(2).run(train_small_models, CASES, str(tmp_path / "two"))
    for i, (kind, strategy) in enumerate(CASES):
        want, whole = expected[kind], sum(v.numel() for v in expected[kind]["params"].values())
        for rank, results in enumerate(per_rank):
            got = results[i]
            assert isinstance(got, dict), (kind, strategy, rank, got)
            assert want["finite"] and got["finite"], (kind, strategy)
            assert max_relative_difference(want["losses"], got["losses"]) < 1e-5, (kind, strategy, rank)
            assert abs(want["eval_loss"] - got["eval_loss"]) / want["eval_loss"] < 1e-5, (kind, strategy, rank)
            assert got["params"].keys() <= want["params"].keys()
            for name, value in got["params"].items():
                assert (value - want["params"][name]).abs().max() < 1e-5, (kind, strategy, rank, name)
            assert 0 < got["local_numel"] < whole, (kind, strategy, rank)  # a real stage, a real slice
