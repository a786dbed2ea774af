"""`autopar reproduce merak`: the Merak step-model terms, the billion-parameter presets, a reduced study."""

from __future__ import annotations

import json

import pytest

from autopar.models import build_model
from autopar.reproduce.merak import main
from autopar.reproduce.merak_model import (ABLATION, MERAK_ROW, Degrees, MerakStepModel, Techniques, candidate,
                                           degree_choices, overlap_time)
from autopar.search.cluster import resolve_cluster
from autopar.search.cost import StepModel
from autopar.search.profile import profile_model


@pytest.fixture(scope="module")
def profile():
    return profile_model("gpt-2.5b", seq_len=1024, tp_degrees=(1, 2, 4), vocab_size=50304, layers=54)


def test_billion_presets_build_on_meta_with_their_sizes():
    expected = {"gpt-1.5b": 1.56e9, "gpt-20b": 20.26e9}  # (test_models builds every preset on meta too)
    for name, params in expected.items():
        model, info = build_model(name, vocab_size=50304)
        assert all(p.is_meta for p in model.parameters())
        assert abs(info.num_params - params) / params < 0.005, (name, info.num_params)


def test_overlap_time_bounds():
    segments = [(1.0, 8.0), (2.0, 8.0), (0.5, 0.0), (1.5, 8.0)]

    def reduce_of(nbytes):
        return 0.1 + nbytes / 10

    serial = sum(c + (reduce_of(n) if n else 0.0) for c, n in segments)
    assert overlap_time(segments, 1, reduce_of, kernel_s=0.0) == pytest.approx(serial, rel=1e-12)
    two = overlap_time(segments, 2, reduce_of, kernel_s=0.0)
    compute = sum(c for c, _ in segments)
    comm = sum(2 * reduce_of(n / 2) for _, n in segments if n)
    assert max(compute, comm) < two < serial  # hides part of the communication, never all of it
    # each copy's launch cost delays the compute stream by at most its sum (a max-plus system is monotone)
    assert two < overlap_time(segments, 2, reduce_of, kernel_s=0.01) <= two + 0.01 * 2 * len(segments) + 1e-12


def test_no_techniques_prices_exactly_like_the_step_model(profile):
    cluster = resolve_cluster("rtx3090-24gb-pcie", nproc=64)
    base = StepModel(profile, cluster, global_batch_size=256, dtype="bf16")
    plain = MerakStepModel(profile, cluster, global_batch_size=256, dtype="bf16", techniques=Techniques(), hidden=1920)
    d = Degrees(dp=8, tp=2, pp=4, micro_batch_size=2, num_microbatches=16)
    for schedule, recompute in (("1f1b", "all"), ("scp", "all"), ("1f1b", "stage-aware")):
        c = candidate(d, schedule=schedule, recompute=recompute, partition="time")
        # exact: with no technique on, MerakStepModel runs StepModel's own code path unchanged
        assert plain.evaluate(c).step_time_s == base.evaluate(c).step_time_s
    # stage-aware as an R before the wait, TP overlap off: forward and backward stage costs are the
    # base's, summed in another order (segments instead of blocks)
    merak = MerakStepModel(profile, cluster, global_batch_size=256, dtype="bf16",
                           techniques=Techniques(stage_aware_before_wait=True), hidden=1920)
    c = candidate(d, schedule="1f1b", recompute="none", partition="time")
    spans = [(0, 15), (15, 30), (30, 45), (45, 56)]
    ours, theirs = merak.stage_costs(c, spans, (0,) * 4), base.stage_costs(c, spans, (0,) * 4)
    assert ours.forward == pytest.approx(theirs.forward, rel=1e-9)
    assert ours.backward == pytest.approx(theirs.backward, rel=1e-9)


def test_stage_aware_recomputes_less_on_later_stages_and_beats_full_recompute(profile):
    cluster = resolve_cluster("rtx3090-24gb-pcie", nproc=64, memory_per_device_gb=12)
    d = Degrees(dp=4, tp=4, pp=4, micro_batch_size=4, num_microbatches=16)
    models = {row[0]: MerakStepModel(profile, cluster, global_batch_size=256, dtype="bf16", techniques=row[4],
                                     hidden=1920) for row in ABLATION}
    estimates = [models[name].evaluate(candidate(d, schedule=s, recompute=r, partition=p))
                 for name, s, r, p, _ in ABLATION]
    stage_aware = estimates[3]
    blocks = stage_aware.recompute_blocks
    assert stage_aware.fits and blocks[-1] == 0 and any(blocks), blocks
    assert list(blocks[:-1]) == sorted(blocks[:-1], reverse=True), blocks  # more in flight early: more recompute
    assert stage_aware.step_time_s < estimates[2].step_time_s < estimates[0].step_time_s
    assert estimates[MERAK_ROW].step_time_s < stage_aware.step_time_s  # tp=4 over PCIe: overlap helps
    assert all(e.peak_memory <= cluster.memory_bytes for e in estimates if e.fits)


def test_degree_choices_respect_node_heads_and_limits(profile):
    cluster = resolve_cluster("rtx3090-24gb-pcie", nproc=64)
    base = StepModel(profile, cluster, global_batch_size=256, dtype="bf16")
    degrees = degree_choices(base, 64, max_pp=8, max_mbs=4)
    assert degrees and all(d.tp <= 4 and d.pp <= 8 and d.micro_batch_size <= 4 and d.dp * d.tp * d.pp == 64 and
                           d.num_microbatches >= d.pp and d.dp * d.micro_batch_size * d.num_microbatches == 256
                           for d in degrees)


def test_reduced_study_prints_tables_and_writes_the_chart(tmp_path, capsys):
    assert main(["--clusters", "rtx3090", "--models", "gpt-2.5b", "--max-pp", "4", "--max-mbs", "2", "--jobs", "1",
                 "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "assumptions" in text and "calibration" in text and "up to 1.39" in text
    record = json.loads((tmp_path / "results.json").read_text())["tables"]["rtx3090"]
    assert {r["baseline"] for r in record} == {"megatron", "deepspeed"}
    for r in record:
        assert r["samples_per_s"] > 0 and 0 < r["tflops_per_gpu"] < 71
        assert r["merak_speedup"] > 0 and r["autopar_speedup"] > 0
    deepspeed = next(r for r in record if r["baseline"] == "deepspeed")
    assert deepspeed["ablation"]["DeepSpeed-style at these degrees"] == pytest.approx(1.0)
    assert (tmp_path / "merak.png").stat().st_size > 10_000


def test_v100_32gb_preset_is_labelled_and_sized():
    cluster = resolve_cluster("v100-32gb-nvlink")
    assert (cluster.num_devices, cluster.devices_per_node, cluster.memory_per_device_gb) == (64, 8, 32)
    assert "datasheet" in cluster.source and "100 Gb/s InfiniBand" in cluster.source
    assert cluster.inter_node.bandwidth_bytes_per_s == pytest.approx(12.5e9 / 8)  # one 100 Gb/s port per 8 GPUs
