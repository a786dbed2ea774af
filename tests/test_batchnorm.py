"""BatchNorm's running statistics under dp, pp and tp equal one process's (autopar/running_stats).

The reference is one process over the same micro-batches: global batch 8, micro-batches of 2,
so 4 micro-batches accumulated per step, in order. A layout splits that global batch as the
sampler does (data/sampler.py): replica r of dp takes the contiguous micro-batches
r * (4 / dp) ... and a pipeline runs all of its replica's micro-batches through every stage.
Forward normalisation uses each micro-batch's own statistics, so the losses match; the running
buffers must too, and so the eval loss (eval mode reads them) and the saved model.

Models (tests/bn_models.py): a CNN with BatchNorm2d in an nn.Sequential of residual blocks,
on meta and built for real, and an MLP with BatchNorm1d (one of them momentum=None, the
cumulative average).
"""

from __future__ import annotations

import math

import pytest
import torch

from bn_models import refusal, train_many

LOSS_RTOL = 1e-5
# The running statistics are replayed from each micro-batch's (mean, unbiased variance) as the
# kernel computed them, rounded to fp32; torch's CPU kernel keeps its variance sum a little more
# precisely inside the update, so a replayed buffer may differ from one process's in the last bits.
STATS_RTOL, STATS_ATOL = 1e-5, 1e-6
MODELS = ("cnn-meta", "cnn-real", "mlp-meta")
LAYOUTS = {"dp2": {"dp": 2}, "pp2": {"pp": 2}, "tp2": {"tp": 2}}
_references: list = []


def references(rank_pool, tmp_path_factory) -> list[dict]:
    """One process over the same micro-batches, per model of MODELS (trained once, shared by the tests)."""
    if not _references:
        out = tmp_path_factory.mktemp("bn-reference")
        _references.extend(rank_pool(1).run(train_many, [(m, str(out / m), {}) for m in MODELS], timeout=300)[0])
    return _references


def _compare(expected: dict, got: dict, where: str, *, whole: bool) -> None:
    assert all(math.isfinite(x) for x in expected["losses"]), expected["losses"]
    for want, have in zip(expected["losses"], got["losses"], strict=True):
        assert abs(want - have) <= LOSS_RTOL * abs(want), (where, expected["losses"], got["losses"])
    if whole:  # dp and tp: every rank holds every buffer (pp: its stage's; the caller checks they add up)
        assert got["buffers"].keys() == expected["buffers"].keys(), where
    for key, value in got["buffers"].items():
        want = expected["buffers"][key]
        if key.endswith("num_batches_tracked"):
            assert torch.equal(value, want), (where, key, value, want)
        else:
            torch.testing.assert_close(value, want, rtol=STATS_RTOL, atol=STATS_ATOL, msg=f"{where}: {key}")
    assert abs(expected["eval_loss"] - got["eval_loss"]) <= LOSS_RTOL * abs(expected["eval_loss"]), \
        (where, expected["eval_loss"], got["eval_loss"])


def test_running_statistics_match_one_process(rank_pool, tmp_path, tmp_path_factory):
    reference = references(rank_pool, tmp_path_factory)
    for ref in reference:  # the reference itself tracked every micro-batch: 2 steps x 4 micro-batches
        counts = [int(v) for k, v in ref["buffers"].items() if k.endswith("num_batches_tracked")]
        assert counts and all(c == 8 for c in counts), counts
    cases = [(m, str(tmp_path / f"{layout}-{m}"), strategy) for layout, strategy in LAYOUTS.items() for m in MODELS
             if not (layout == "tp2" and m == "cnn-real")]  # a model built for real: dp and pp cover it
    # recomputation runs a stage's forward again (its statistics are recorded once per micro-batch)
    cases.append(("cnn-meta", str(tmp_path / "pp2-recompute"), {"pp": 2, "recompute": "all"}))
    # ZeRO-3 (FSDP2, its own engine) needs an optimizer with state; the CNN has no bias before a norm, whose
    # gradient, zero up to rounding, Adagrad would turn into a full step either way
    zero3 = ("cnn-meta", str(tmp_path / "zero3"), {"dp": 2, "zero": 3}, 2, "adagrad")
    zero3_reference = rank_pool(1).run(train_many, [("cnn-meta", str(tmp_path / "one-adagrad"), {}, 2, "adagrad")],
                                       timeout=300)[0][0]
    results = rank_pool(2).run(train_many, cases + [zero3], timeout=600)
    for rank, per_rank in enumerate(results):
        _compare(zero3_reference, per_rank.pop(), f"zero3 rank {rank}", whole=True)
    for rank, per_rank in enumerate(results):
        for (model, _, strategy), got in zip(cases, per_rank, strict=True):
            expected = reference[MODELS.index(model)]
            _compare(expected, got, f"{model} {strategy} rank {rank}", whole=strategy.get("pp", 1) == 1)
    for (model, _, strategy), *per_rank in zip(cases, *results, strict=True):
        held = {key for got in per_rank for key in got["buffers"]}
        assert held == reference[MODELS.index(model)]["buffers"].keys(), (model, strategy)
    for (model, _, strategy), first, second in zip(cases, results[0], results[1], strict=True):
        if strategy.get("pp", 1) == 1:  # replicas (and tp ranks) hold one process's buffers, bitwise alike
            for key in first["buffers"]:
                assert torch.equal(first["buffers"][key], second["buffers"][key]), (model, strategy, key)


def test_running_statistics_dp2_pp2(rank_pool, tmp_path, tmp_path_factory):
    """dp x pp: each stage's replicas gather their micro-batches' statistics, in the global order; with
    --batchnorm sync and one micro-batch of 4 per replica, the stages normalise the global batch of 8 together."""
    reference = references(rank_pool, tmp_path_factory)[MODELS.index("cnn-meta")]
    whole_batch = rank_pool(1).run(train_many, [("cnn-meta", str(tmp_path / "one-8"), {}, 8)], timeout=300)[0][0]
    cases = [("cnn-meta", str(tmp_path / "dp2pp2"), {"dp": 2, "pp": 2}),
             ("cnn-meta", str(tmp_path / "dp2pp2-sync"), {"dp": 2, "pp": 2, "batchnorm": "sync"}, 4)]
    results = rank_pool(4).run(train_many, cases, timeout=300)
    for rank, (exact, sync) in enumerate(results):
        _compare(reference, exact, f"dp2 pp2 rank {rank}", whole=False)
        _compare(whole_batch, sync, f"dp2 pp2 sync rank {rank}", whole=False)
    for case in range(2):
        assert {key for per_rank in results for key in per_rank[case]["buffers"]} == reference["buffers"].keys()


@pytest.mark.parametrize("strategy", [{"dp": 2}, {"pp": 2}], ids=["dp2", "pp2"])
def test_instance_norm_with_running_statistics_is_refused(rank_pool, tmp_path, strategy):
    for got in rank_pool(2).run(refusal, "instance-norm", str(tmp_path), strategy, timeout=300):
        assert got["autopar_error"], got
        assert "norm" in got["message"] and "InstanceNorm2d" in got["message"], got["message"]


@pytest.mark.parametrize("strategy", [{"dp": 2}, {"pp": 2}], ids=["dp2", "pp2"])
def test_batchnorm_called_twice_in_a_forward_is_refused(rank_pool, tmp_path, strategy):
    """One process updates the statistics once per call; the replay keeps one call per micro-batch, so a
    shared BatchNorm must be refused on every rank, never replayed once (dp: at its second call in the
    first step; pp: when the model is traced, before any step)."""
    for got in rank_pool(2).run(refusal, "shared-norm", str(tmp_path), strategy, timeout=300):
        assert got["autopar_error"], got
        message = got["message"]
        assert "blocks.0.norm" in message and ("more than once" in message or "2 times" in message), message


def test_synchronised_statistics_match_one_process_on_the_whole_batch(rank_pool, tmp_path):
    """--batchnorm sync: with one micro-batch of 4 per replica, dp2 normalises the global batch of 8 as one
    process running it as a single micro-batch does (forward, backward and running statistics)."""
    models = ("cnn-meta", "mlp-meta")
    reference = rank_pool(1).run(train_many, [(m, str(tmp_path / f"one-{m}"), {}, 8) for m in models],
                                 timeout=300)[0]
    cases = [(m, str(tmp_path / f"sync-{m}"), {"dp": 2, "batchnorm": "sync"}, 4) for m in models]
    results = rank_pool(2).run(train_many, cases, timeout=300)
    for rank, per_rank in enumerate(results):
        for model, expected, got in zip(models, reference, per_rank, strict=True):
            _compare(expected, got, f"sync {model} rank {rank}", whole=True)
    for first, second in zip(*results, strict=True):
        for key in first["buffers"]:
            assert torch.equal(first["buffers"][key], second["buffers"][key]), key
    exact = rank_pool(2).run(train_many, [("cnn-meta", str(tmp_path / "exact"), {"dp": 2}, 4)], timeout=300)[0][0]
    assert abs(exact["losses"][0] - reference[0]["losses"][0]) > 1e-3, "sync must differ from exact statistics"


def test_unknown_batchnorm_mode_is_refused(rank_pool, tmp_path):
    got = rank_pool(1).run(refusal, "cnn-meta", str(tmp_path), {}, batchnorm="global", timeout=300)[0]
    assert got["autopar_error"], got
    assert "batchnorm" in got["message"] and "exact" in got["message"] and "global" in got["message"], got


class _CountingNet(torch.nn.Module):
    """A forward that updates a buffer of its own in place (a step counter): not a BatchNorm."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(inputs)


def test_traced_forward_that_updates_another_buffer_is_refused():
    """pp and tp trace the model: a buffer updated in place would be updated per stage copy, so it is refused."""
    from autopar.errors import ModelError
    from autopar.trace import trace
    with pytest.raises(ModelError, match="calls"):
        trace(_CountingNet().train(), (torch.zeros(2, 4),))


@pytest.mark.parametrize("strategy,world,words", [
    ({"dp_mode": "gossip"}, 2, ("stem.1", "BatchNorm2d", "gossip")),
    ({"dp_mode": "async"}, 3, ("BatchNorm2d", "parameter-server")),
    ({"tp": 2, "tp_subbatches": 2}, 2, ("BatchNorm2d", "--tp-subbatches")),
], ids=["gossip", "async", "tp-subbatches"])
def test_batchnorm_under_layouts_that_cannot_keep_its_statistics_is_refused(strategy, world, words):
    """Checked in strategies.resolve (on every rank, and in the launcher): before any process group or step."""
    import autopar
    from autopar.strategies import resolve
    from bn_models import SmallCNN
    config = autopar.TrainConfig(steps=1, global_batch_size=8, micro_batch_size=2, optimizer="sgd")
    with pytest.raises(autopar.AutoparError) as caught:
        resolve(autopar.Strategy(**strategy), config, world, model=SmallCNN())
    assert all(w in str(caught.value) for w in words), str(caught.value)


def test_sync_batchnorm_module_is_refused_where_statistics_would_differ():
    import autopar
    from autopar.strategies import resolve
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.SyncBatchNorm(4))
    config = autopar.TrainConfig(steps=1, global_batch_size=8, micro_batch_size=2)
    with pytest.raises(autopar.AutoparError, match="SyncBatchNorm"):
        resolve(autopar.Strategy(dp=2), config, 2, model=model)
    resolve(autopar.Strategy(), config, 1, model=model)  # one process: its statistics are the reference
