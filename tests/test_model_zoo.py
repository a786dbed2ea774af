"""The model zoo: models as people build them train under pp=2 and tp=2 to one process's losses.

Cases (tests/zoo_models.py): 13 Hugging Face families from their default configs (dropout
and use_cache as they come; only widths, and ids a tiny vocabulary needs, set), on meta,
with padded batches and attention masks (left-padded causal LM, masked LM with padding and
BERT's token_type_ids, T5 with decoder inputs and both masks); and 6 user modules (a
Sequential stack, a ViT with bare parameters initialised by its reset_parameters, a U-Net
built for real on float images with an MSE loss, a classifier with its own loss, a model
with two tensor inputs, a model whose blocks differ).

Each case trains 2 steps of 8 samples through autopar.Trainer with dropout on. The
reference is one process on one micro-batch of 8, computed once per case and reused by both
layouts; the layouts run 2 micro-batches of 4 on 2 ranks. Dropout masks are promised to
depend on the sample and the operation only, so every layout must equal one process:
losses within 1e-5 relative. Models that autopar must refuse get a test that the refusal
is a clear autopar error, raised on every rank before the first step.
"""

from __future__ import annotations

import math

import pytest
import torch

from zoo_models import CASES, refusal, train_case

LAYOUTS = {"pp2": {"pp": 2}, "tp2": {"tp": 2}}
MICRO = 4  # two micro-batches per step under each layout
LOSS_RTOL = 1e-5
# After Adam's first steps an update is about lr * sign(gradient), so a gradient that is zero up
# to rounding (a pad token's embedding row) may move by a fraction of lr = 1e-3 one way or the
# other; 1e-4 still catches any real difference.
PARAM_ATOL = 1e-4
_references: dict = {}


def reference(rank_pool, tmp_path_factory, name: str) -> dict:
    if name not in _references:
        out = str(tmp_path_factory.mktemp("zoo-reference"))
        _references[name] = rank_pool(1).run(train_case, name, out, timeout=300)[0]
    return _references[name]


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(CASES))
def test_zoo_layout_matches_single_process(rank_pool, tmp_path, tmp_path_factory, name, layout):
    expected = reference(rank_pool, tmp_path_factory, name)
    assert all(math.isfinite(x) for x in expected["losses"]), ("the one-process reference itself", expected["losses"])
    results = rank_pool(2).run(train_case, name, str(tmp_path), strategy=LAYOUTS[layout], micro_batch_size=MICRO,
                               timeout=300)
    for rank, got in enumerate(results):
        assert relative_difference(expected["losses"], got["losses"]) < LOSS_RTOL, \
            (rank, expected["losses"], got["losses"])
        assert got["params"], rank
        for key, value in got["params"].items():  # pp: this rank's stage; tp: slices gathered
            want = expected["params"][key]
            assert value.shape == want.shape, (rank, key, value.shape, want.shape)
            assert (value.float() - want.float()).abs().max() < PARAM_ATOL, (rank, key)
    if layout == "tp2":
        first, second = (r["params"] for r in results)
        assert first.keys() == second.keys()
        for key in first:
            # Bitwise: both tp ranks hold the same whole tensor after gathering; a replicated
            # parameter gets the same all-reduced gradient and the same update on each rank, so
            # any difference is drift (e.g. dropout masks drawn per rank on replicated values).
            assert torch.equal(first[key], second[key]), \
                (key, float((first[key].float() - second[key].float()).abs().max()))


def assert_refused_early(results: list[dict], *words: str) -> None:
    for rank, got in enumerate(results):
        assert got["error"] is not None, f"rank {rank} trained instead of refusing"
        assert got["autopar_error"], (rank, got["error"], got["message"])
        assert not got["stepped"], (rank, "a step ran before the error")
        message = got["message"].lower()
        assert all(w.lower() in message for w in words), (rank, words, got["message"])


@pytest.mark.parametrize("world,strategy", [(1, {}), (2, {"pp": 2}), (2, {"tp": 2})], ids=["single", "pp2", "tp2"])
def test_bare_parameter_without_init_is_refused(rank_pool, tmp_path, world, strategy):
    """A model on meta whose bare parameters no init covers: never NaN losses and "done"."""
    results = rank_pool(world).run(refusal, "vit-without-init", str(tmp_path), strategy=strategy,
                                   micro_batch_size=MICRO if world > 1 else 8, timeout=300)
    assert_refused_early(results, "cls_token")


def test_tp_that_does_not_divide_heads_is_refused(rank_pool, tmp_path):
    """The README: a tp that does not divide the heads is a clear error."""
    results = rank_pool(2).run(refusal, "hf:gpt2-3-heads", str(tmp_path), strategy={"tp": 2},
                               micro_batch_size=MICRO, timeout=300)
    assert_refused_early(results, "head", "3")
