"""`autopar reproduce hetero`: decentralised training's scenarios (Yuan et al., NeurIPS'22), by prediction.

Yuan et al. train a GPT-style model of about 1.3B parameters over 64 GPUs as 8 pipeline stages times 8
data-parallel replicas, on networks from one data centre to GPUs spread over the world, and report up to
4.8x over Megatron/DeepSpeed-style placement on the slowest network. No such cluster is at hand: this
study states five networks of that kind as mixed-cluster descriptions (search/hetero_cluster.py), prices
a step of the 8 x 8 layout with the placement model (search/placement.py) for the naive placement (rank
placements that do not look at the links, random orders) and for the placement autopar's search picks
(pairwise swaps), and prints the predicted gain. The networks are our rendering of the
paper's setting (regions of 8 GPUs, NVLink-class links inside a machine, a shared data-centre network
between machines, tens to hundreds of milliseconds and 1 Gbit/s or less between regions), not its
measured figures: every number is a prediction, and the paper's own comparison differs in kind (its
baselines are whole systems; ours is one system's placement, so fewer effects are in the gain).

    autopar reproduce hetero                 # five scenarios, 64 devices
    autopar reproduce hetero --scenarios world-wide --devices 16   # smaller (the test's size)
"""

from __future__ import annotations

import argparse
import random
import statistics

from ..errors import ConfigError, choices
from ..search.cluster import Cluster, Link
from ..search.hetero_cluster import LinkOverride
from ..search.placement import Workload, best_placement, step_time

GBIT = 1e9 / 8
# name: (regions, latency between regions (s), bandwidth between regions (bytes/s), what it stands for)
SCENARIOS = {
    "data-centre": (1, 0.0, 0.0, "one data centre: 8 machines of 8 GPUs, 100 Gb/s between machines"),
    "spot": (1, 0.0, 0.0, "one data centre, spot machines on a slower shared network: 10 Gb/s between machines"),
    "two-centres": (2, 10e-3, 1.0 * GBIT, "two data centres of 4 machines, 10 ms and 1 Gbit/s between them"),
    "regional": (4, 20e-3, 0.5 * GBIT, "four regions of 2 machines, 20 ms and 0.5 Gbit/s between them"),
    "world-wide": (8, 150e-3, 0.3 * GBIT, "eight regions world-wide, one machine each, 150 ms and 0.3 Gbit/s"),
}
PAPER_GAIN = 4.8  # the abstract's "up to 4.8x" over Megatron/DeepSpeed on the world-wide network


def scenario_cluster(name: str, devices: int) -> Cluster:
    """`devices` GPUs in machines of 8, the machines spread over the scenario's regions."""
    regions, latency, bandwidth, source = SCENARIOS[name]
    per_node = min(8, devices)
    between_machines = 10 * GBIT if name == "spot" else 100 * GBIT / 8  # per GPU
    links = ()
    if regions > 1:
        # machine m sits in region m % regions: rank order interleaves the regions, as a launcher that numbers
        # machines as they join would (the naive placement this study starts from)
        region = [tuple(d for d in range(devices) if (d // per_node) % regions == r) for r in range(regions)]
        links = tuple(LinkOverride(a=region[i], b=region[j], latency_s=latency, bandwidth_bytes_per_s=bandwidth)
                      for i in range(regions) for j in range(i + 1, regions))
    return Cluster(name=f"yuan-{name}", source=f"{source} (stated for this study, not measured)",
                   num_devices=devices, devices_per_node=per_node, memory_per_device_gb=32,
                   flops_per_s={"fp32": 15.7e12, "bf16": 125e12}, compute_efficiency=0.4,
                   memory_bandwidth_bytes_per_s=900e9, intra_node=Link(5e-6, 150e9),
                   inter_node=Link(50e-6, between_machines), links=links)


def gpt_workload(devices: int, *, layers: int = 24, hidden: int = 2048, seq: int = 2048, micro: int = 1,
                 global_batch: int = 1024, rate: float = 125e12 * 0.4) -> Workload:
    """The 1.3B GPT as 8 stages (or devices // 8 replicas x 8 stages) in bf16: FLOPs per token 6 x 12 h^2 per
    layer (forward and backward), activations h x seq x 2 bytes per micro-batch at each cut, gradients in fp32."""
    pp = 8 if devices >= 8 else devices
    dp = devices // pp
    per_stage_layers = layers / pp
    flops = 6 * 12 * hidden ** 2 * per_stage_layers * seq * micro
    params = 12 * hidden ** 2 * per_stage_layers
    return Workload(dp=dp, pp=pp, tp=1, num_microbatches=global_batch // (dp * micro),
                    stage_compute_s=(flops / rate,) * pp, boundary_bytes=(2 * 2 * hidden * seq * micro,) * pp,
                    grad_bytes=(4 * params,) * pp)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="autopar reproduce hetero", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), help=f"of {choices(SCENARIOS)}")
    parser.add_argument("--devices", type=int, default=64, help="GPUs (a multiple of 8 and of the regions)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        raise ConfigError(f"unknown scenario(s) {unknown}; use {choices(SCENARIOS)}")
    if args.devices < 8 or args.devices % 8 or any(args.devices // 8 % SCENARIOS[s][0] for s in args.scenarios):
        raise ConfigError(f"--devices {args.devices}: use a multiple of 8 machines' GPUs that the regions divide "
                          f"(64 as the paper, or 16 with at most 2 regions)")
    work = gpt_workload(args.devices)
    print(f"PREDICTION (step model, not a measurement): GPT ~1.3B, {work.dp} replicas x {work.pp} stages on "
          f"{args.devices} GPUs, {work.num_microbatches} micro-batches per replica")
    print("naive: the median of 9 random placements (a launcher that does not look at the links); placed: the "
          "placement search (search/placement.py) started from the first of them")
    print(f"{'scenario':>12} {'naive (s)':>10} {'placed (s)':>10} {'gain':>6}  network")
    rng = random.Random(0)
    orders = []
    for _ in range(9):
        order = list(range(args.devices))
        rng.shuffle(order)
        orders.append(tuple(order))
    for name in args.scenarios:
        cluster = scenario_cluster(name, args.devices)
        naive = statistics.median(step_time(cluster, work, order) for order in orders)
        placed = best_placement(cluster, work, start=orders[0])
        print(f"{name:>12} {naive:>10.2f} {placed.step_s:>10.2f} {naive / placed.step_s:>5.2f}x  "
              f"{SCENARIOS[name][3]}")
    print(f"paper: up to {PAPER_GAIN}x over Megatron/DeepSpeed on the world-wide network (whole systems compared; "
          f"here only the placement differs)")
    return 0
