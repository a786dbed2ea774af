"""Plan one cross-mesh transfer: tiles, a sender per tile (or per part), the method, bytes per link, a cost.

Tiles are the intersections of the source pieces with the destination pieces (Alpa's unit tasks):
each has candidate senders (the source ranks holding it) and needers (the destination ranks whose
piece contains it). A needer that already holds the tile copies it locally; the others receive it by

    naive           the whole tensor from src.ranks[0] (each source chunk from its owner, when the
                    source is split) to every destination rank, which then keeps its piece; what
                    autopar's pipeline does today, and the baseline
    send_recv       each tile from one sender to each needer
    scatter_gather  the tile cut into one flat part per needer; part j goes from a sender to needer j,
                    then the needers all-gather the parts (Megatron's trick: each link carries 1/t);
                    only tiles with several needers (a replicated destination) are cut, others go as
                    send_recv
    broadcast       one broadcast per tile from its sender to its needers, in a group made at set-up
                    (a single needer gets a plain send)

Senders are chosen greedily, Alpa's load balance (send_recv picks one per receiver, scatter_gather
one per part, broadcast one per tile): jobs in decreasing bytes, each to the candidate
with the fewest bytes so far. Candidates are either one rank (a split source) or every source rank
(a replicated one) and jobs of one plan have equal sizes, where this greedy is optimal; in general it
is Graham's LPT rule, within 4/3 of the optimum (tests/test_resharding_plan.py checks both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError, choices
from .cost import link_model, node_seconds, phase_seconds
from .layout import Box, Layout, contains, intersect, numel

METHODS = ("naive", "send_recv", "scatter_gather", "broadcast")
_AUTO_ORDER = ("send_recv", "scatter_gather", "broadcast", "naive")  # ties go to the simplest
_DTYPE_BY_ITEMSIZE = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@dataclass(frozen=True)
class Tile:
    """One unit task: a box of the tensor, who holds it, who needs it, and who sends what."""

    box: Box
    candidates: tuple[int, ...]  # source ranks holding the box (tp order)
    needers: tuple[int, ...]  # destination ranks that need it (tp order)
    senders: tuple[int | None, ...]
    """Who sends: naive and broadcast, one sender for the whole tile; send_recv, one per receiver (in
    `receivers` order); scatter_gather, one per part (part j for needers[j], None where that needer
    holds the tile). () when every needer holds the tile already."""

    @property
    def receivers(self) -> tuple[int, ...]:
        """The needers that do not hold the tile and so receive it."""
        return tuple(r for r in self.needers if r not in self.candidates)

    @property
    def numel(self) -> int:
        return numel(self.box)

    def part_range(self, j: int) -> tuple[int, int]:
        """Flat element range of part j of a scatter-gathered tile (parts of ceil(numel / needers))."""
        size = -(-self.numel // len(self.needers))
        return min(j * size, self.numel), min((j + 1) * size, self.numel)

    @property
    def part_numel(self) -> int:
        """Padded part size: every needer's all-gather contribution has this many elements."""
        return -(-self.numel // len(self.needers))


@dataclass(frozen=True)
class ReshardPlan:
    """How one tensor moves from `src` to `dst`: the tiles, their senders, bytes per link and a prediction."""

    shape: tuple[int, ...]
    itemsize: int
    dtype: torch.dtype
    src: Layout
    dst: Layout
    method: str
    tiles: tuple[Tile, ...]
    gather_ranks: tuple[int, ...]  # scatter_gather: the destination ranks that all-gather the parts; else ()
    link_bytes: tuple[tuple[tuple[int, int], int], ...]
    """((from, to), bytes) per directed link: point-to-point bytes exactly; broadcasts as a chain
    (root, receivers in order) and the all-gather as a ring over gather_ranks, the models' traffic."""
    predicted_s: float  # a prediction of the cost model (cost.py), not a measurement
    link_source: str
    alternatives: tuple[tuple[str, float], ...] = ()  # with method="auto": every method's prediction

    @property
    def nbytes(self) -> int:
        return numel(tuple((0, n) for n in self.shape)) * self.itemsize

    def bytes_by_link(self) -> dict[tuple[int, int], int]:
        return dict(self.link_bytes)

    def max_link_bytes(self) -> int:
        return max((b for _, b in self.link_bytes), default=0)

    def sent_by_rank(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for (a, _), b in self.link_bytes:
            out[a] = out.get(a, 0) + b
        return out

    def broadcast_groups(self) -> list[tuple[int, ...]]:
        """The (sender, receivers) groups the executor must create, in tile order."""
        if self.method != "broadcast":
            return []
        return [(t.senders[0], *t.receivers) for t in self.tiles if t.senders and len(t.receivers) > 1]

    def describe(self) -> str:
        """One line for `autopar plan`."""
        alts = ""
        if self.alternatives:
            alts = " (auto; " + ", ".join(f"{m} {s * 1e3:.3g} ms" for m, s in self.alternatives) + ")"
        return (f"reshard {list(self.shape)} x{self.itemsize} B ({_size(self.nbytes)}) {self.src.describe()} -> "
                f"{self.dst.describe()}: {self.method}, {len(self.tiles)} tile(s), max {_size(self.max_link_bytes())} "
                f"per link, predicted {self.predicted_s * 1e3:.3g} ms{alts}")


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""  # pragma: no cover


def balance(jobs: list[tuple[int, tuple[int, ...]]], loads: dict[int, int] | None = None) -> list[int]:
    """Greedy sender choice: jobs (bytes, candidate ranks) in decreasing bytes (stable), each to the
    least-loaded candidate (the first in candidate order on a tie). Returns the chosen rank per job."""
    loads = {} if loads is None else loads
    chosen = [0] * len(jobs)
    for i in sorted(range(len(jobs)), key=lambda k: -jobs[k][0]):
        nbytes, candidates = jobs[i]
        best = min(candidates, key=lambda r: loads.get(r, 0))
        loads[best] = loads.get(best, 0) + nbytes
        chosen[i] = best
    return chosen


def _validate(shape, itemsize, src, dst, method, dtype) -> tuple[tuple[int, ...], torch.dtype]:
    try:
        shape = tuple(shape)
    except TypeError:
        raise ConfigError(f"resharding: shape must be a sequence of dim sizes, got {shape!r}") from None
    if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
        raise ConfigError(f"resharding: shape must list one or more dim sizes >= 1, got {list(shape)}")
    for name, layout in (("src", src), ("dst", dst)):
        if not isinstance(layout, Layout):
            raise ConfigError(f"resharding: {name} must be a Layout(ranks, shard_dim), got {layout!r}")
    src.check(shape, "resharding source")
    dst.check(shape, "resharding destination")
    if method not in (*METHODS, "auto"):
        raise ConfigError(f"resharding method {method!r} is unknown; use one of {choices((*METHODS, 'auto'))}")
    if dtype is None:
        if itemsize not in _DTYPE_BY_ITEMSIZE:
            raise ConfigError(f"resharding: itemsize must be one of {choices(_DTYPE_BY_ITEMSIZE)} bytes (or pass "
                              f"dtype), got {itemsize!r}")
        dtype = _DTYPE_BY_ITEMSIZE[itemsize]
    elif torch.empty((), dtype=dtype).element_size() != itemsize:
        raise ConfigError(f"resharding: itemsize {itemsize} does not match dtype {dtype} "
                          f"({torch.empty((), dtype=dtype).element_size()} bytes)")
    return shape, dtype


def plan_resharding(shape, itemsize: int, src: Layout, dst: Layout, method: str = "auto", link=None, *,
                    dtype: torch.dtype | None = None) -> ReshardPlan:
    """Plan moving a tensor of `shape` (elements of `itemsize` bytes) from layout `src` to `dst`.

    method: one of METHODS, or "auto" for the cheapest by the cost model. link: None (nominal figures),
    a search.cluster.Link, or a search.cluster.Cluster (see cost.link_model). dtype: the element type
    the executor allocates (default: float of that itemsize; uint8 for 1 byte).
    """
    shape, dtype = _validate(shape, itemsize, src, dst, method, dtype)
    if method == "auto":
        plans = [_plan(shape, itemsize, dtype, src, dst, m, link) for m in _AUTO_ORDER]
        best = min(plans, key=lambda p: p.predicted_s)  # min keeps the first of equal ones
        return _replace(best, alternatives=tuple((p.method, p.predicted_s) for p in plans))
    return _plan(shape, itemsize, dtype, src, dst, method, link)


def _replace(plan: ReshardPlan, **changes) -> ReshardPlan:
    import dataclasses
    return dataclasses.replace(plan, **changes)


def _plan(shape, itemsize, dtype, src: Layout, dst: Layout, method: str, link) -> ReshardPlan:
    if method == "naive":
        boxes = src.pieces(shape)  # each source chunk whole, to every destination rank
        tiles = [(box, tuple(r for r in src.ranks if contains(src.box_of(r, shape), box)), dst.ranks) for box in boxes]
    else:
        tiles = []
        for sbox in src.pieces(shape):
            for dbox in dst.pieces(shape):
                box = intersect(sbox, dbox)
                if box is not None:
                    tiles.append((box,
                                  tuple(r for r in src.ranks if contains(src.box_of(r, shape), box)),
                                  tuple(r for r in dst.ranks if contains(dst.box_of(r, shape), box))))
    gathered = method == "scatter_gather" and dst.replicated and dst.tp > 1
    # the jobs the greedy balances: (bytes a sender sends, candidates), one per tile or per part
    jobs, owners = [], []
    for t, (box, candidates, needers) in enumerate(tiles):
        remote = [r for r in needers if r not in candidates]
        nbytes = numel(box) * itemsize
        if not remote:
            continue
        if method == "naive":
            continue  # fixed sender: src.ranks[0] (or the chunk's owner)
        if gathered:
            size = -(-numel(box) // len(needers))
            for j, r in enumerate(needers):
                lo, hi = min(j * size, numel(box)), min((j + 1) * size, numel(box))
                if r not in candidates:
                    jobs.append(((hi - lo) * itemsize, candidates))
                    owners.append((t, j))
        elif method == "send_recv":  # each receiver from its own least-loaded holder
            for j in range(len(remote)):
                jobs.append((nbytes, candidates))
                owners.append((t, j))
        else:
            jobs.append((nbytes, candidates))
            owners.append((t, 0))
    chosen = dict(zip(owners, balance(jobs)))
    built = []
    for t, (box, candidates, needers) in enumerate(tiles):
        remote = [r for r in needers if r not in candidates]
        if not remote:
            senders = ()
        elif method == "naive":
            senders = (candidates[0],)
        elif gathered:
            senders = tuple(chosen.get((t, j)) for j in range(len(needers)))
        elif method == "send_recv":
            senders = tuple(chosen[(t, j)] for j in range(len(remote)))
        else:
            senders = (chosen[(t, 0)],)
        built.append(Tile(box, candidates, needers, senders))
    gather_ranks = dst.ranks if gathered and any(t.senders for t in built) else ()
    link_bytes, p2p, chains, gather_total = _traffic(built, method, gathered, gather_ranks, itemsize)
    involved = tuple(sorted(set(src.ranks) | set(dst.ranks)))
    model, all_gather = link_model(link, involved)
    seconds = phase_seconds(p2p, chains, model)
    if gather_ranks:
        gather_model, gather_cost = link_model(link, tuple(sorted(gather_ranks)))
        n = len(gather_ranks)
        ring = [(r, gather_ranks[(i + 1) % n], (n - 1) * gather_total // n) for i, r in enumerate(gather_ranks)]
        seconds += max(gather_cost(gather_total, n), node_seconds(ring, gather_model, (n - 1) * gather_model.latency_s))
    return ReshardPlan(shape=shape, itemsize=itemsize, dtype=dtype, src=src, dst=dst, method=method,
                       tiles=tuple(built), gather_ranks=gather_ranks,
                       link_bytes=tuple(sorted(link_bytes.items())), predicted_s=seconds, link_source=model.source)


def _traffic(tiles: list[Tile], method: str, gathered: bool, gather_ranks: tuple[int, ...], itemsize: int):
    """Bytes per directed link, and the messages / chains / all-gather volume the cost model prices."""
    link_bytes: dict[tuple[int, int], int] = {}
    p2p, chains = [], []

    def add(a: int, b: int, nbytes: int) -> None:
        link_bytes[(a, b)] = link_bytes.get((a, b), 0) + nbytes

    for tile in tiles:
        nbytes = tile.numel * itemsize
        if not tile.senders:
            continue
        if gathered:
            for j, sender in enumerate(tile.senders):
                lo, hi = tile.part_range(j)
                if sender is not None and hi > lo:
                    add(sender, tile.needers[j], (hi - lo) * itemsize)
                    p2p.append((sender, tile.needers[j], (hi - lo) * itemsize))
        elif method == "broadcast" and len(tile.receivers) > 1:
            members = (tile.senders[0], *tile.receivers)
            for a, b in zip(members, members[1:]):
                add(a, b, nbytes)
            chains.append((members, nbytes))
        else:
            for sender, r in zip(receiver_senders(tile, method), tile.receivers):
                add(sender, r, nbytes)
                p2p.append((sender, r, nbytes))
    gather_total = 0
    if gather_ranks:
        n = len(gather_ranks)
        per_rank = sum(t.part_numel for t in tiles if t.senders) * itemsize
        gather_total = per_rank * n
        for i, r in enumerate(gather_ranks):
            add(r, gather_ranks[(i + 1) % n], (n - 1) * per_rank)
    return link_bytes, p2p, chains, gather_total


def receiver_senders(tile: Tile, method: str) -> tuple[int, ...]:
    """The sender of each of `tile.receivers` for point-to-point methods."""
    return tile.senders if method == "send_recv" else tile.senders * len(tile.receivers)
