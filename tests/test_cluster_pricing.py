"""The search on a mixed cluster: candidates priced at their own devices' speeds, with the batch shares and the
speed-balanced cut the plan then carries; a homogeneous cluster keeps the step model's numbers exactly."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.config import Strategy, TrainConfig
from autopar.errors import ConfigError
from autopar.partition import algorithms
from autopar.search.auto import Plan
from autopar.search.cluster import Cluster, Link
from autopar.search.cluster_pricing import ClusterStepModel, even_shares, step_model
from autopar.search.command import plan_dict
from autopar.search.cost import Candidate, StepModel
from autopar.search.device_speeds import replica_shares, stage_speeds, with_auto_shares
from autopar.search.hetero_cluster import DeviceSpec
from autopar.search.profile import ModelProfile, TPProfile
from autopar.search.search import SearchSpace, exhaustive

SPEEDS = (1.0, 0.5, 1.0, 0.5)  # devices 1 and 3 at half speed
GLOBAL_BATCH = 8


def homogeneous() -> Cluster:
    return Cluster(name="four", source="test", num_devices=4, devices_per_node=4, memory_per_device_gb=4.0,
                   flops_per_s={"fp32": 1e9}, compute_efficiency=1.0, memory_bandwidth_bytes_per_s=1e10,
                   intra_node=Link(1e-5, 1e9), inter_node=Link(1e-4, 1e8), per_action_overhead_s=1e-4)


def mixed() -> Cluster:
    return homogeneous().replace(name="two-half-speed", devices=tuple(DeviceSpec(s) for s in SPEEDS))


def profile(layers: int = 6) -> ModelProfile:
    """A made-up transformer: an embedding, `layers` equal layers, a head (tp = 1 only)."""
    n = layers + 2
    flops = (1e5,) + (4e6,) * layers + (2e6,)
    saved = (2e4,) + (1e5,) * layers + (5e4,)
    params = (50_000,) + (120_000,) * layers + (1_000,)
    return ModelProfile(name="toy", seq_len=32, block_names=tuple(f"b{i}" for i in range(n)), flops=flops,
                        saved_bytes=saved, params=params, boundary_bytes=(8e3,) * (n - 1), shared_params=0,
                        tp={1: TPProfile(1, flops, params, saved, (0.0,) * n, (0,) * n)}, tp_refused={})


class EvenShares(ClusterStepModel):
    uneven_shares = False


SPACE = SearchSpace(nproc=4, dimensions=False)
PP2_DP2 = Candidate(dp=2, tp=1, pp=2, micro_batch_size=1, num_microbatches=4)  # replicas: devices {0, 2}, {1, 3}
PP4 = Candidate(dp=1, tp=1, pp=4, micro_batch_size=1, num_microbatches=8)  # stages at speeds 1, 0.5, 1, 0.5


def test_mixed_cluster_ranks_by_per_device_cost_and_shares_beat_even():
    prof = profile()
    model = ClusterStepModel(prof, mixed(), global_batch_size=GLOBAL_BATCH)
    shared = model.evaluate(PP2_DP2)
    even = EvenShares(prof, mixed(), global_batch_size=GLOBAL_BATCH).evaluate(PP2_DP2)
    alike = StepModel(prof, mixed(), global_batch_size=GLOBAL_BATCH).evaluate(PP2_DP2)
    assert shared.cluster_plan["dp_shares"] == "1,0.5" and shared.cluster_plan["microbatches_per_replica"] == [5, 3]
    assert even.cluster_plan["dp_shares"] == "even"
    # the slow replica costs: priced alike it is fastest, with even shares slowest, with auto's shares between
    assert alike.step_time_s < shared.step_time_s < even.step_time_s * 0.9
    ranked = exhaustive(model, SPACE).ranked
    ranked_alike = exhaustive(StepModel(prof, mixed(), global_batch_size=GLOBAL_BATCH), SPACE).ranked
    # devices alike, ZeRO-3 data parallelism wins; on the mixed cluster its lock-step replicas (ZeRO takes no
    # shares) wait for the half-speed devices, and plain data parallelism with shares wins
    assert ranked_alike[0].candidate.zero == 3
    assert ranked[0].candidate.zero == 0 and ranked[0].cluster_plan["dp_shares"] == "1,0.5,1,0.5"
    assert ranked[0].step_time_s > ranked_alike[0].step_time_s


def test_slow_links_under_the_gradient_rings_are_priced():
    """Replicas {0, 2} and {1, 3} of pp=2 x dp=2 sum stage 0's gradients over devices 0-1, stage 1's over 2-3:
    a slow link there costs, one between the pipeline's halves costs far less (an activation per micro-batch)."""
    from autopar.search.hetero_cluster import LinkOverride
    prof, slow = profile(), dict(latency_s=1e-3, bandwidth_bytes_per_s=1e7)
    under_rings = mixed().replace(links=(LinkOverride(a=(0, 1), b=(), **slow), LinkOverride(a=(2, 3), b=(), **slow)))
    between_stages = mixed().replace(links=(LinkOverride(a=(0, 1), b=(2, 3), **slow),))
    step = {name: ClusterStepModel(prof, cluster, global_batch_size=GLOBAL_BATCH).evaluate(PP2_DP2).step_time_s
            for name, cluster in (("fast", mixed()), ("rings", under_rings), ("stages", between_stages))}
    assert step["fast"] < step["stages"] < step["rings"]
    assert step["rings"] - step["fast"] > 2 * (step["stages"] - step["fast"])


def test_chosen_plan_carries_the_shares_and_the_cut_the_runtime_applies(tmp_path, monkeypatch):
    prof, cluster = profile(), mixed()
    path = tmp_path / "mixed.toml"
    path.write_text(cluster.to_toml())
    model = ClusterStepModel(prof, cluster, global_batch_size=GLOBAL_BATCH)
    record = plan_dict(model.evaluate(PP2_DP2), model)
    assert record["strategy"]["dp_shares"] == "1,0.5"
    # the default layout is what runs without --strategy auto: even shares, priced so
    default = even_shares(model).evaluate(PP2_DP2)
    assert "dp_shares" not in plan_dict(default, model)["strategy"] and default.step_time_s > model.evaluate(
        PP2_DP2).step_time_s
    runtime = Strategy(dp=2, pp=2, dp_shares="auto", cluster=str(path)).resolved(4)
    assert with_auto_shares(runtime, 4).replicas.shares == record["strategy"]["dp_shares"]  # what auto gives
    planned = Strategy(dp=2, pp=2, dp_shares=record["strategy"]["dp_shares"]).resolved(4)
    samples = replica_shares(planned, TrainConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=1))
    assert list(samples) == record["cluster_plan"]["microbatches_per_replica"]  # micro-batches of 1
    # pp=4: the time cut divides each stage's compute by its device's speed, as the runtime's cut does
    estimate = model.evaluate(PP4)
    forward, backward, _ = model.block_times(1, 1)
    transfer = [2 * cluster.intra_node.p2p(b) for b in prof.boundary_bytes] + [0.0]
    want = algorithms.min_max_time([f + b for f, b in zip(forward, backward)], 4, transfer=transfer, speeds=SPEEDS)
    assert list(estimate.bounds) == want != list(StepModel(prof, cluster, global_batch_size=GLOBAL_BATCH)
                                                 .bounds("time", 1, 1, 4))
    assert stage_speeds(Strategy(pp=4, dp=1, cluster=str(path)).resolved(4)) == SPEEDS
    record = plan_dict(estimate, model)
    assert record["cluster_plan"]["stage_bounds"] == want and record["cluster_plan"]["placement"] == [0, 1, 2, 3]
    monkeypatch.delenv("AUTOPAR_CLUSTER", raising=False)
    with pytest.raises(ConfigError, match=r"cuts its pipeline on the stage speeds .* pass the cluster file"):
        Plan(record, source="plan.json").apply(Strategy(), TrainConfig(global_batch_size=GLOBAL_BATCH))
    ran, _ = Plan(record).apply(Strategy(cluster=str(path)), TrainConfig(global_batch_size=GLOBAL_BATCH))
    assert ran.pp == 4 and ran.planning.cluster == str(path)
    monkeypatch.setenv("AUTOPAR_CLUSTER", str(path))  # what the search priced on when --cluster was not given
    assert Plan(record).apply(Strategy(), TrainConfig(global_batch_size=GLOBAL_BATCH))[0].planning.cluster == str(path)
    banner = Plan(record, source="the search").describe()
    assert f"time cut at stage speeds 1,0.5,1,0.5 (blocks {want})" in banner and "ranks on cluster devices 0 1 2 3" in banner


def test_homogeneous_clusters_keep_the_step_models_plan_and_prediction():
    prof = profile(4)
    same_speeds = homogeneous().replace(devices=(DeviceSpec(1.0),) * 4)
    for cluster in (homogeneous(), same_speeds):
        assert type(step_model(prof, cluster, global_batch_size=GLOBAL_BATCH)) is StepModel
    # the per-device pricing itself reduces to the step model's numbers when every device is alike
    alike = exhaustive(StepModel(prof, homogeneous(), global_batch_size=GLOBAL_BATCH), SPACE).ranked
    priced = exhaustive(ClusterStepModel(prof, homogeneous(), global_batch_size=GLOBAL_BATCH), SPACE).ranked
    assert [e.candidate for e in priced] == [e.candidate for e in alike]
    assert [e.step_time_s for e in priced] == [e.step_time_s for e in alike]
    assert all(e.cluster_plan["dp_shares"] == "even" for e in priced)
    record = plan_dict(alike[0], StepModel(prof, homogeneous(), global_batch_size=GLOBAL_BATCH))
    assert "dp_shares" not in record["strategy"] and "cluster_plan" not in record
    assert dataclasses.replace(alike[0]).cluster_plan == {}
