"""Mixed clusters: per-device speed and memory, per-pair links, and the plans that read them."""

from __future__ import annotations

import sys

import pytest

from autopar.errors import ConfigError
from autopar.search import hetero_cluster as hc
from autopar.search.cluster import cluster_from_dict, preset, sized

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BASE = """
name = "mixed"
num_devices = 4
devices_per_node = 4
memory_per_device_gb = 16
compute_efficiency = 0.5
memory_bandwidth_bytes_per_s = 1e11
flops_per_s = {fp32 = 1e13}
intra_node = {latency_s = 5e-6, bandwidth_bytes_per_s = 1e10}
inter_node = {latency_s = 1e-5, bandwidth_bytes_per_s = 1e9}
"""
MIXED = BASE + """
[[devices]]
speed = 1.0
[[devices]]
speed = 1.0
[[devices]]
speed = 0.5
[[devices]]
speed = 0.5
memory_gb = 8
[[links]]
a = [0, 1]
b = [2, 3]
latency_s = 1e-3
bandwidth_bytes_per_s = 1e8
"""


def mixed():
    return cluster_from_dict(tomllib.loads(MIXED))


def test_mixed_cluster_reads_speeds_memory_and_links_and_round_trips():
    c = mixed()
    assert [hc.device_speed(c, d) for d in range(4)] == [1.0, 1.0, 0.5, 0.5]
    assert hc.device_memory_gb(c, 3) == 8 and hc.device_memory_gb(c, 0) == 16
    assert hc.link_between(c, 1, 2).bandwidth_bytes_per_s == 1e8  # the override, both ways
    assert hc.link_between(c, 2, 0).latency_s == 1e-3
    assert hc.link_between(c, 2, 3) == c.intra_node  # not covered: the node's link
    assert hc.ring_link(c, [0, 1]).bandwidth_bytes_per_s == 1e10
    assert hc.ring_link(c, [0, 2]).bandwidth_bytes_per_s == 1e8  # a ring waits for its slowest hop
    assert hc.group_speed(c, [0, 3]) == 0.5
    assert hc.is_heterogeneous(c)
    assert cluster_from_dict(tomllib.loads(c.to_toml())) == c


def test_presets_are_the_homogeneous_special_case():
    c = preset("a100-80gb")
    assert not hc.is_heterogeneous(c) and "devices" not in c.to_dict()
    assert cluster_from_dict(tomllib.loads(c.to_toml())) == c
    assert hc.device_speed(c, 5) == 1.0 and hc.link_between(c, 0, 9) == c.inter_node
    assert hc.group_all_reduce(c, 1e6, list(range(8))) == pytest.approx(c.all_reduce(1e6, 8))


@pytest.mark.parametrize("extra, words", [
    ("[[devices]]\nspeed = 1.0\n", "1 [[devices]] table(s) for num_devices = 4"),
    ("[[devices]]\nspeed = 0\n" * 4, "devices[0].speed' must be a number > 0, got 0"),
    ("[[devices]]\nspeed = 1\nfast = 2\n" * 4, "devices[0] has unknown field(s) ['fast']"),
    ("[[links]]\na = [0, 7]\nlatency_s = 0\nbandwidth_bytes_per_s = 1e9\n", "names device(s) [7] outside 0..3"),
    ("[[links]]\na = [0, 1]\nlatency_s = 0\n", "links[0] is missing 'bandwidth_bytes_per_s'"),
])
def test_bad_mixed_cluster_files_are_refused_by_name(extra, words):
    with pytest.raises(ConfigError, match=None) as error:
        cluster_from_dict(tomllib.loads(BASE + extra))
    assert words in str(error.value)


def test_a_described_cluster_is_not_resized():
    with pytest.raises(ConfigError, match="--nproc 8 does not match cluster 'mixed'"):
        sized(mixed(), nproc=8)
    assert sized(mixed(), nproc=4) == mixed()


@pytest.mark.parametrize("speeds", [(1.0, 0.5), (0.25, 1.0, 1.0), (1.0, 0.5, 2.0)])
def test_cuts_on_device_speeds_minimise_the_slowest_stage(speeds):
    from autopar.partition import algorithms
    compute, transfer = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0], [0.5, 0.2, 0.1, 0.3, 0.2, 0.4, 0.0]
    stages = len(speeds)

    def slowest(bounds):
        return max(sum(compute[a:b]) / v + (transfer[b - 1] if b < len(compute) else 0.0)
                   for (a, b), v in zip(zip(bounds, bounds[1:]), speeds))
    got = algorithms.min_max_time(compute, stages, transfer=transfer, speeds=speeds)
    assert slowest(got) == pytest.approx(algorithms.brute_force(len(compute), stages, slowest)[0])
    # equal blocks: the stage at half speed takes a third of them, not half
    assert algorithms.min_max_time([1.0] * 6, 2, speeds=(1.0, 0.5)) == [0, 4, 6]
    assert algorithms.min_max_time([1.0] * 6, 2) == [0, 3, 6]


def _work(**changes):
    from autopar.search.placement import Workload
    base = dict(dp=2, pp=2, tp=1, num_microbatches=4, stage_compute_s=(1e-3, 1e-3), boundary_bytes=(1e5, 0.0),
                grad_bytes=(4e7, 4e7))
    return Workload(**{**base, **changes})


def test_placement_keeps_the_gradient_sums_on_fast_links():
    """Devices {0, 2} and {1, 3} are joined by fast links, the pairs by a slow one: the rank order would put
    each stage's dp group (0, 1 and 2, 3) across the slow link; the best order keeps them on the fast ones."""
    from autopar.search.placement import best_placement
    slow = cluster_from_dict(tomllib.loads(BASE + "[[links]]\na = [0, 2]\nb = [1, 3]\nlatency_s = 1e-3\n"
                                                  "bandwidth_bytes_per_s = 1e8\n"))
    placed = best_placement(slow, _work())
    stage_groups = [{placed.order[0], placed.order[1]}, {placed.order[2], placed.order[3]}]
    assert sorted(map(sorted, stage_groups)) == [[0, 2], [1, 3]], placed
    assert placed.step_s < placed.rank_order_step_s / 2
    homogeneous = cluster_from_dict(tomllib.loads(BASE))
    assert best_placement(homogeneous, _work()).order == (0, 1, 2, 3)  # nothing to gain: ranks stay


def test_placement_and_shares_follow_device_speed():
    """Two half-speed devices: stages of equal work go to one fast and one slow replica each way is worse
    than giving each replica its pace; with uneven shares the slow replica takes fewer micro-batches."""
    from autopar.search.placement import best_placement, step_time
    c = mixed()  # devices 2, 3 at half speed; slow link between {0, 1} and {2, 3}
    work = _work(dp=4, pp=1, stage_compute_s=(1e-2,), boundary_bytes=(0.0,), grad_bytes=(1e3,))
    even = step_time(c, work, (0, 1, 2, 3))
    uneven = step_time(c, _work(dp=4, pp=1, stage_compute_s=(1e-2,), boundary_bytes=(0.0,), grad_bytes=(1e3,),
                                uneven_shares=True), (0, 1, 2, 3))
    assert uneven < 0.8 * even
    assert best_placement(c, work).step_s <= even


def test_reproduce_hetero_predicts_a_gain_where_regions_are_far_apart(capsys):
    """Two data centres joined by 1 Gbit/s: the placement keeps each stage's replicas in one centre and gains
    several times over placements that ignore the links (a prediction, labelled so)."""
    from autopar.reproduce.hetero import main
    assert main(["--devices", "16", "--scenarios", "two-centres"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PREDICTION")
    gain = float(out.split("two-centres")[1].split("x")[0].split()[-1])
    assert gain > 2, out


def test_plan_auto_shows_the_placement_on_a_mixed_cluster(tmp_path, capsys):
    from autopar.cli import build_parser, cmd_plan
    two = BASE.replace("num_devices = 4", "num_devices = 2").replace("devices_per_node = 4", "devices_per_node = 2")
    path = tmp_path / "mixed2.toml"
    path.write_text(two + "[[devices]]\nspeed = 1.0\n[[devices]]\nspeed = 0.5\n")
    ns = build_parser().parse_args(["plan", "--auto", "--model", "gpt-tiny", "--model-arg", "n_layer=2", "--nproc",
                                    "2", "--global-batch-size", "4", "--seq-len", "16", "--cost-model", "flops",
                                    "--top", "1", "--cluster", str(path)])
    assert cmd_plan(ns) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("placement #1: stage 0:"))
    assert "(devices by mesh position" in line and " ms per step vs " in line and "in rank order" in line
