"""Uneven machines: each device's own speed and memory, and links that differ pair by pair.

A homogeneous cluster (cluster.py) says one rate, one memory size and two links (inside a node, between
nodes). A mixed cluster adds, in the same file:

    [[devices]]            # one table per device, in rank order (all or none)
    speed = 1.0            # multiplies flops_per_s: 0.5 is a device at half the rate
    memory_gb = 80.0       # optional: this device's memory (default memory_per_device_gb)

    [[links]]              # optional overrides of the node links, applied in order
    a = [0, 1]             # every pair between group a and group b (b omitted: every pair inside a)
    b = [2, 3]
    latency_s = 1e-3
    bandwidth_bytes_per_s = 1.25e8

so a file can state a cluster one does not have (a slow data-centre link, an older GPU generation beside a
newer one). A group of devices moves data at the pace of its slowest pair (a ring waits for its slowest hop),
and computes at the pace of its slowest member (a synchronous step waits for it). Without [[devices]] and
[[links]] every function here gives the homogeneous figures, so presets and old files load unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .cluster import Cluster, Link


@dataclass(frozen=True)
class DeviceSpec:
    """One device's speed (a multiple of the cluster's flops_per_s) and, when it differs, its memory."""

    speed: float = 1.0
    memory_gb: float | None = None


@dataclass(frozen=True)
class LinkOverride:
    """The link between every device of `a` and every device of `b` (`b` empty: every pair inside `a`)."""

    a: tuple[int, ...]
    b: tuple[int, ...]
    latency_s: float
    bandwidth_bytes_per_s: float

    def covers(self, i: int, j: int) -> bool:
        if not self.b:
            return i in self.a and j in self.a
        return (i in self.a and j in self.b) or (i in self.b and j in self.a)


# --------------------------------------------------------------------------------- reading the file


def _positive(value: object, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"cluster file: field {name!r} must be a number {bound}, got {value!r}")
    return float(value)


def devices_from_list(entries: object, num_devices: int) -> tuple[DeviceSpec, ...]:
    """[[devices]] tables: one per device, or none at all."""
    if entries is None:
        return ()
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError("cluster file: 'devices' must be an array of tables ([[devices]] with speed and "
                          "optionally memory_gb), one per device in rank order")
    if len(entries) != num_devices:
        raise ConfigError(f"cluster file: {len(entries)} [[devices]] table(s) for num_devices = {num_devices}; "
                          f"give one per device (or none: every device alike)")
    specs = []
    for k, entry in enumerate(entries):
        unknown = sorted(set(entry) - {"speed", "memory_gb"})
        if unknown:
            raise ConfigError(f"cluster file: devices[{k}] has unknown field(s) {unknown}; valid: speed, memory_gb")
        speed = _positive(entry.get("speed", 1.0), f"devices[{k}].speed")
        memory = _positive(entry["memory_gb"], f"devices[{k}].memory_gb") if "memory_gb" in entry else None
        specs.append(DeviceSpec(speed=speed, memory_gb=memory))
    return tuple(specs)


def links_from_list(entries: object, num_devices: int) -> tuple[LinkOverride, ...]:
    """[[links]] tables: device groups a (and b) with the latency and bandwidth between them."""
    if entries is None:
        return ()
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError("cluster file: 'links' must be an array of tables ([[links]] with a, optionally b, "
                          "latency_s and bandwidth_bytes_per_s)")
    out = []
    for k, entry in enumerate(entries):
        unknown = sorted(set(entry) - {"a", "b", "latency_s", "bandwidth_bytes_per_s"})
        if unknown:
            raise ConfigError(f"cluster file: links[{k}] has unknown field(s) {unknown}; valid: a, b, latency_s, "
                              f"bandwidth_bytes_per_s")
        groups = []
        for side in ("a", "b"):
            members = entry.get(side, [])
            if side == "a" and not members:
                raise ConfigError(f"cluster file: links[{k}] needs 'a', a list of device indices")
            if not isinstance(members, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                        for d in members):
                raise ConfigError(f"cluster file: links[{k}].{side} must be a list of device indices, got "
                                  f"{members!r}")
            outside = [d for d in members if not 0 <= d < num_devices]
            if outside:
                raise ConfigError(f"cluster file: links[{k}].{side} names device(s) {outside} outside 0.."
                                  f"{num_devices - 1} (num_devices = {num_devices})")
            groups.append(tuple(members))
        for field in ("latency_s", "bandwidth_bytes_per_s"):
            if field not in entry:
                raise ConfigError(f"cluster file: links[{k}] is missing {field!r}")
        out.append(LinkOverride(a=groups[0], b=groups[1],
                                latency_s=_positive(entry["latency_s"], f"links[{k}].latency_s", allow_zero=True),
                                bandwidth_bytes_per_s=_positive(entry["bandwidth_bytes_per_s"],
                                                                f"links[{k}].bandwidth_bytes_per_s")))
    return tuple(out)


def hetero_to_dict(cluster: Cluster) -> dict:
    """The [[devices]] and [[links]] tables of `cluster` (empty when it has none)."""
    out: dict = {}
    if cluster.devices:
        out["devices"] = [{"speed": d.speed, **({"memory_gb": d.memory_gb} if d.memory_gb is not None else {})}
                          for d in cluster.devices]
    if cluster.links:
        out["links"] = [{"a": list(o.a), **({"b": list(o.b)} if o.b else {}), "latency_s": o.latency_s,
                         "bandwidth_bytes_per_s": o.bandwidth_bytes_per_s} for o in cluster.links]
    return out


# --------------------------------------------------------------------------------- what the plans read


def is_heterogeneous(cluster: Cluster) -> bool:
    return any(d.speed != 1.0 or d.memory_gb is not None for d in cluster.devices) or bool(cluster.links)


def device_speed(cluster: Cluster, device: int) -> float:
    """Device `device`'s rate as a multiple of the cluster's (1 without [[devices]])."""
    return cluster.devices[device].speed if cluster.devices else 1.0


def device_memory_gb(cluster: Cluster, device: int) -> float:
    spec = cluster.devices[device] if cluster.devices else None
    return spec.memory_gb if spec is not None and spec.memory_gb is not None else cluster.memory_per_device_gb


def link_between(cluster: Cluster, i: int, j: int) -> Link:
    """The link device i uses to reach device j: the last [[links]] entry covering the pair, else the node's."""
    for override in reversed(cluster.links):
        if override.covers(i, j):
            from .cluster import Link
            return Link(override.latency_s, override.bandwidth_bytes_per_s)
    same_node = i // cluster.devices_per_node == j // cluster.devices_per_node
    return cluster.intra_node if same_node else cluster.inter_node


def ring_link(cluster: Cluster, devices: list[int] | tuple[int, ...]) -> Link:
    """The link a ring over `devices` runs at: the slowest bandwidth and the largest latency of its hops."""
    from .cluster import Link
    n = len(devices)
    hops = [link_between(cluster, devices[k], devices[(k + 1) % n]) for k in range(n)] if n > 1 else \
        [cluster.intra_node]
    return Link(max(h.latency_s for h in hops), min(h.bandwidth_bytes_per_s for h in hops))


def group_all_reduce(cluster: Cluster, nbytes: float, devices: list[int] | tuple[int, ...]) -> float:
    """Ring all-reduce of `nbytes` over `devices` in the given order (the alpha-beta ring of cluster.py)."""
    n = len(devices)
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = ring_link(cluster, devices)
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bandwidth_bytes_per_s


def group_speed(cluster: Cluster, devices: list[int] | tuple[int, ...]) -> float:
    """A synchronous group computes at its slowest member's pace."""
    return min(device_speed(cluster, d) for d in devices)


def surviving_cluster(cluster: Cluster, kept: list[int] | tuple[int, ...]) -> Cluster:
    """`cluster` cut down to the devices `kept` (their indices in it), which become devices 0..len(kept)-1 in
    that order, each with its own speed and memory and every pair with the link it had (a job that lost ranks
    goes on on these). Nodes stay nodes where the kept devices still fill them alike; else each device is a node
    of its own and the links inside the old nodes are stated pair by pair."""
    n, size = len(kept), cluster.devices_per_node
    old_node = [d // size for d in kept]
    per_node = min(size, n)
    if n % per_node or any((i // per_node == j // per_node) != (old_node[i] == old_node[j])
                           for i in range(n) for j in range(n)):
        per_node = 1
    smaller = cluster.replace(num_devices=n, devices_per_node=per_node, links=(),
                              devices=tuple(cluster.devices[d] for d in kept) if cluster.devices else ())
    links = tuple(LinkOverride(a=(i,), b=(j,), latency_s=had.latency_s,
                               bandwidth_bytes_per_s=had.bandwidth_bytes_per_s)
                  for i in range(n) for j in range(i + 1, n)
                  if (had := link_between(cluster, kept[i], kept[j])) != link_between(smaller, i, j))
    return smaller.replace(links=links)
