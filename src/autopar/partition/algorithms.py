"""Pure algorithms that cut a chain of N blocks into S contiguous, non-empty pipeline stages.

A block is a unit of the model (the embedding, one transformer layer, the final norm and
head). Every function returns `bounds`: S+1 strictly increasing ints with `bounds[0] == 0`
and `bounds[-1] == N`; stage s holds blocks `bounds[s]:bounds[s+1]`.

Nothing here touches torch or processes, so the planner can call these freely and the
tests can check them against `brute_force` on small inputs.

Tie-breaking, shared by `balanced`, `min_max_time` and `brute_force`: among equally good
partitions the lexicographically smallest `bounds` wins, i.e. the earliest cuts. That puts
as little as possible on the early stages, which under 1F1B keep the most micro-batches'
activations in flight. Stage sums are compared as computed in floating point, so with
non-integer costs two splits that are equal on paper may be separated by rounding.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConfigError

__all__ = ["uniform", "balanced", "min_max_time", "stage_costs", "brute_force"]

_INF = math.inf


# ----------------------------------------------------------------------------- validation


def _check_stages(num_blocks: int, num_stages: int) -> None:
    """Reject stage counts that cannot give S non-empty stages."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ConfigError(f"the model has {num_blocks!r} blocks; a partition needs at least 1 block")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"pp={num_stages!r} stages is invalid; use an integer pp >= 1")
    if num_stages > num_blocks:
        raise ConfigError(
            f"pp={num_stages} stages but the model has only {num_blocks} blocks; use pp <= {num_blocks}"
        )


def _check_costs(name: str, costs: Sequence[float], num_blocks: int | None = None) -> list[float]:
    """Costs must be finite and >= 0 (a negative cost would reward bigger stages)."""
    values = list(costs)
    if num_blocks is not None and len(values) != num_blocks:
        raise ConfigError(
            f"{name} has {len(values)} entries but there are {num_blocks} blocks; give one entry per block"
        )
    for i, c in enumerate(values):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ConfigError(f"{name}[{i}] = {c!r} is not a valid cost; costs must be finite numbers >= 0")
    return [float(c) for c in values]


def _check_bounds(bounds: Sequence[int], num_blocks: int) -> list[int]:
    """Bounds must start at 0, end at N and strictly increase."""
    b = list(bounds)
    ok = len(b) >= 2 and b[0] == 0 and b[-1] == num_blocks and all(x < y for x, y in zip(b, b[1:]))
    if not ok:
        raise ConfigError(
            f"bounds {b} do not describe a partition of {num_blocks} blocks; "
            f"expected strictly increasing ints from 0 to {num_blocks}, e.g. [0, {num_blocks}]"
        )
    return b


def _prefix(values: Sequence[float]) -> list[float]:
    """Prefix sums, so a stage's sum is one subtraction (computed the same way everywhere)."""
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


# ----------------------------------------------------------------------------- uniform


def _even_counts(n: int, s: int) -> list[int]:
    """n items over s stages, sizes differing by at most one; extras go to the middle stages.

    The first and last stages also carry the embedding and the head, so they get the
    smaller share. Middle stages closest to the centre get an extra first (ties: lower
    index). Only when every middle stage has one (n % s == s - 1) does an end stage get
    one, and then the last: under 1F1B the first stage holds the most activations.
    """
    base, extra = divmod(n, s)
    centre = (s - 1) / 2
    order = sorted(range(1, s - 1), key=lambda k: (abs(k - centre), k)) + [s - 1, 0]
    counts = [base] * s
    for k in order[:extra]:
        counts[k] += 1
    return counts


def uniform(num_blocks: int, num_stages: int, *, weights: Sequence[bool] | None = None) -> list[int]:
    """Equal numbers of blocks per stage, the way Megatron and DeepSpeed's 'uniform' split.

    With `weights` (one bool per block, True = a repeated layer), only the repeated layers
    are counted and spread with the same rule; every other block joins the stage of the
    nearest repeated layer before it, and blocks before the first repeated layer join
    stage 0. So the embedding stays on the first stage and the final norm and head on the
    last. There must be at least `num_stages` repeated layers.
    """
    _check_stages(num_blocks, num_stages)
    if weights is None:
        repeated = list(range(num_blocks))
    else:
        mask = list(weights)
        if len(mask) != num_blocks:
            raise ConfigError(
                f"weights has {len(mask)} entries but there are {num_blocks} blocks; give one bool per block"
            )
        repeated = [i for i, w in enumerate(mask) if w]
        if len(repeated) < num_stages:
            raise ConfigError(
                f"pp={num_stages} stages but only {len(repeated)} blocks are marked as repeated layers; "
                f"use pp <= {max(len(repeated), 1)} or call uniform without weights"
            )
    counts = _even_counts(len(repeated), num_stages)
    bounds = [0]
    first = 0
    for c in counts[:-1]:
        first += c
        bounds.append(repeated[first])  # stage starts at its first repeated layer
    bounds.append(num_blocks)
    return bounds


# ----------------------------------------------------------------------------- exact DP


def _solve(
    num_stages: int,
    prefix: list[float],
    transfer: list[float],
    mem_prefix: list[float] | None,
    cap: float,
    speeds: Sequence[float] | None = None,
) -> tuple[float, list[int]] | None:
    """Minimise (bottleneck, total transfer, bounds) lexicographically; None if nothing fits.

    cost(i, j) = (prefix[j] - prefix[i]) / speed + transfer[j - 1] (transfer[N - 1] must be 0), the speed
    being that of the stage's device (1 for all without `speeds`), and a stage is allowed only if its memory
    sum is <= cap. f[s][i] is the best bottleneck for blocks i..N-1 in the last s stages; g[s][i] the least
    total transfer for the same suffix with every stage at or under the optimal bottleneck. Walking forward,
    the first cut that keeps g optimal gives the lexicographically smallest bounds. O(S * N^2).
    """
    n = len(prefix) - 1
    rate = [1.0] * num_stages if speeds is None else [float(v) for v in speeds]

    def fits(i: int, j: int) -> bool:
        return mem_prefix is None or mem_prefix[j] - mem_prefix[i] <= cap

    def work(i: int, j: int, s: int) -> float:  # blocks i..j-1 as the s-th stage from the end
        return (prefix[j] - prefix[i]) / rate[num_stages - s]

    f = [[_INF] * (n + 1) for _ in range(num_stages + 1)]
    for i in range(n):
        if fits(i, n):
            f[1][i] = work(i, n, 1)
    for s in range(2, num_stages + 1):
        fs, fprev = f[s], f[s - 1]
        for i in range(n - s + 1):
            best = _INF
            for j in range(i + 1, n - s + 2):
                rest = fprev[j]
                if rest >= best or not fits(i, j):
                    continue
                cost = work(i, j, s) + transfer[j - 1]
                best = min(best, max(cost, rest))
            fs[i] = best
    bottleneck = f[num_stages][0]
    if bottleneck == _INF:
        return None

    def ok(i: int, j: int, s: int) -> bool:
        return fits(i, j) and work(i, j, s) + transfer[j - 1] <= bottleneck

    g = [[_INF] * (n + 1) for _ in range(num_stages + 1)]
    for i in range(n):
        if ok(i, n, 1):
            g[1][i] = 0.0
    for s in range(2, num_stages + 1):
        for i in range(n - s + 1):
            g[s][i] = min(
                (transfer[j - 1] + g[s - 1][j] for j in range(i + 1, n - s + 2) if ok(i, j, s)), default=_INF
            )
    bounds = [0]
    for s in range(num_stages, 1, -1):
        i = bounds[-1]
        j = next(
            j for j in range(i + 1, n - s + 2) if ok(i, j, s) and transfer[j - 1] + g[s - 1][j] == g[s][i]
        )
        bounds.append(j)
    bounds.append(n)
    return bottleneck, bounds


def balanced(costs: Sequence[float], num_stages: int) -> list[int]:
    """Exactly minimise the largest per-stage sum (DeepSpeed/Merak's 'parameters' mode).

    Exact DP rather than a greedy fill, so a heavy block near the end cannot leave the
    last stage overloaded. Ties: the lexicographically smallest bounds (module docstring).
    """
    values = _check_costs("costs", costs)
    _check_stages(len(values), num_stages)
    result = _solve(num_stages, _prefix(values), [0.0] * len(values), None, _INF)
    assert result is not None
    return result[1]


def min_max_time(
    compute: Sequence[float],
    num_stages: int,
    *,
    transfer: Sequence[float] | None = None,
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
    speeds: Sequence[float] | None = None,
) -> list[int]:
    """PipeDream-style DP: minimise the time of the slowest stage, which bounds throughput.

    `speeds` (one per stage, > 0): the relative rate of the device each stage runs on (a mixed cluster,
    search/hetero_cluster.py); a stage's compute is divided by it, so a device at half the rate gets
    about half the work. Default: all equal.

    The cost of the stage holding blocks a..b-1 (0 <= a < b <= N) is

        time(a, b) = sum(compute[a:b]) + (transfer[b - 1] if b < N else 0)

    i.e. its compute plus the one boundary it sends across; the last stage sends nothing
    and the incoming boundary is charged to the sender. transfer[i] is the cost of cutting
    after block i (fold forward activations and backward gradients into it as you like);
    transfer[N - 1] is ignored. Minimised: max over stages of time(a, b).

    With `memory` and `memory_cap`, every stage needs sum(memory[a:b]) <= memory_cap; if no
    partition fits, ConfigError names the smallest cap that would. Among partitions with
    the same bottleneck the smaller total transfer (sum of transfer at the cuts) wins,
    then the lexicographically smallest bounds.
    """
    comp = _check_costs("compute", compute)
    n = len(comp)
    _check_stages(n, num_stages)
    trans = [0.0] * n if transfer is None else _check_costs("transfer", transfer, n)
    trans[n - 1] = 0.0  # the last stage sends nothing onward
    if memory_cap is not None and memory is None:
        raise ConfigError(
            f"memory_cap={memory_cap!r} was given without memory; pass memory (one value per block) too"
        )
    mem_prefix = None if memory is None else _prefix(_check_costs("memory", memory, n))
    cap = _INF
    if memory_cap is not None:
        if isinstance(memory_cap, bool) or not isinstance(memory_cap, (int, float)) or math.isnan(memory_cap):
            raise ConfigError(f"memory_cap={memory_cap!r} is not a number; use a number >= 0")
        cap = float(memory_cap)
    if speeds is not None:
        speeds = _check_costs("speeds", speeds)
        if len(speeds) != num_stages or min(speeds) <= 0:
            raise ConfigError(f"speeds {speeds} must give one rate > 0 per stage ({num_stages} stages)")
    result = _solve(num_stages, _prefix(comp), trans, mem_prefix, cap, speeds)
    if result is None:
        assert mem_prefix is not None
        smallest = _solve(num_stages, mem_prefix, [0.0] * n, None, _INF)
        assert smallest is not None
        raise ConfigError(
            f"no split of {n} blocks into {num_stages} stages fits memory_cap={memory_cap!r}; "
            f"the smallest cap that fits is {smallest[0]!r} (or use more stages)"
        )
    return result[1]


# ----------------------------------------------------------------------------- helpers


def stage_costs(costs: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """Per-stage sums of `costs`, to report or check a partition."""
    values = [float(c) for c in costs]
    b = _check_bounds(bounds, len(values))
    return [sum(values[lo:hi]) for lo, hi in zip(b, b[1:])]


def brute_force(num_blocks: int, num_stages: int, objective: Callable[[list[int]], Any]) -> tuple[Any, list[int]]:
    """Try every partition and return (minimum objective, its bounds): the tests' reference.

    Partitions are enumerated in lexicographic order of bounds and the first minimum is
    kept, so ties follow the same rule as `balanced` and `min_max_time`. The objective may
    return any orderable value, e.g. a tuple to add secondary criteria. C(N-1, S-1) calls.
    """
    _check_stages(num_blocks, num_stages)
    best: tuple[Any, list[int]] | None = None
    for cuts in itertools.combinations(range(1, num_blocks), num_stages - 1):
        bounds = [0, *cuts, num_blocks]
        value = objective(bounds)
        if best is None or value < best[0]:
            best = (value, bounds)
    assert best is not None
    return best
