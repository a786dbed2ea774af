"""Predicted seconds of a resharding plan, on the alpha-beta link model of search/cluster.py.

A link is latency plus bytes over bandwidth. Every rank has one link out and one in (its NIC), so
point-to-point sends from one rank serialise, and the transfer phase lasts as long as the busiest
rank's sends or receives. A broadcast is costed as a chunked chain, Alpa's model: (k-1) latencies
plus bytes / bandwidth however many receive. The scatter-gather all-gather uses the ring formula
search/cluster.py states, through the cluster's own `all_gather` when a cluster is given.

Ranks of one node may also share one fabric (a CPU host's loopback copies all cross one memory
bus): a cluster with `node_bandwidth_bytes_per_s` > 0 caps the bytes all ranks of a node move
together, so a phase lasts at least its busiest node's bytes over that figure (plus the busiest
rank's latencies). Without the cap, fewer bytes per link always look faster, which is true between
hosts and false on one host (docs/benchmarks.md measures both).

The figures are predictions of a model, never measurements; benchmarks/resharding.py measures.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class LinkModel:
    """The alpha-beta figures the planner costs with (duck-types search.cluster.Link)."""

    latency_s: float
    bandwidth_bytes_per_s: float
    source: str = "given"
    node_bandwidth_bytes_per_s: float = 0.0  # bytes/s all ranks of one node move together; 0: no shared cap
    devices_per_node: int = 0  # ranks r and q share a node when r // devices_per_node == q // devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node if self.devices_per_node > 0 else 0

    def p2p(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def all_gather(self, nbytes: float, n: int) -> float:
        """Ring all-gather of a result of `nbytes` over n ranks (cluster.py's formula)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return (n - 1) * self.latency_s + (n - 1) / n * nbytes / self.bandwidth_bytes_per_s


NOMINAL = LinkModel(50e-6, 1e9, "nominal 50 us + 1 GB/s (no link given)")


def link_model(link, ranks: tuple[int, ...]) -> tuple[LinkModel, object]:
    """(point-to-point link, all-gather costing) for a transfer among `ranks`.

    `link` may be None (a nominal link), anything with latency_s and bandwidth_bytes_per_s (a
    search.cluster.Link), or a cluster (anything with link_for and all_gather: search.cluster.Cluster),
    which picks its intra- or inter-node link by the ranks' span and costs the all-gather itself.
    """
    if link is None:
        return NOMINAL, NOMINAL.all_gather
    if hasattr(link, "link_for") and hasattr(link, "all_gather"):
        span = max(ranks) - min(ranks) + 1
        chosen = link.link_for(span)
        node_bw = float(getattr(link, "node_bandwidth_bytes_per_s", 0.0) or 0.0)
        model = LinkModel(chosen.latency_s, chosen.bandwidth_bytes_per_s, f"cluster {getattr(link, 'name', '?')}",
                          node_bw, int(getattr(link, "devices_per_node", 0) or 0) if node_bw > 0 else 0)
        return model, lambda nbytes, n: link.all_gather(nbytes, n, span=span)
    try:
        model = LinkModel(float(link.latency_s), float(link.bandwidth_bytes_per_s))
    except (AttributeError, TypeError, ValueError):
        raise ConfigError(f"link must have latency_s and bandwidth_bytes_per_s (a search.cluster.Link) or be a "
                          f"cluster, got {link!r}") from None
    if not (model.latency_s >= 0 and model.bandwidth_bytes_per_s > 0):
        raise ConfigError(f"link needs latency_s >= 0 and bandwidth_bytes_per_s > 0, got {model.latency_s} s "
                          f"and {model.bandwidth_bytes_per_s} B/s")
    return model, model.all_gather


def phase_seconds(p2p: list[tuple[int, int, int]], chains: list[tuple[tuple[int, ...], int]],
                  link: LinkModel) -> float:
    """The transfer phase: point-to-point messages (sender, receiver, bytes) and broadcast chains
    (members, bytes); each rank's sends, receives and chains add up, the busiest rank decides, unless
    the link model caps a node's aggregate bytes (`node_seconds`) and that takes longer."""
    out: dict[int, float] = {}
    inn: dict[int, float] = {}
    latency: dict[int, float] = {}
    hops: list[tuple[int, int, int]] = []
    for a, b, nbytes in p2p:
        out[a] = out.get(a, 0.0) + link.p2p(nbytes)
        inn[b] = inn.get(b, 0.0) + link.p2p(nbytes)
        for r in (a, b):
            latency[r] = latency.get(r, 0.0) + link.latency_s
        hops.append((a, b, nbytes))
    for members, nbytes in chains:
        seconds = (len(members) - 1) * link.latency_s + nbytes / link.bandwidth_bytes_per_s
        for r in members:
            out[r] = out.get(r, 0.0) + seconds
            latency[r] = latency.get(r, 0.0) + (len(members) - 1) * link.latency_s
        hops.extend((a, b, nbytes) for a, b in zip(members, members[1:]))
    busiest = max([0.0, *out.values(), *inn.values()])
    return max(busiest, node_seconds(hops, link, max([0.0, *latency.values()])))


def node_seconds(hops, link: LinkModel, latency_s: float = 0.0) -> float:
    """Time for the busiest node to move its share of `hops` (sender, receiver, bytes) through its shared
    fabric: a hop inside a node counts once there, a hop between nodes once on each. 0 without a cap."""
    if link.node_bandwidth_bytes_per_s <= 0:
        return 0.0
    per_node: dict[int, int] = {}
    for a, b, nbytes in hops:
        for node in {link.node_of(a), link.node_of(b)}:
            per_node[node] = per_node.get(node, 0) + nbytes
    if not per_node:
        return 0.0
    return latency_s + max(per_node.values()) / link.node_bandwidth_bytes_per_s


def boundary_cost(shape, itemsize: int, src_tp: int, dst_tp: int, cluster, *, src_shard_dim: int | None = None,
                  dst_shard_dim: int | None = None, method: str = "auto") -> float:
    """Predicted seconds to move one pipeline boundary tensor from a stage of `src_tp` ranks to the next
    stage's `dst_tp` ranks (adjacent rank blocks, as a pipeline lays them out), by the cheapest method.

    The default layouts are Megatron's: a stage's output is replicated over its tp ranks and the next
    stage wants it replicated. The strategy search calls this per cut to price per-stage layouts.
    """
    from .layout import Layout
    from .planner import plan_resharding

    for name, tp in (("src_tp", src_tp), ("dst_tp", dst_tp)):
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"boundary_cost: {name} must be an integer >= 1, got {tp!r}")
    src = Layout(tuple(range(src_tp)), src_shard_dim)
    dst = Layout(tuple(range(src_tp, src_tp + dst_tp)), dst_shard_dim)
    return plan_resharding(tuple(shape), itemsize, src, dst, method=method, link=cluster).predicted_s
