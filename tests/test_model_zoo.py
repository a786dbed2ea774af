"""The model zoo: models as people build them train under dp=2, pp=2 and tp=2 to one process's losses.

Cases (tests/zoo_models.py, tests/zoo_families.py): 31 Hugging Face families from their
default configs (dropout and use_cache as they come; only widths, and ids a tiny vocabulary
needs, set) with padded batches and attention masks (left-padded causal LMs with Hugging
Face's labels, masked LMs with padding and BERT's token_type_ids, T5 and BART with decoder
inputs and both masks, Whisper on log-mel features, ViT and CLIP's vision tower on images;
mixtures of experts (Mixtral, Qwen2-MoE) with every expert on every rank, Mamba); and 11
user modules (a Sequential
stack, a ViT with bare parameters initialised by its reset_parameters, a U-Net on float
images with an MSE loss, a classifier with its own loss, a model with two tensor inputs, a
model whose blocks differ, a nanoGPT-style GPT with tied weights and constructor init
(replayed on meta), a llama with nn.ModuleDict layers and rotary tables made in forward,
blocks held as attributes, torch's nn.TransformerEncoder at its default dropout, a
fine-tune with a frozen embedding and first block).

Every case is built both ways users build models: on meta (autopar materialises it) and for
real (seeded, on CPU, the README's default); a case that has only one build says why in the
table. Each trains 2 steps of 8 samples through autopar.Trainer with dropout on. The
reference is one process on one micro-batch of 8, computed once per case and build (the two
builds initialise differently, so each is compared with its own reference); the layouts run
2 micro-batches of 4 on 2 ranks (dp2: one of 4 per replica), and two cases also run dp2 x
tp2 x pp2 on 8 ranks. Dropout masks are promised to depend on the sample and the operation
only, so every layout must equal one process: losses within 1e-5 relative. All cases of one
layout train in one task of the rank pool (starting a task costs more than a tiny model's
steps). The runs leave out what costs more than their steps and touches nothing compared here:
the FLOP count for MFU (tests/test_run_logs.py) and, where the state is whole on every rank (one
process, dp2), the final checkpoint (tests/test_checkpoint.py); tp2, pp2, 3-D and ZeRO-3 save. Models that autopar must refuse get a test that the refusal is a clear autopar
error, raised on every rank before the first step.
"""

from __future__ import annotations

import math

import pytest
import torch

from zoo_models import CASES
from zoo_training import refusal, train_cases

LAYOUTS = {"dp2": {"dp": 2}, "pp2": {"pp": 2}, "tp2": {"tp": 2}}
MICRO = 4  # two micro-batches per step under pp2 and tp2, one per replica under dp2
LOSS_RTOL = 1e-5
# After Adam's first steps an update is about lr * sign(gradient), so a gradient that is zero up
# to rounding (a pad token's embedding row) may move by a fraction of lr = 1e-3 one way or the
# other; 1e-4 still catches any real difference.
PARAM_ATOL = 1e-4
# Gradient norms (before clipping) of every step, as rank 0 logs them: fp32 sums of squares in another order,
# so a few ulps apart; a gradient scaled wrongly (the whole of it, which Adam's update hides) is off by far more.
GRAD_NORM_RTOL = 1e-4
THREE_D = {"dp": 2, "tp": 2, "pp": 2}
THREE_D_JOBS = [("hf:llama", "real"), ("nanogpt", "real")]
THREE_D_MICRO = 2  # 4 samples per replica: two micro-batches through its pipeline

# (case, build, layout) -> why it fails today, for a construct another part of autopar owns; each is
# a strict xfail, so the fix that makes it pass must remove it here.
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}

JOBS = [(name, build) for name, case in CASES.items() for build in case.builds]
_references: dict = {}
_batches: dict = {}


def _selected_jobs(request, layout: str) -> list[tuple[str, str]]:
    """The (case, build) pairs of this run's selected tests for `layout` (all of them without -k)."""
    wanted = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.originalname == request.node.originalname and params.get("layout") == layout:
            wanted.add((params["name"], params["build"]))
    return sorted(wanted)


def references(rank_pool, tmp_path_factory, jobs: list[tuple[str, str]]) -> dict:
    """The one-process reference of each (case, build); those not yet computed trained in one task."""
    missing = [job for job in jobs if job not in _references]
    if missing:
        out = str(tmp_path_factory.mktemp("zoo-reference"))
        _references.update(rank_pool(1).run(train_cases, missing, out, timeout=600)[0])
    return {job: _references[job] for job in jobs}


def batch(rank_pool, tmp_path_factory, request, layout: str) -> dict:
    """Every selected (case, build) of `layout` trained on 2 ranks in one task, once: job -> per-rank results."""
    if layout not in _batches:
        jobs = _selected_jobs(request, layout)
        out = str(tmp_path_factory.mktemp(f"zoo-{layout}"))
        try:
            results = rank_pool(2).run(train_cases, jobs, out, strategy=LAYOUTS[layout], micro_batch_size=MICRO,
                                       timeout=600)
            _batches[layout] = {job: [r[job] for r in results] for job in jobs}
        except (AssertionError, TimeoutError) as exc:  # the whole task failed: every case of it says so, once
            _batches[layout] = exc
    if isinstance(_batches[layout], Exception):
        raise AssertionError(f"the {layout} task failed as a whole: {_batches[layout]}")
    return _batches[layout]


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def assert_trained(got: dict, what) -> None:
    assert "error" not in got, f"{what}: {got.get('error')}"


def assert_matches_reference(expected: dict, results: list[dict]) -> None:
    for rank, got in enumerate(results):
        assert_trained(got, f"rank {rank}")
        assert relative_difference(expected["losses"], got["losses"]) < LOSS_RTOL, \
            (rank, expected["losses"], got["losses"])
        norms = [(a, b) for a, b in zip(expected.get("grad_norms") or [], got.get("grad_norms") or [])
                 if a is not None and b is not None]
        assert all(abs(a - b) <= GRAD_NORM_RTOL * max(abs(a), 1e-12) for a, b in norms), \
            (rank, expected.get("grad_norms"), got.get("grad_norms"))
        assert got["params"], rank
        for key, value in got["params"].items():  # pp: this rank's stage; tp: slices gathered
            want = expected["params"][key]
            assert value.shape == want.shape, (rank, key, value.shape, want.shape)
            assert (value.float() - want.float()).abs().max() < PARAM_ATOL, (rank, key)


def assert_tp_replicas_bitwise(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for key in first:
        # Bitwise: both tp ranks hold the same whole tensor after gathering; a replicated
        # parameter gets the same all-reduced gradient and the same update on each rank, so
        # any difference is drift (e.g. dropout masks drawn per rank on replicated values).
        assert torch.equal(first[key], second[key]), \
            (key, float((first[key].float() - second[key].float()).abs().max()))


def _params():
    for name, build in JOBS:
        for layout in LAYOUTS:
            why = KNOWN_FAILURES.get((name, build, layout))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            yield pytest.param(name, build, layout, id=f"{name}-{build}-{layout}", marks=marks)


# The first test of each layout trains the whole batch (and the first one, every reference):
# 134 s measured at load average 35 on 2 cores.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,build,layout", list(_params()))
def test_zoo_layout_matches_single_process(rank_pool, tmp_path_factory, request, name, build, layout):
    every_layouts_jobs = sorted({job for each in LAYOUTS for job in _selected_jobs(request, each)})
    expected = references(rank_pool, tmp_path_factory, every_layouts_jobs)[name, build]
    assert_trained(expected, "the one-process reference")
    assert all(math.isfinite(x) for x in expected["losses"]), ("the one-process reference itself", expected["losses"])
    results = batch(rank_pool, tmp_path_factory, request, layout)[name, build]
    assert_matches_reference(expected, results)
    if layout == "tp2":
        assert_tp_replicas_bitwise(results[0]["params"], results[1]["params"])


@pytest.mark.timeout(600)  # 8 ranks on 2 cores: 137-169 s measured at load average 35-50
def test_zoo_3d_matches_single_process(rank_pool, tmp_path, tmp_path_factory):
    """dp2 x tp2 x pp2 on 8 ranks: a Hugging Face causal LM and the nanoGPT-style module."""
    expected = references(rank_pool, tmp_path_factory, THREE_D_JOBS)
    results = rank_pool(8).run(train_cases, THREE_D_JOBS, str(tmp_path), strategy=THREE_D,
                               micro_batch_size=THREE_D_MICRO, timeout=600)
    for job in THREE_D_JOBS:
        assert_trained(expected[job], (job, "the one-process reference"))
        assert_matches_reference(expected[job], [r[job] for r in results])
        # ranks 2k and 2k+1 are one tp pair (tp innermost): same stage, same replica
        for first in range(0, 8, 2):
            assert_tp_replicas_bitwise(results[first][job]["params"], results[first + 1][job]["params"])


ZERO3_JOBS = [("hf:t5", "meta"), ("hf:t5", "real"), ("llama-module-dict", "real")]


def test_zoo_zero3_matches_single_process(rank_pool, tmp_path, tmp_path_factory):
    """ZeRO-3 (FSDP2 units per layer of the stacks found) on dp2: an encoder-decoder with a shared embedding
    and nested per-block ModuleLists (once refused by FSDP2 as overlapping units), and ModuleDict layers."""
    expected = references(rank_pool, tmp_path_factory, ZERO3_JOBS)
    results = rank_pool(2).run(train_cases, ZERO3_JOBS, str(tmp_path), strategy={"dp": 2, "zero": 3},
                               micro_batch_size=MICRO, timeout=300)
    for job in ZERO3_JOBS:
        assert_trained(expected[job], (job, "the one-process reference"))
        assert_matches_reference(expected[job], [r[job] for r in results])


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


def test_meta_nanogpt_with_constructor_init_is_refused(rank_pool, tmp_path):
    """nanoGPT-style init in the constructor (apply(_init_weights), then c_proj re-drawn by name) on
    meta with no init_fn: refused with a clear error naming the ways that work, rather than trained on
    a half-done init (CASES["nanogpt"] trains its meta build with replay_init)."""
    results = rank_pool(1).run(refusal, "nanogpt", str(tmp_path), timeout=300)
    assert_refused_early(results, "nothing would set", "init_fn", "replay_init")


def test_a_case_with_one_build_says_why():
    one_way = {name: case for name, case in CASES.items() if case.only is not None}
    assert all(case.why and case.only in ("meta", "real") for case in one_way.values()), one_way
