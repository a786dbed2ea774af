"""What the machines are: a typed cluster description, its TOML form, presets, and collective costs.

A cluster is devices grouped into nodes, each device with a memory size and compute rates,
joined inside a node by one link and between nodes by another. Every link is latency plus
bandwidth (the alpha-beta model), from which the collectives are costed as ring algorithms:

    all-reduce      2 (n-1) alpha + 2 (n-1)/n * bytes / beta
    all-gather      (n-1) alpha + (n-1)/n * bytes / beta     (bytes: the gathered result)
    reduce-scatter  (n-1) alpha + (n-1)/n * bytes / beta     (bytes: the full input)
    point-to-point  alpha + bytes / beta

A group whose ranks all sit in one node uses the intra-node link, otherwise the slower one; a calibrated
cluster's measured figures per group size (allreduce_table, reduce_scatter_table, all_gather_table) replace the
ring's there: gloo's reduce-scatter and all-gather are not the half of an all-reduce the ring rule says
(benchmarks/gloo_collectives.py).
`node_bandwidth_bytes_per_s`, when set, caps what all ranks of a node move together (a CPU host,
where every loopback transfer crosses one memory bus); the resharding cost model (resharding/cost.py)
uses it, so that on one host fewer bytes per link no longer look faster when the total is the same.
The presets' figures come from vendors' published datasheets and say so in `source`;
latencies and the sustained fraction of peak are typical values, not datasheet figures, and
are labelled as such. `autopar calibrate` measures this machine instead (calibrate.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w

from ..errors import ConfigError, choices
from .hetero_cluster import DeviceSpec, LinkOverride, devices_from_list, hetero_to_dict, links_from_list

DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class Link:
    """A connection between two devices: a fixed latency plus bytes over a bandwidth."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def p2p(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Cluster:
    """Devices, their memory and speed, and the links between them."""

    name: str
    source: str  # where the figures come from (datasheet, calibration on host X, ...)
    num_devices: int
    devices_per_node: int
    memory_per_device_gb: float
    flops_per_s: dict[str, float]  # peak dense matmul rate per dtype
    compute_efficiency: float  # fraction of peak a training step sustains on large matmuls
    memory_bandwidth_bytes_per_s: float  # device memory: bounds the optimizer step
    intra_node: Link
    inter_node: Link
    per_action_overhead_s: float = 0.0  # framework time per pipeline action (launches, Python)
    allreduce_table: dict[int, Link] = field(default_factory=dict)
    """Measured all-reduce per group size (latency per step, bus bandwidth), overriding the ring model."""
    reduce_scatter_table: dict[int, Link] = field(default_factory=dict)
    """Measured reduce-scatter per group size (wall time of the call ZeRO makes, reduce_scatter_single, bytes of the
    whole buffer), in the ring's form ((n-1) latencies, (n-1)/n of the bytes over the bandwidth), overriding the
    ring model. Gloo's costs 0.9-2.4x (median 1.3x) its all-reduce of the same buffer here, not the ring's 0.5
    (benchmarks/gloo_collectives.py). Empty: the ring."""
    all_gather_table: dict[int, Link] = field(default_factory=dict)
    """The same for all_gather_single (bytes of the gathered whole): gloo's 0.5-1.5x (median 0.8x) its
    all-reduce. Empty: the ring."""
    memory_headroom: float = 1.1  # predicted peak is multiplied by this (allocator slack, fragmentation)
    cores_per_node: float = 0
    """CPU only: cores the ranks of one node share (0: every device computes on its own). When a node runs
    more ranks than cores they time-share, and the step cost model charges their summed work / cores.
    Fractional when measured as the cores the ranks really get (calibrate_ranks.sharing_probe): switching
    between processes costs some, and on a shared machine other jobs hold some."""
    allreduce_cpu_table: dict[int, Link] = field(default_factory=dict)
    """CPU only: CPU seconds of one all-reduce over n ranks, summed over them, in the all-reduce's alpha-beta form
    (calibrate_ranks.py). Time-sharing ranks pay it out of the cores the compute needs."""
    reduce_scatter_cpu_table: dict[int, Link] = field(default_factory=dict)
    """CPU only: CPU seconds of one reduce-scatter over n ranks (the whole buffer's bytes), summed over them, in the
    ring's alpha-beta form ((n-1) steps, (n-1)/n of the bytes). Gloo's costs several all-reduces' CPU here
    (benchmarks/gloo_collectives.py), so ZeRO-2/3 cannot be priced by the all-reduce. Empty: an all-reduce's."""
    all_gather_cpu_table: dict[int, Link] = field(default_factory=dict)
    """CPU only: the same for one all-gather (bytes of the gathered whole). Empty: half an all-reduce's."""
    p2p_cpu: Link | None = None
    """CPU only: CPU seconds of one point-to-point transfer, sender's and receiver's together."""
    sync_cpu_s: float = 0.0
    """CPU only: CPU seconds a rank pays per blocking wait (a TP all-reduce, a pipeline receive, a per-step sync)
    when ranks time-share the cores, beyond the collective itself: it gives up its core and comes back to cold
    caches (calibrate_ranks.sync_cost)."""
    wait_idle_table: dict[int, float] = field(default_factory=dict)
    """CPU only: seconds the cores idle per blocking all-reduce over n ranks when the ranks time-share them (a group
    meets only when every member has been scheduled: calibrate_ranks.wait_idle); the time-shared bound adds it per
    tensor-parallel all-reduce of a rank's step. Empty: none."""
    background_cores: float = 0.0
    """CPU only: cores' worth of CPU the node's ranks burn besides any step's work, taken from cores_per_node by
    the time-shared bound. Each gloo process group keeps a thread that wakes every 10 ms to poll, idle or not:
    ~1-2 ms of CPU per second each here (docs/benchmarks.md), so a process holding many groups (several
    Trainers alive at once) pays for them in every step. Measured in the
    ranks' launch (calibrate_ranks.background_cores); 0: none counted."""
    time_shared_scale: float = 1.0
    """CPU only: the measured step time of a reference configuration of the model over its predicted time-shared
    bound (search/step_probe.py), which multiplies every configuration's bound. The modelled CPU terms and the
    sharing probe leave out what a real step adds when ranks time-share the cores (cache refills after every
    switch, the trainer's own per-step work, busy gloo threads); one real step of the model measures their sum.
    A common factor: it moves the predicted level, not the ranking among bound-ruled configurations. 1: not
    measured (`autopar calibrate` does not know the model, so it writes 1)."""
    node_bandwidth_bytes_per_s: float = 0
    """Bytes per second all ranks of one node move between ranks together (0: no shared cap, each rank's
    link is its own, as NVLink ports and NICs are). A CPU host's ranks share one memory bus: their
    transfers together move about as fast as one pair's (docs/benchmarks.md)."""
    measured_at: float = 0.0
    all_to_all_table: dict[int, Link] = field(default_factory=dict)
    """Measured all-to-all per group size (autopar calibrate, gloo), fitted as (n - 1) latencies + (n - 1)/n of the
    bytes; empty: priced from the all-reduce figures (Cluster.all_to_all)."""
    compile_speedup: float = 0.0
    """Eager seconds / compiled seconds of a repeated block's forward and backward, measured on this machine
    (--compile, train/compile.py); 0: not measured, and the search does not compile."""
    compile_seconds: float = 0.0
    """Seconds one run spends compiling (once, amortised over the run's steps by the search)."""
    """When `autopar calibrate` measured these figures (seconds since the epoch, UTC; 0: not measured), so that a
    plan can say how old its calibration is."""
    devices: tuple[DeviceSpec, ...] = ()
    """Per device, in rank order: its speed (a multiple of flops_per_s) and memory; empty: all alike
    (hetero_cluster.py)."""
    links: tuple[LinkOverride, ...] = ()
    """Links between device groups that differ from the node links (hetero_cluster.py); empty: none."""

    # ---------------------------------------------------------------- geometry

    @property
    def memory_bytes(self) -> float:
        return self.memory_per_device_gb * 2**30

    def rate(self, dtype: str) -> float:
        """Sustained FLOP/s of one device for `dtype`."""
        if dtype not in self.flops_per_s:
            raise ConfigError(f"cluster {self.name!r} has no compute rate for dtype {dtype!r}; it lists "
                              f"{choices(self.flops_per_s)}; add flops_per_s.{dtype} to the cluster file")
        return self.flops_per_s[dtype] * self.compute_efficiency

    def link_for(self, span: int) -> Link:
        """The link a group uses whose ranks lie within `span` consecutive ranks."""
        return self.intra_node if span <= self.devices_per_node else self.inter_node

    # ---------------------------------------------------------------- collectives

    def p2p(self, nbytes: float, *, inter_node: bool) -> float:
        return (self.inter_node if inter_node else self.intra_node).p2p(nbytes)

    def all_reduce(self, nbytes: float, n: int, *, span: int | None = None) -> float:
        """Ring all-reduce of `nbytes` over `n` ranks spread over `span` consecutive ranks (default n)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        if n in self.allreduce_table and (span or n) <= self.devices_per_node:
            link = self.allreduce_table[n]
        else:
            link = self.link_for(span or n)
        return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bandwidth_bytes_per_s

    def _ring_half(self, table: dict[int, Link], nbytes: float, n: int, span: int | None) -> float:
        """(n-1) latencies + (n-1)/n of the bytes: the measured figures for n ranks in one node, else the link's."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        link = table[n] if n in table and (span or n) <= self.devices_per_node else self.link_for(span or n)
        return (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bandwidth_bytes_per_s

    def all_to_all(self, nbytes: float, n: int, *, span: int | None = None) -> float:
        """All-to-all of `nbytes` per rank over `n` ranks: each rank keeps 1/n and sends the rest in n - 1
        exchanges. Measured where calibrated (all_to_all_table); else the volume and step count of half a ring
        all-reduce, priced from the all-reduce figures for n ranks (allreduce_table, else the link)."""
        table = self.all_to_all_table if n in self.all_to_all_table else self.allreduce_table
        return self._ring_half(table, nbytes, n, span)

    def all_gather(self, nbytes: float, n: int, *, span: int | None = None) -> float:
        """All-gather into `nbytes` (the gathered whole) over `n` ranks: measured where calibrated, else the ring."""
        return self._ring_half(self.all_gather_table, nbytes, n, span)

    def reduce_scatter(self, nbytes: float, n: int, *, span: int | None = None) -> float:
        """Reduce-scatter of `nbytes` (the whole input) over `n` ranks: measured where calibrated, else the ring
        (the all-gather's volume, the other way)."""
        return self._ring_half(self.reduce_scatter_table, nbytes, n, span)

    @property
    def gloo(self) -> bool:
        """Whether the ranks talk over gloo: CPU ranks (a calibrated cluster, one with cores_per_node, or the
        cpu-local preset). The runtime picks some collectives by backend (zero/grads.py)."""
        return bool(self.cores_per_node) or self.name == "cpu-local"

    # ---------------------------------------------------------------- CPU the communication takes (time-sharing)

    def all_reduce_cpu(self, nbytes: float, n: int) -> float:
        """CPU seconds, summed over the n ranks, of one all-reduce of `nbytes` (0 without a calibrated table).
        A group larger than any calibrated one is costed at the largest, per rank."""
        if n <= 1 or nbytes <= 0 or not self.allreduce_cpu_table:
            return 0.0
        size = n if n in self.allreduce_cpu_table else max(self.allreduce_cpu_table)
        link = self.allreduce_cpu_table[size]
        return (2 * (size - 1) * link.latency_s + 2 * (size - 1) / size * nbytes / link.bandwidth_bytes_per_s) * \
            n / size

    def _ring_half_cpu(self, table: dict[int, Link], nbytes: float, n: int) -> float:
        size = n if n in table else max(table)
        link = table[size]
        return ((size - 1) * link.latency_s + (size - 1) / size * nbytes / link.bandwidth_bytes_per_s) * n / size

    def reduce_scatter_cpu(self, nbytes: float, n: int) -> float:
        """CPU seconds, summed over the n ranks, of one reduce-scatter of `nbytes` (the whole buffer); an
        all-reduce's without a calibrated table."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        if not self.reduce_scatter_cpu_table:
            return self.all_reduce_cpu(nbytes, n)
        return self._ring_half_cpu(self.reduce_scatter_cpu_table, nbytes, n)

    def all_gather_cpu(self, nbytes: float, n: int) -> float:
        """CPU seconds, summed over the n ranks, of one all-gather into `nbytes`; half an all-reduce's without a
        calibrated table (half its ring volume in half its steps)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        if not self.all_gather_cpu_table:
            return self.all_reduce_cpu(nbytes, n) / 2
        return self._ring_half_cpu(self.all_gather_cpu_table, nbytes, n)

    def p2p_cpu_s(self, nbytes: float) -> float:
        """CPU seconds of one point-to-point transfer of `nbytes`, both ends (0 without calibration)."""
        return self.p2p_cpu.p2p(nbytes) if self.p2p_cpu is not None and nbytes > 0 else 0.0

    # ---------------------------------------------------------------- file form

    def replace(self, **changes) -> Cluster:
        return dataclasses.replace(self, **changes)

    def wait_idle_s(self, n: int) -> float:
        """wait_idle_table's figure for a group of n ranks (the largest measured group below n where n was not)."""
        sizes = [k for k in self.wait_idle_table if k <= n]
        return self.wait_idle_table[max(sizes)] if n > 1 and sizes else 0.0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["allreduce_table"] = {str(n): dataclasses.asdict(link) for n, link in self.allreduce_table.items()}
        out["allreduce_cpu_table"] = {str(n): dataclasses.asdict(link) for n, link in self.allreduce_cpu_table.items()}
        for name in ("reduce_scatter_cpu_table", "all_gather_cpu_table", "reduce_scatter_table", "all_gather_table",
                     "all_to_all_table"):
            out[name] = {str(n): dataclasses.asdict(link) for n, link in getattr(self, name).items()}
        out["wait_idle_table"] = {str(n): v for n, v in self.wait_idle_table.items()}
        if self.p2p_cpu is None:
            del out["p2p_cpu"]
        del out["devices"], out["links"]
        return {**out, **hetero_to_dict(self)}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


# --------------------------------------------------------------------------------- loading


def _number(data: dict, key: str, where: str, *, minimum: float = 0.0, strict: bool = True,
            maximum: float | None = None, integer: bool = False) -> float:
    """A required number with a range check; the error names the field, the value and what works."""
    name = f"{where}{key}"
    if key not in data:
        raise ConfigError(f"cluster file: missing field {name!r}")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"cluster file: field {name!r} must be {kind}, got {value!r}")
    if not math.isfinite(value) or value < minimum or (strict and value == minimum) or \
            (maximum is not None and value > maximum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        upper = f" and <= {maximum:g}" if maximum is not None else ""
        raise ConfigError(f"cluster file: field {name!r} must be {bound}{upper}, got {value!r}")
    return value


def _link(data: dict, key: str) -> Link:
    table = data.get(key)
    if not isinstance(table, dict):
        raise ConfigError(f"cluster file: missing table [{key}] (latency_s and bandwidth_bytes_per_s)")
    return Link(latency_s=_number(table, "latency_s", f"{key}.", strict=False),
                bandwidth_bytes_per_s=_number(table, "bandwidth_bytes_per_s", f"{key}."))


def cluster_from_dict(data: dict) -> Cluster:
    """A Cluster from its TOML tables; every missing or impossible value is refused by name."""
    known = {f.name for f in dataclasses.fields(Cluster)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"cluster file: unknown field(s) {unknown}; valid fields: {choices(sorted(known))}")
    num_devices = int(_number(data, "num_devices", "", integer=True))
    per_node = int(_number(data, "devices_per_node", "", integer=True))
    if per_node > num_devices:
        raise ConfigError(f"cluster file: field 'devices_per_node' ({per_node}) cannot exceed 'num_devices' "
                          f"({num_devices})")
    if num_devices % per_node:
        raise ConfigError(f"cluster file: field 'num_devices' ({num_devices}) must be a multiple of "
                          f"'devices_per_node' ({per_node}): nodes are alike")
    rates = data.get("flops_per_s")
    if not isinstance(rates, dict) or not rates:
        raise ConfigError("cluster file: missing table [flops_per_s] (peak FLOP/s per dtype, e.g. fp32 = 1.9e13)")
    bad = sorted(set(rates) - set(DTYPES))
    if bad:
        raise ConfigError(f"cluster file: flops_per_s has unknown dtype(s) {bad}; use {choices(DTYPES)}")
    flops = {k: _number(rates, k, "flops_per_s.") for k in rates}
    def group_sizes(key: str) -> dict:
        """The table under `key` ({group size: value}), every key checked to be a group size >= 2."""
        table = data.get(key) or {}
        if not isinstance(table, dict):
            raise ConfigError(f"cluster file: {key} must be a table of group sizes, got {table!r}")
        for n in table:
            if not str(n).isdigit() or int(n) < 2:
                raise ConfigError(f"cluster file: {key} key {n!r} must be a group size >= 2")
        return table

    def group_table(key: str) -> dict[int, Link]:
        return {int(n): _link({f"{key}.{n}": link}, f"{key}.{n}") if isinstance(link, dict) else
                _link({}, f"{key}.{n}") for n, link in group_sizes(key).items()}
    cluster = Cluster(
        name=str(data.get("name", "custom")), source=str(data.get("source", "cluster file")),
        num_devices=num_devices, devices_per_node=per_node,
        memory_per_device_gb=_number(data, "memory_per_device_gb", ""),
        flops_per_s=flops,
        compute_efficiency=_number(data, "compute_efficiency", "", maximum=1.0),
        memory_bandwidth_bytes_per_s=_number(data, "memory_bandwidth_bytes_per_s", ""),
        intra_node=_link(data, "intra_node"), inter_node=_link(data, "inter_node"),
        per_action_overhead_s=_number(data, "per_action_overhead_s", "", strict=False) if
        "per_action_overhead_s" in data else 0.0,
        allreduce_table=group_table("allreduce_table"), allreduce_cpu_table=group_table("allreduce_cpu_table"),
        reduce_scatter_cpu_table=group_table("reduce_scatter_cpu_table"),
        all_gather_cpu_table=group_table("all_gather_cpu_table"),
        reduce_scatter_table=group_table("reduce_scatter_table"), all_gather_table=group_table("all_gather_table"),
        all_to_all_table=group_table("all_to_all_table"),
        p2p_cpu=_link(data, "p2p_cpu") if "p2p_cpu" in data else None,
        sync_cpu_s=_number(data, "sync_cpu_s", "", strict=False) if "sync_cpu_s" in data else 0.0,
        wait_idle_table={int(n): _number(table, n, "wait_idle_table.", strict=False)
                         for table in [group_sizes("wait_idle_table")] for n in table},
        memory_headroom=_number(data, "memory_headroom", "", minimum=1.0, strict=False) if
        "memory_headroom" in data else 1.1,
        cores_per_node=_number(data, "cores_per_node", "", strict=False) if "cores_per_node" in data else 0,
        background_cores=_number(data, "background_cores", "", strict=False) if "background_cores" in data else 0.0,
        time_shared_scale=_number(data, "time_shared_scale", "") if "time_shared_scale" in data else 1.0,
        node_bandwidth_bytes_per_s=_number(data, "node_bandwidth_bytes_per_s", "", strict=False)
        if "node_bandwidth_bytes_per_s" in data else 0,
        measured_at=_number(data, "measured_at", "", strict=False) if "measured_at" in data else 0.0,
        compile_speedup=_number(data, "compile_speedup", "", strict=False) if "compile_speedup" in data else 0.0,
        compile_seconds=_number(data, "compile_seconds", "", strict=False) if "compile_seconds" in data else 0.0,
        devices=devices_from_list(data.get("devices"), num_devices),
        links=links_from_list(data.get("links"), num_devices))
    if cluster.background_cores and cluster.background_cores >= (cluster.cores_per_node or float("inf")):
        raise ConfigError(f"cluster file: field 'background_cores' ({cluster.background_cores:g}) must be less than "
                          f"'cores_per_node' ({cluster.cores_per_node:g}): it is the part of those cores idle "
                          f"threads take")
    return cluster


def load_cluster(path: str | Path) -> Cluster:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"cluster file {str(path)!r} does not exist; give a file or a preset "
                          f"({choices(PRESET_NAMES)})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cluster file {str(path)!r} is not valid TOML: {exc}") from None
    return cluster_from_dict(data)


# --------------------------------------------------------------------------------- presets

_GB = 1e9
_TYPICAL = ("latencies (NVLink/PCIe 5 us, InfiniBand/Ethernet 10 us) and compute_efficiency 0.5 are typical "
            "values, not datasheet figures")


def _gpu(name: str, source: str, *, memory_gb: float, fp32: float, bf16: float, hbm: float, intra_bw: float,
         inter_bw: float, per_node: int, nodes: int) -> Cluster:
    return Cluster(name=name, source=f"{source}; {_TYPICAL}", num_devices=per_node * nodes,
                   devices_per_node=per_node, memory_per_device_gb=memory_gb,
                   flops_per_s={"fp32": fp32, "bf16": bf16}, compute_efficiency=0.5,
                   memory_bandwidth_bytes_per_s=hbm, intra_node=Link(5e-6, intra_bw), inter_node=Link(10e-6, inter_bw),
                   per_action_overhead_s=20e-6, memory_headroom=1.1)


def _presets() -> dict[str, Cluster]:
    """Built fresh on each call: no module-level mutable state."""
    return {
        "v100-16gb-nvlink": _gpu(
            "v100-16gb-nvlink", "NVIDIA V100 SXM2 datasheet: 15.7 TFLOPS fp32, 125 TFLOPS fp16 tensor core (used "
            "for bf16, which V100 lacks), 900 GB/s HBM2, NVLink 300 GB/s total (150 GB/s per direction); DGX-1 "
            "nodes of 8 with 4x100 Gb/s EDR InfiniBand (6.25 GB/s per GPU)",
            memory_gb=16, fp32=15.7e12, bf16=125e12, hbm=900 * _GB, intra_bw=150 * _GB, inter_bw=6.25 * _GB,
            per_node=8, nodes=8),
        "v100-32gb-nvlink": _gpu(
            "v100-32gb-nvlink", "NVIDIA V100 SXM2 32GB datasheet: 15.7 TFLOPS fp32, 125 TFLOPS fp16 tensor core "
            "(used for bf16, which V100 lacks), 900 GB/s HBM2, NVLink 300 GB/s total (150 GB/s per direction); "
            "nodes of 8 joined by one 100 Gb/s InfiniBand port per node (12.5 GB/s per node, 1.56 GB/s per GPU)",
            memory_gb=32, fp32=15.7e12, bf16=125e12, hbm=900 * _GB, intra_bw=150 * _GB, inter_bw=12.5 / 8 * _GB,
            per_node=8, nodes=8),
        "a100-40gb": _gpu(
            "a100-40gb", "NVIDIA A100 SXM4 40GB datasheet: 19.5 TFLOPS fp32, 312 TFLOPS bf16 dense, 1555 GB/s "
            "HBM2, NVLink 600 GB/s total (300 GB/s per direction); DGX A100 nodes of 8 with 8x200 Gb/s HDR "
            "InfiniBand (25 GB/s per GPU)",
            memory_gb=40, fp32=19.5e12, bf16=312e12, hbm=1555 * _GB, intra_bw=300 * _GB, inter_bw=25 * _GB,
            per_node=8, nodes=8),
        "a100-80gb": _gpu(
            "a100-80gb", "NVIDIA A100 SXM4 80GB datasheet: 19.5 TFLOPS fp32, 312 TFLOPS bf16 dense, 2039 GB/s "
            "HBM2e, NVLink 600 GB/s total (300 GB/s per direction); DGX A100 nodes of 8 with 8x200 Gb/s HDR "
            "InfiniBand (25 GB/s per GPU)",
            memory_gb=80, fp32=19.5e12, bf16=312e12, hbm=2039 * _GB, intra_bw=300 * _GB, inter_bw=25 * _GB,
            per_node=8, nodes=8),
        "h100-80gb": _gpu(
            "h100-80gb", "NVIDIA H100 SXM5 datasheet: 67 TFLOPS fp32, 989 TFLOPS bf16 dense, 3350 GB/s HBM3, "
            "NVLink 900 GB/s total (450 GB/s per direction); DGX H100 nodes of 8 with 8x400 Gb/s NDR "
            "InfiniBand (50 GB/s per GPU)",
            memory_gb=80, fp32=67e12, bf16=989e12, hbm=3350 * _GB, intra_bw=450 * _GB, inter_bw=50 * _GB,
            per_node=8, nodes=8),
        "rtx3090-24gb-pcie": _gpu(
            "rtx3090-24gb-pcie", "NVIDIA GeForce RTX 3090 datasheet: 35.6 TFLOPS fp32, 71 TFLOPS fp16/bf16 dense "
            "tensor core, 936 GB/s GDDR6X; no NVLink in this preset: PCIe 4.0 x16 32 GB/s per direction; nodes "
            "of 4 joined by 100 Gb/s Ethernet (12.5 GB/s per node, 3.1 GB/s per GPU)",
            memory_gb=24, fp32=35.6e12, bf16=71e12, hbm=936 * _GB, intra_bw=32 * _GB, inter_bw=3.125 * _GB,
            per_node=4, nodes=4),
        "cpu-local": _cpu_local(),
    }


def _cpu_local() -> Cluster:
    """This machine, uncalibrated: one rank per core, rough rates; run `autopar calibrate` to measure."""
    cores = os.cpu_count() or 1
    return Cluster(name="cpu-local", source="rough defaults for one CPU thread per rank (not measured: run "
                   "`autopar calibrate` for this machine's figures)", num_devices=max(8, cores),
                   devices_per_node=max(8, cores), memory_per_device_gb=4.0,
                   flops_per_s={"fp32": 2e10, "bf16": 1e10}, compute_efficiency=1.0,
                   memory_bandwidth_bytes_per_s=5 * _GB, intra_node=Link(50e-6, 1 * _GB), inter_node=Link(100e-6, 0.1 * _GB),
                   per_action_overhead_s=200e-6, memory_headroom=1.1, cores_per_node=cores,
                   node_bandwidth_bytes_per_s=1 * _GB)  # one shared memory bus: no faster than one pair


PRESET_NAMES = ("v100-16gb-nvlink", "v100-32gb-nvlink", "a100-40gb", "a100-80gb", "h100-80gb", "rtx3090-24gb-pcie", "cpu-local")


def preset(name: str) -> Cluster:
    table = _presets()
    if name not in table:
        raise ConfigError(f"unknown cluster preset {name!r}; use one of {choices(PRESET_NAMES)} or a TOML file")
    return table[name]


def resolve_cluster(spec: str | None, *, nproc: int | None = None, memory_per_device_gb: float | None = None) -> Cluster:
    """A preset name or a TOML path (default cpu-local), resized to `nproc` devices if asked."""
    spec = spec or "cpu-local"
    cluster = preset(spec) if spec in PRESET_NAMES else load_cluster(spec)
    return sized(cluster, nproc=nproc, memory_per_device_gb=memory_per_device_gb)


def sized(cluster: Cluster, *, nproc: int | None = None, memory_per_device_gb: float | None = None) -> Cluster:
    """`cluster` with `memory_per_device_gb` per device and `nproc` devices, if asked (checked)."""
    if memory_per_device_gb is not None:
        if not memory_per_device_gb > 0:
            raise ConfigError(f"--memory-per-device-gb must be > 0, got {memory_per_device_gb}")
        cluster = cluster.replace(memory_per_device_gb=float(memory_per_device_gb))
    if nproc is not None:
        if nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {nproc}")
        if (cluster.devices or cluster.links) and nproc != cluster.num_devices:
            raise ConfigError(f"--nproc {nproc} does not match cluster {cluster.name!r}, which describes each of "
                              f"its {cluster.num_devices} devices ([[devices]]/[[links]]); use --nproc "
                              f"{cluster.num_devices} or a file for {nproc} devices")
        per_node = min(cluster.devices_per_node, nproc)
        if nproc % per_node:
            raise ConfigError(f"--nproc {nproc} is not a whole number of {cluster.name} nodes of "
                              f"{cluster.devices_per_node} devices; use a multiple of {cluster.devices_per_node}")
        cluster = cluster.replace(num_devices=nproc, devices_per_node=per_node)
    return cluster


def cluster_for_ranks(spec: str | None, world: int) -> Cluster:
    """The cluster a running job of `world` ranks prices its boundary transfers on (--boundary auto): the
    preset or file as given; cpu-local, being this one machine, as one node that holds all `world` ranks. Not the
    search's cached calibration (calibration_cache.py): that is per host, and every rank must choose alike."""
    cluster = resolve_cluster(spec)
    if cluster.name == "cpu-local" and world > cluster.devices_per_node:
        cluster = cluster.replace(num_devices=world, devices_per_node=world)
    return cluster
