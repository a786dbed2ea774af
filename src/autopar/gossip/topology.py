"""Gossip graphs and their mixing matrices (D-PSGD, Lian et al. 2017).

A topology is a doubly-stochastic mixing matrix W over the n data-parallel replicas:
replica i's gossip step replaces its model by sum_j W[i, j] x_j, so it needs the models of
its in-neighbours {j != i : W[i, j] > 0} and sends its own to its out-neighbours
{k != i : W[k, i] > 0}. Built-in graphs are undirected and get Metropolis weights
W[i, j] = 1 / (1 + max(deg i, deg j)) for each edge, the rest of each row on the diagonal,
which makes W symmetric and doubly stochastic for any graph.

Why rho: doubly stochastic W keeps the replicas' mean fixed (1^T W = 1^T), and one gossip
step shrinks the distance to consensus, ||X W^T - mean||, by at most
sqrt(rho) = ||W - 11^T/n||_2 (the second largest singular value; for symmetric W it is
max(|lambda_2|, |lambda_n|), the quantity in the D-PSGD analysis). rho < 1 is needed for the
replicas to agree; 1 - sqrt(rho) (the spectral gap) sets how fast. Ring: 1 - sqrt(rho) =
Theta(1/n^2); exponential graph: Theta(1/log n); complete graph: rho = 0 (exact averaging).

A topology FILE holds the n x n matrix as text, one row per line, numbers separated by
spaces or commas ('#' starts a comment). It must be square with n = dp, non-negative,
doubly stochastic (rows and columns summing to 1 within 1e-6), strongly connected, and
mixing (rho < 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import GOSSIP_TOPOLOGIES
from ..errors import ConfigError

BUILTIN = GOSSIP_TOPOLOGIES  # named once, in config.py
_STOCHASTIC_TOL = 1e-6


@dataclass(frozen=True)
class Topology:
    """A mixing matrix W (float64, n x n) with its neighbour lists and spectral quantity rho."""

    name: str
    weights: torch.Tensor
    in_neighbors: tuple[tuple[int, ...], ...]   # in_neighbors[i]: the j != i with W[i, j] > 0
    out_neighbors: tuple[tuple[int, ...], ...]  # out_neighbors[i]: the k != i with W[k, i] > 0
    rho: float

    @property
    def n(self) -> int:
        return self.weights.shape[0]

    @property
    def sqrt_rho(self) -> float:
        return math.sqrt(self.rho)

    def describe(self) -> dict:
        """What run.json records (and rank 0 prints) about the graph."""
        degrees = [len(nbrs) for nbrs in self.in_neighbors]
        return {"topology": self.name, "replicas": self.n, "rho": self.rho, "sqrt_rho": self.sqrt_rho,
                "spectral_gap": 1 - self.sqrt_rho, "max_degree": max(degrees, default=0),
                "mixing_matrix": [[round(float(w), 6) for w in row] for row in self.weights]}

    def summary(self) -> str:
        d = self.describe()
        return (f"gossip topology {self.name}: {self.n} replicas, max degree {d['max_degree']}, "
                f"rho={self.rho:.4f} (sqrt(rho)={self.sqrt_rho:.4f}, spectral gap {d['spectral_gap']:.4f})")


def build_topology(spec: str, n: int) -> Topology:
    """`spec` is a built-in graph name or the path of a mixing-matrix file; `n` the number of replicas."""
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"gossip needs at least one replica, got {n}")
    if spec in BUILTIN:
        edges = {"ring": _ring_edges, "torus": _torus_edges, "exponential": _exponential_edges,
                 "complete": _complete_edges}[spec](n)
        return from_matrix(metropolis_weights(n, edges), name=spec)
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"unknown topology {spec!r}: use one of ring|torus|exponential|complete, or the path "
                          f"of a file holding the n x n mixing matrix (no such file)")
    return from_matrix(load_matrix(path), name=str(path), expected_n=n)


def metropolis_weights(n: int, edges: set[tuple[int, int]]) -> torch.Tensor:
    """Symmetric doubly-stochastic weights of an undirected graph (edges as (i, j), i < j)."""
    degree = [0] * n
    for i, j in edges:
        degree[i] += 1
        degree[j] += 1
    w = torch.zeros(n, n, dtype=torch.float64)
    for i, j in edges:
        w[i, j] = w[j, i] = 1.0 / (1 + max(degree[i], degree[j]))
    for i in range(n):
        w[i, i] = 1.0 - (w[i].sum() - w[i, i])
    return w


def _undirected(pairs) -> set[tuple[int, int]]:
    return {(min(i, j), max(i, j)) for i, j in pairs if i != j}


def _ring_edges(n: int) -> set[tuple[int, int]]:
    return _undirected((i, (i + 1) % n) for i in range(n))


def _torus_shape(n: int) -> tuple[int, int]:
    """rows x cols = n with rows the largest divisor <= sqrt(n) (a prime n gives a 1 x n ring)."""
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return rows, n // rows


def _torus_edges(n: int) -> set[tuple[int, int]]:
    rows, cols = _torus_shape(n)
    pairs = []
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            pairs += [(i, r * cols + (c + 1) % cols), (i, ((r + 1) % rows) * cols + c)]
    return _undirected(pairs)


def _exponential_edges(n: int) -> set[tuple[int, int]]:
    """i -- i + 2^k (mod n) for every 2^k < n: degree about 2 log2 n, gap Theta(1/log n)."""
    pairs, hop = [], 1
    while hop < n:
        pairs += [(i, (i + hop) % n) for i in range(n)]
        hop *= 2
    return _undirected(pairs)


def _complete_edges(n: int) -> set[tuple[int, int]]:
    return {(i, j) for i in range(n) for j in range(i + 1, n)}


def load_matrix(path: Path) -> torch.Tensor:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].replace(",", " ").strip()
        if not line:
            continue
        try:
            rows.append([float(v) for v in line.split()])
        except ValueError:
            raise ConfigError(f"topology file {path}, line {number}: expected numbers separated by spaces or "
                              f"commas, got {line!r}") from None
    if not rows:
        raise ConfigError(f"topology file {path} holds no matrix rows")
    if any(len(r) != len(rows) for r in rows):
        raise ConfigError(f"topology file {path}: the mixing matrix must be square, got {len(rows)} rows of "
                          f"lengths {sorted({len(r) for r in rows})}")
    return torch.tensor(rows, dtype=torch.float64)


def from_matrix(w: torch.Tensor, *, name: str, expected_n: int | None = None) -> Topology:
    """Check that W is a usable mixing matrix and derive neighbours and rho."""
    w = w.to(torch.float64)
    n = w.shape[0]
    where = f"topology {name}"
    if w.dim() != 2 or w.shape[1] != n:
        raise ConfigError(f"{where}: the mixing matrix must be square, got shape {tuple(w.shape)}")
    if expected_n is not None and n != expected_n:
        raise ConfigError(f"{where}: the mixing matrix is {n} x {n} but there are {expected_n} data-parallel "
                          f"replicas; give a {expected_n} x {expected_n} matrix or change the number of processes")
    if not torch.isfinite(w).all() or (w < 0).any():
        raise ConfigError(f"{where}: mixing weights must be finite and >= 0, got min {float(w.min()):g}")
    rows, cols = w.sum(1), w.sum(0)
    worst_row, worst_col = int((rows - 1).abs().argmax()), int((cols - 1).abs().argmax())
    if abs(rows[worst_row] - 1) > _STOCHASTIC_TOL or abs(cols[worst_col] - 1) > _STOCHASTIC_TOL:
        raise ConfigError(f"{where}: the mixing matrix is not doubly stochastic (every row and every column must "
                          f"sum to 1): row {worst_row} sums to {float(rows[worst_row]):.6g}, column {worst_col} "
                          f"to {float(cols[worst_col]):.6g}; Metropolis weights 1/(1+max(deg i, deg j)) give one")
    unreached = _unreached(w)
    if unreached:
        raise ConfigError(f"{where}: the gossip graph is not connected: replica 0 cannot reach replicas "
                          f"{sorted(unreached)} (or they cannot reach it), so the models would never agree; "
                          f"add edges (non-zero weights) between the parts")
    deviation = w - torch.full_like(w, 1.0 / n)
    sqrt_rho = float(torch.linalg.matrix_norm(deviation, ord=2)) if n > 1 else 0.0
    sqrt_rho = max(0.0, sqrt_rho if sqrt_rho > 1e-12 else 0.0)
    if sqrt_rho >= 1 - 1e-9:
        raise ConfigError(f"{where}: the mixing matrix does not contract towards consensus (sqrt(rho) = "
                          f"{sqrt_rho:.6g} >= 1, e.g. a permutation with no self weight); give each replica a "
                          f"positive self weight")
    incoming = tuple(tuple(j for j in range(n) if j != i and w[i, j] > 0) for i in range(n))
    outgoing = tuple(tuple(k for k in range(n) if k != i and w[k, i] > 0) for i in range(n))
    return Topology(name=name, weights=w, in_neighbors=incoming, out_neighbors=outgoing, rho=sqrt_rho ** 2)


def _unreached(w: torch.Tensor) -> set[int]:
    """Replicas not strongly connected with replica 0 (forward and backward reachability)."""
    n = w.shape[0]
    adjacency = w > 0

    def reach(adj: torch.Tensor) -> set[int]:
        seen, frontier = {0}, [0]
        while frontier:
            i = frontier.pop()
            for j in torch.nonzero(adj[i]).flatten().tolist():
                if j not in seen:
                    seen.add(j)
                    frontier.append(j)
        return seen

    both = reach(adjacency) & reach(adjacency.T)
    return set(range(n)) - both
