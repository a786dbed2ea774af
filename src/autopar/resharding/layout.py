"""Where the pieces of one tensor live: a tensor-parallel group's ranks and the dim it is split on.

Pieces are boxes: one (start, stop) element range per dim. A replicated layout gives every rank
the whole box; a sharded one gives rank i chunk i along `shard_dim`, as torch.chunk would, but only
when the split is even (an uneven split would give the last rank a smaller piece, which no
tensor-parallel layer in autopar produces, so it is refused rather than half supported).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim


@dataclass(frozen=True)
class Layout:
    """One tensor-parallel group's hold on a tensor: its global ranks (in tp order) and the split dim."""

    ranks: tuple[int, ...]
    shard_dim: int | None = None

    def __post_init__(self) -> None:
        ranks = tuple(self.ranks)
        if not ranks:
            raise ConfigError("a resharding layout needs at least one rank, got ranks=()")
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
            raise ConfigError(f"layout ranks must be global ranks (integers >= 0), got {ranks}")
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"layout ranks must be distinct, got {ranks}")
        if self.shard_dim is not None and (isinstance(self.shard_dim, bool) or not isinstance(self.shard_dim, int)
                                           or self.shard_dim < 0):
            raise ConfigError(f"shard_dim must be None (replicated) or a dim index >= 0, got {self.shard_dim!r}")
        object.__setattr__(self, "ranks", ranks)

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @property
    def replicated(self) -> bool:
        return self.shard_dim is None or self.tp == 1

    def check(self, shape: tuple[int, ...], role: str = "layout") -> None:
        """Refuse a shape this layout cannot split evenly, naming the value and what would work."""
        if self.shard_dim is None:
            return
        if self.shard_dim >= len(shape):
            raise ConfigError(f"{role}: shard_dim {self.shard_dim} is out of range for a tensor of shape "
                              f"{list(shape)} ({len(shape)} dims); use 0..{len(shape) - 1} or None (replicated)")
        size = shape[self.shard_dim]
        if size % self.tp:
            raise ConfigError(f"{role}: dim {self.shard_dim} of shape {list(shape)} has size {size}, which "
                              f"{self.tp} ranks cannot split evenly; use a tp that divides {size}, another dim, "
                              f"or None (replicated)")

    def box_of(self, rank: int, shape: tuple[int, ...]) -> Box:
        """The element ranges `rank` holds (its chunk, or the whole tensor when replicated)."""
        whole = tuple((0, n) for n in shape)
        if self.replicated:
            return whole
        i = self.ranks.index(rank)
        step = shape[self.shard_dim] // self.tp
        return whole[:self.shard_dim] + ((i * step, (i + 1) * step),) + whole[self.shard_dim + 1:]

    def pieces(self, shape: tuple[int, ...]) -> list[Box]:
        """The distinct boxes of this layout (one when replicated, tp when sharded), in rank order."""
        if self.replicated:
            return [self.box_of(self.ranks[0], shape)]
        return [self.box_of(r, shape) for r in self.ranks]

    def describe(self) -> str:
        where = "replicated" if self.shard_dim is None else f"split on dim {self.shard_dim}"
        return f"tp{self.tp} {list(self.ranks)} {where}"


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of two boxes, or None when they do not overlap."""
    out = tuple((max(lo1, lo2), min(hi1, hi2)) for (lo1, hi1), (lo2, hi2) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def contains(outer: Box, inner: Box) -> bool:
    return all(olo <= ilo and ihi <= ohi for (olo, ohi), (ilo, ihi) in zip(outer, inner))


def numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def shape_of(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def local_slices(box: Box, within: Box) -> tuple[slice, ...]:
    """Index of `box` inside a tensor that holds `within` (box must lie inside it)."""
    return tuple(slice(lo - wlo, hi - wlo) for (lo, hi), (wlo, _) in zip(box, within))
