"""The calibration's reference step sets the step model's level (Cluster.time_shared_scale): a small GPT's
data-parallel step measured on the ranks, over what the search predicts for the same model and step. The ranks'
side runs for real in test_search.py's gloo-link test; here the pricing and the wiring, with canned times."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.search import calibrate, step_probe
from autopar.search.cluster import preset
from autopar.search.cost import StepModel


def _links(reference_s: float | None) -> dict:
    link = {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9}
    tables = {name: {"2": link, "4": link} for name in ("allreduce", "allreduce_cpu", "reduce_scatter", "all_gather",
                                                         "reduce_scatter_cpu", "all_gather_cpu")}
    links = {**tables, "p2p": link, "p2p_cpu": link, "effective_cores": 1.5, "sync_cpu_s": 1e-4,
             "aggregate": link}
    if reference_s is not None:
        links["reference_step_s"] = reference_s
    return links


@pytest.mark.parametrize("reference_s, scale", [(0.25, 0.25 * 7), (None, 1.0)])
def test_calibrate_keeps_the_level_the_reference_step_gives(monkeypatch, reference_s, scale):
    """A calibration whose ranks timed the reference step keeps reference_level's factor; one without (an older
    ranks' file) keeps 1. Machine figures are not measured here (canned)."""
    monkeypatch.setattr(calibrate, "measure_links", lambda nproc, group_sizes=None: _links(reference_s))
    monkeypatch.setattr(calibrate, "matmul_rate", lambda dtype=None: 1e10)
    monkeypatch.setattr(calibrate, "action_overhead", lambda: 1e-4)
    monkeypatch.setattr(calibrate, "memory_bandwidth", lambda: 1e10)
    seen = []

    def level(cluster, measured_s):
        seen.append((cluster.time_shared_scale, cluster.num_devices, measured_s))
        return measured_s * 7

    monkeypatch.setattr(step_probe, "reference_level", level)
    cluster = calibrate.calibrate(4, group_sizes=[2, 4])
    assert cluster.time_shared_scale == pytest.approx(scale)
    assert seen == ([(1.0, 4, reference_s)] if reference_s else [])  # priced unscaled, on the ranks measured


def test_reference_level_is_the_measured_step_over_its_predicted_bound():
    """Priced as the search prices a user's model: replicated data parallelism over every rank, one micro-batch of
    8 each, at scale 1 whatever the cluster holds (a level is not compounded); on 4 ranks sharing one core the
    bound rules, so the level is measured / bound. A hand-made profile at FLOP rates stands for the reference
    model's (the calibration traces it and measures its blocks: reference_profile), so the bound is exact."""
    from autopar.search.profile import ModelProfile, TPProfile
    from autopar.search.reference_step import MICRO_BATCH
    n = 6
    flops, saved, params = (1e6,) + (4e7,) * 4 + (2e7,), (2e4,) * n, (30_000,) + (200_000,) * 4 + (256,)
    profile = ModelProfile(name="reference", seq_len=128, block_names=tuple(f"b{i}" for i in range(n)), flops=flops,
                           saved_bytes=saved, params=params, boundary_bytes=(6e4,) * (n - 1), shared_params=0,
                           tp={1: TPProfile(1, flops, params, saved, (0.0,) * n, (0,) * n)})
    cluster = preset("cpu-local").replace(name="calibrated", num_devices=4, devices_per_node=4, cores_per_node=1.0)
    estimate = StepModel(profile, cluster, global_batch_size=4 * MICRO_BATCH).evaluate(
        step_probe.reference_candidate(4, 4 * MICRO_BATCH))
    bound = estimate.parts["time_shared_s"]
    assert bound >= estimate.parts["timeline_step_s"] > 0  # the bound rules: a level applies
    already = cluster.replace(time_shared_scale=3.0)
    assert step_probe.reference_level(already, 0.5, profile) == pytest.approx(0.5 / bound)
    assert step_probe.reference_level(already, 1.0, profile) == pytest.approx(1.0 / bound)


def test_the_reference_step_keeps_the_median_round_scaled_to_a_quiet_machine(monkeypatch):
    """Each timed round is scaled by the cores other jobs took during it (the machine's busy CPU beyond our ranks'
    own), and the median scaled round sets the level (a run is judged by its median step): a round in which other
    jobs held most of the cores counts as its quiet equivalent, not 4x slower. Canned rounds on a 2-core machine."""
    from autopar.search import calibrate_ranks, machine_load, reference_step
    monkeypatch.setattr(machine_load, "cores", lambda: 2)
    rounds = [{"wall_s": 0.8, "cpu_s": 0.5, "busy_s": 1.6},     # our ranks had 0.625 cores, others 1.375
              {"wall_s": 0.21, "cpu_s": 0.378, "busy_s": 0.399},  # nearly quiet: ours 1.8, others 0.1
              {"wall_s": 0.3, "cpu_s": 0.4, "busy_s": None}]      # the machine's busy CPU unknown: as measured
    monkeypatch.setattr(reference_step, "step_rounds", lambda busy_seconds=None: rounds)
    found = calibrate_ranks.reference_step()
    # scaled: 0.5 / 2 = 0.25 (the loaded round given its 1.375 cores back), 0.378 / 1.9, 0.3 as measured
    assert found["reference_step_s"] == pytest.approx(0.25)  # their median; unscaled, 0.3
    assert found["reference_step_measured_s"] == 0.3
    assert found["reference_others_cores"] == pytest.approx((1.375 + 0.1 + 0.0) / 3)
    assert machine_load.quiet_factor(0.5, 0.0, 0.25) == 1.0 and machine_load.others_cores(None, 0.5, 0.25) == 0.0


def test_the_reference_is_priced_with_the_blocks_it_measured(monkeypatch):
    """The reference step updates as the trainer does (fused AdamW, reference_step.optimizer), so its profile carries
    the blocks as measured, update included: the level it calibrates is what time-sharing adds to the step."""
    from autopar.search import measure_profile
    from autopar.search.measure_profile import BlockCosts
    block = BlockCosts(forward_fixed_s=1e-3, forward_per_seq_s=1e-3, backward_fixed_s=2e-3, backward_per_seq_s=2e-3,
                       saved_per_seq=1e3, transient_fixed=0.0, transient_per_seq=0.0)
    timed = [dataclasses.replace(block, update_s=u) for u in (1e-4, 3e-4, 3e-4, 3e-4, 3e-4, 1e-4)]
    monkeypatch.setattr(measure_profile, "measure_module_blocks", lambda model, **kw: timed)
    measured = step_probe.reference_profile().measured
    assert [m.update_s for m in measured] == [t.update_s for t in timed]


def test_the_reference_starts_as_trained_models_do_not_saturated():
    """GPT-2's initialisation (std 0.02): torch's unit-variance embedding, tied to the head, starts the logits
    saturated and the step measures denormal arithmetic (2x slower for ~25 steps on x86), not the machine."""
    import torch

    from autopar.search.reference_step import ReferenceGPT
    torch.manual_seed(0)
    model = ReferenceGPT()
    assert model.head.weight is model.tok_emb.weight
    assert float(model.tok_emb.weight.std()) == pytest.approx(0.02, rel=0.1)
    logits = model(torch.randint(0, 256, (2, 16)))
    assert float(logits.abs().max()) < 5.0  # not saturated: a softmax over them stays in normal floats
