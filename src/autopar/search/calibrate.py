"""`autopar calibrate`: measure this machine and write a cluster TOML the search can use.

Measured, each in a few seconds at most:
- matmul rate of one thread (ranks run one thread each, see launch.py) at the shapes the
  built-in models use (tokens x d_model x 4 d_model for gpt-tiny .. gpt-small widths), fp32
  and bf16; the median is the device's rate, with compute_efficiency 1;
- per-action overhead: one tiny forward+backward (what every pipeline action pays in Python
  and autograd bookkeeping beyond its FLOPs);
- memory bandwidth of a large copy (bounds the optimizer step);
- gloo point-to-point, and all-reduce, reduce-scatter and all-gather (ZeRO's calls) per group size 2..N,
  on N local ranks (calibrate_ranks.py),
  fitted as latency plus bandwidth, in wall time and in the CPU seconds they take (what
  time-sharing ranks pay out of their compute); and what the N ranks move together
  (node_bandwidth_bytes_per_s, the resharding cost model's shared cap);
- the cores the N ranks really get when all run at once (calibrate_ranks.sharing_probe):
  the node's `cores_per_node`, which the step model divides the ranks' summed work by, and the
  CPU each blocking wait costs a rank once they time-share them (`sync_cpu_s`), and the wall the cores idle per
  all-reduce over each group size then (`wait_idle_table`: a group meets only once every member has run);
- the step model's level (`time_shared_scale`): one small GPT's replicated data-parallel step on the N ranks
  (reference_step.py) against what the search predicts for it (step_probe.reference_level).
Memory per device is this machine's RAM divided by N.

The ranks are forked from one fresh process (calibrate_ranks.run_forked), so torch is imported once, not N
times at once. `--strategy auto` measures the same without being asked, once per machine, torch version and
process count, over the group sizes the search can form only (calibration_cache.py); `autopar calibrate`
measures every size and rewrites that cache entry too.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..errors import ConfigError, DistributedError
from .cluster import Cluster, Link
from .hetero_cluster import DeviceSpec, LinkOverride

SHAPES = ((512, 64, 256), (512, 128, 512), (1024, 256, 1024), (1024, 768, 768))  # tokens x in x out


def _seconds(fn, repeats: int = 5) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def matmul_rate(dtype: torch.dtype = torch.float32) -> float:
    """Median FLOP/s of one thread over the models' matmul shapes."""
    rates = []
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        rates.append(2 * m * k * n / _seconds(lambda: a @ b))
    return statistics.median(rates)


def action_overhead() -> float:
    """Seconds of a forward+backward whose arithmetic is negligible: the per-action fixed cost."""
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def step() -> None:
        layer(torch.relu(layer(x))).sum().backward()

    return _seconds(step, repeats=50)


def memory_bandwidth() -> float:
    src, dst = torch.empty(16 * 2**20), torch.empty(16 * 2**20)  # 64 MiB each
    return 2 * src.numel() * 4 / _seconds(lambda: dst.copy_(src))


def measure_links(nproc: int, group_sizes: list[int] | None = None, per_rank: bool = False) -> dict:
    """Run calibrate_ranks on `nproc` local ranks, forked from one fresh process; returns its fits. `group_sizes`:
    the collectives' group sizes to measure (default every size 2..nproc)."""
    import subprocess
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "links.json"
        command = [sys.executable, str(Path(__file__).with_name("calibrate_ranks.py")), str(out), "--ranks", str(nproc)]
        if group_sizes:
            command += ["--groups", ",".join(str(n) for n in group_sizes)]
        if per_rank:
            command.append("--per-rank")
        code = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
        if code != 0 or not out.exists():
            raise DistributedError(f"calibrate: the {nproc}-rank link measurement failed (exit code {code}); "
                                   f"see the ranks' messages above")
        return json.loads(out.read_text())


def calibrate(nproc: int, group_sizes: list[int] | None = None, details: dict | None = None,
              per_rank: bool = False) -> Cluster:
    """This machine as a Cluster of `nproc` one-thread gloo ranks; `group_sizes`: the collectives' group sizes to
    measure (default every size 2..nproc; a size not measured is priced at the largest measured one's per-rank
    cost). `details` gets what the figures do not hold: `others_cores`, the cores other jobs took while the
    sharing probe and the reference step ran (their figures are scaled to a quiet machine, machine_load.py), and
    the reference step as measured and as scaled. Leaves this process's thread count as it found it."""
    if nproc < 2:
        raise ConfigError(f"calibrate --nproc must be >= 2 to measure links between ranks, got {nproc}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = matmul_rate(torch.float32), matmul_rate(torch.bfloat16)
        overhead, bandwidth = action_overhead(), memory_bandwidth()
    finally:
        torch.set_num_threads(threads)
    links = measure_links(nproc, group_sizes, per_rank=True) if per_rank else measure_links(nproc, group_sizes)
    if details is not None:
        held = [links[k] for k in ("sharing_others_cores", "reference_others_cores") if k in links]
        details.update(others_cores=round(statistics.mean(held), 2) if held else None,
                       **{k: links[k] for k in ("reference_step_s", "reference_step_measured_s") if k in links})
    p2p = Link(**links["p2p"])
    table = {int(n): Link(**fit) for n, fit in links["allreduce"].items()}
    cpu_table = {int(n): Link(**fit) for n, fit in links["allreduce_cpu"].items()}
    scatter_table = {int(n): Link(**fit) for n, fit in links["reduce_scatter_cpu"].items()}
    gather_table = {int(n): Link(**fit) for n, fit in links["all_gather_cpu"].items()}
    scatter_wall = {int(n): Link(**fit) for n, fit in links["reduce_scatter"].items()}
    gather_wall = {int(n): Link(**fit) for n, fit in links["all_gather"].items()}
    swap_wall = {int(n): Link(**fit) for n, fit in links.get("all_to_all", {}).items()}
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 8 * 2**30
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cluster = Cluster(name="calibrated", source=f"measured by autopar calibrate on {socket.gethostname()} at {stamp} "
                   f"with {nproc} gloo ranks of one thread", num_devices=nproc, devices_per_node=nproc,
                   memory_per_device_gb=round(ram / nproc / 2**30, 2), flops_per_s={"fp32": fp32, "bf16": bf16},
                   compute_efficiency=1.0, memory_bandwidth_bytes_per_s=bandwidth, intra_node=p2p,
                   inter_node=p2p, per_action_overhead_s=overhead, allreduce_table=table, memory_headroom=1.1,
                   cores_per_node=min(float(os.cpu_count() or 1), round(links["effective_cores"], 3)),
                   allreduce_cpu_table=cpu_table, reduce_scatter_cpu_table=scatter_table,
                   all_gather_cpu_table=gather_table, reduce_scatter_table=scatter_wall, all_gather_table=gather_wall,
                   all_to_all_table=swap_wall, p2p_cpu=Link(**links["p2p_cpu"]), sync_cpu_s=links["sync_cpu_s"],
                   wait_idle_table={int(n): round(v, 6) for n, v in links.get("wait_idle", {}).items()},
                   node_bandwidth_bytes_per_s=links.get("aggregate", {}).get("bandwidth_bytes_per_s", 0.0),
                   measured_at=round(time.time(), 1))
    if per_rank:  # each rank's speed against the fastest's, and every pair's link (search/hetero_cluster.py)
        fastest = max(links["rank_rates"])
        cluster = cluster.replace(
            devices=tuple(DeviceSpec(speed=round(r / fastest, 3)) for r in links["rank_rates"]),
            links=tuple(LinkOverride(a=(int(pair.split(",")[0]),), b=(int(pair.split(",")[1]),), **fit)
                        for pair, fit in links["pair_links"].items()))
    if links.get("reference_step_s"):  # the step model's level, from a real step of a small model (step_probe.py)
        from .step_probe import reference_level
        cluster = cluster.replace(time_shared_scale=round(reference_level(cluster, links["reference_step_s"]), 4))
    return cluster


def cmd_calibrate(ns) -> int:
    """Measure every group size, write `--out` and rewrite this machine's cache entry for `--nproc` (what
    `--strategy auto` without --cluster then uses)."""
    from .calibration_cache import store
    began, load = time.perf_counter(), os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    details: dict = {}
    cluster = calibrate(ns.nproc, details=details, per_rank=getattr(ns, "per_rank", False))
    Path(ns.out).write_text(cluster.to_toml())
    entry = store(cluster, ns.nproc, seconds=time.perf_counter() - began, load=load,
                  others_cores=details.get("others_cores"))
    print(f"wrote {ns.out} and {entry} in {time.perf_counter() - began:.0f} s: matmul "
          f"{cluster.flops_per_s['fp32'] / 1e9:.1f} GFLOP/s fp32 per thread, overhead "
          f"{cluster.per_action_overhead_s * 1e6:.0f} us per action, p2p "
          f"{cluster.intra_node.latency_s * 1e6:.0f} us + {cluster.intra_node.bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
          f"{ns.nproc} ranks get {cluster.cores_per_node:.2f} effective cores and pay "
          f"{cluster.sync_cpu_s * 1e6:.0f} us of CPU per blocking wait"
          + (f"; other jobs held {details['others_cores']:.1f} cores while it measured (figures scaled to a quiet "
             f"machine)" if details.get("others_cores") else ""))
    return 0
