"""Partition algorithms: hand-checked cases, exhaustive comparison with brute force, bad input."""

from __future__ import annotations

import math
import random
import re

import pytest

from autopar.errors import ConfigError
from autopar.partition.algorithms import balanced, brute_force, min_max_time, stage_costs, uniform

SIZES = [(n, s) for n in range(1, 10) for s in range(1, n + 1)]


def is_partition(bounds: list[int], n: int, s: int) -> bool:
    return len(bounds) == s + 1 and bounds[0] == 0 and bounds[-1] == n and all(
        a < b for a, b in zip(bounds, bounds[1:])
    )


def stage_times(compute, transfer, bounds):
    """Reference stage time, written independently of the module: compute + outgoing cut."""
    n = len(compute)
    return [sum(compute[a:b]) + (transfer[b - 1] if b < n else 0) for a, b in zip(bounds, bounds[1:])]


def cut_total(transfer, bounds):
    return sum(transfer[b - 1] for b in bounds[1:-1])


# ----------------------------------------------------------------------------- uniform


@pytest.mark.parametrize(
    ("n", "s", "expected"),
    [
        (8, 4, [0, 2, 4, 6, 8]),  # even
        (10, 4, [0, 2, 5, 8, 10]),  # extras to the middle stages: sizes 2, 3, 3, 2
        (11, 4, [0, 2, 5, 8, 11]),  # every middle stage full: the last end stage takes one
        (9, 5, [0, 1, 3, 5, 7, 9]),  # middle stages 1..3 all get one: sizes 1, 2, 2, 2, 2
        (7, 7, list(range(8))),  # S == N
        (6, 1, [0, 6]),  # S == 1
        (3, 2, [0, 1, 3]),
    ],
)
def test_uniform(n, s, expected):
    assert uniform(n, s) == expected


def test_uniform_extras_go_to_the_centre_first():
    # 6 stages, 1 extra: the middle stages are 1..4, the closest to the centre (2.5) is 2.
    bounds = uniform(13, 6)
    assert [b - a for a, b in zip(bounds, bounds[1:])] == [2, 2, 3, 2, 2, 2]


def test_uniform_with_weights_keeps_embedding_and_head_on_the_ends():
    # embedding, 8 layers, final norm, head: layers split 2/2/2/2, norm and head join the last stage.
    mask = [False] + [True] * 8 + [False, False]
    assert uniform(11, 4, weights=mask) == [0, 3, 5, 7, 11]
    # 10 layers over 4 stages: 2, 3, 3, 2 layers.
    mask = [False] + [True] * 10 + [False, False]
    assert uniform(13, 4, weights=mask) == [0, 3, 6, 9, 13]
    # A non-repeated block between layers stays with the layer before it.
    mask = [True, True, False, True, True]
    assert uniform(5, 2, weights=mask) == [0, 3, 5]
    # All repeated is the same as no weights.
    assert uniform(10, 4, weights=[True] * 10) == uniform(10, 4)


# ----------------------------------------------------------------------------- exactness vs brute force


@pytest.mark.parametrize(("n", "s"), SIZES)
def test_balanced_matches_brute_force(n, s):
    rng = random.Random(1000 * n + s)
    for trial in range(6):
        if trial % 2 == 0:  # integers: sums are exact, so the tie-break must match too
            costs = [rng.randint(0, 6) for _ in range(n)]
        else:
            costs = [rng.uniform(0, 10) for _ in range(n)]
        bounds = balanced(costs, s)
        assert is_partition(bounds, n, s)
        best, ref = brute_force(n, s, lambda b: max(stage_costs(costs, b)))
        assert max(stage_costs(costs, bounds)) == pytest.approx(best)
        if trial % 2 == 0:
            assert bounds == ref


@pytest.mark.parametrize(("n", "s"), SIZES)
def test_min_max_time_matches_brute_force(n, s):
    rng = random.Random(7919 * n + s)
    for trial in range(6):
        exact = trial % 2 == 0
        draw = (lambda hi: rng.randint(0, hi)) if exact else (lambda hi: rng.uniform(0, hi))
        compute = [draw(8) for _ in range(n)]
        transfer = [draw(5) for _ in range(n)]
        bounds = min_max_time(compute, s, transfer=transfer)
        assert is_partition(bounds, n, s)
        key = lambda b: (max(stage_times(compute, transfer, b)), cut_total(transfer, b))  # noqa: E731
        best, ref = brute_force(n, s, key)
        assert max(stage_times(compute, transfer, bounds)) == pytest.approx(best[0])
        if exact:
            assert bounds == ref


@pytest.mark.parametrize(("n", "s"), SIZES)
def test_min_max_time_with_memory_cap_matches_brute_force(n, s):
    rng = random.Random(31 * n + s)
    for _ in range(4):
        compute = [rng.randint(0, 8) for _ in range(n)]
        transfer = [rng.randint(0, 4) for _ in range(n)]
        memory = [rng.randint(1, 6) for _ in range(n)]
        smallest, _ = brute_force(n, s, lambda b: max(stage_costs(memory, b)))
        cap = rng.randint(int(smallest), int(sum(memory)))

        def key(b):
            if max(stage_costs(memory, b)) > cap:
                return (math.inf, 0.0)
            return (max(stage_times(compute, transfer, b)), cut_total(transfer, b))

        best, ref = brute_force(n, s, key)
        bounds = min_max_time(compute, s, transfer=transfer, memory=memory, memory_cap=cap)
        assert max(stage_costs(memory, bounds)) <= cap
        assert bounds == ref
        assert max(stage_times(compute, transfer, bounds)) == best[0]


# ----------------------------------------------------------------------------- hand-checked cases


def test_expensive_boundary_moves_the_cut():
    compute = [1, 1, 1, 1]
    transfer = [0, 10, 0, 0]  # cutting after block 1 is expensive
    assert balanced(compute, 2) == [0, 2, 4]  # cheapest compute: 2 | 2
    bounds = min_max_time(compute, 2, transfer=transfer)
    assert max(stage_times(compute, transfer, [0, 2, 4])) == 12
    assert max(stage_times(compute, transfer, bounds)) == 3
    best, ref = brute_force(4, 2, lambda b: (max(stage_times(compute, transfer, b)), cut_total(transfer, b)))
    assert best == (3, 0) and bounds == ref == [0, 1, 4]


def test_equal_bottleneck_prefers_less_transfer():
    # Every cut gives a bottleneck of 3; only the cut after block 2 transfers nothing.
    assert min_max_time([1, 1, 1, 1], 2, transfer=[1, 1, 0, 0]) == [0, 3, 4]
    # Without transfer, ties go to the earliest cut.
    assert min_max_time([1, 2, 1], 2) == [0, 1, 3]
    assert balanced([1, 2, 1], 2) == [0, 1, 3]


def test_last_transfer_entry_is_unused():
    assert min_max_time([2, 2, 2], 3, transfer=[0, 0, 1e9]) == [0, 1, 2, 3]


def test_memory_cap_changes_the_split():
    compute = [1, 1, 1, 1, 4]
    memory = [1, 1, 1, 1, 5]
    assert min_max_time(compute, 2) == [0, 4, 5]
    # Block 4 needs 5 on its own, so cap 5 still allows the best compute split.
    assert min_max_time(compute, 2, memory=memory, memory_cap=5) == [0, 4, 5]
    # Heavy early blocks: [0, 4, 5] needs 8, so the cut moves forward to the best split under 6.
    memory = [3, 3, 1, 1, 1]
    bounds = min_max_time(compute, 2, memory=memory, memory_cap=6)
    assert bounds == [0, 2, 5] and max(stage_costs(memory, bounds)) <= 6


def test_infeasible_memory_cap_names_the_smallest_cap():
    memory = [4, 1, 1, 3, 2, 2]
    smallest, _ = brute_force(6, 3, lambda b: max(stage_costs(memory, b)))
    assert smallest == 5
    with pytest.raises(ConfigError, match=r"memory_cap=4\b.*smallest cap that fits is 5\.0") as info:
        min_max_time([1] * 6, 3, memory=memory, memory_cap=4)
    named = float(re.search(r"smallest cap that fits is ([0-9.e+-]+)", str(info.value)).group(1))
    bounds = min_max_time([1] * 6, 3, memory=memory, memory_cap=named)  # and it really fits
    assert max(stage_costs(memory, bounds)) <= named


def test_infeasible_cap_with_float_memory_is_exact():
    rng = random.Random(5)
    memory = [rng.uniform(0.1, 3.0) for _ in range(9)]
    with pytest.raises(ConfigError) as info:
        min_max_time([1.0] * 9, 4, memory=memory, memory_cap=0.05)
    named = float(re.search(r"smallest cap that fits is ([0-9.e+-]+)", str(info.value)).group(1))
    smallest, _ = brute_force(9, 4, lambda b: max(stage_costs(memory, b)))
    assert named == pytest.approx(smallest)
    min_max_time([1.0] * 9, 4, memory=memory, memory_cap=named)  # repr round-trips: must not raise


def test_larger_inputs_are_fast_and_sane():
    rng = random.Random(0)
    compute = [rng.uniform(1, 2) for _ in range(200)]
    bounds = min_max_time(compute, 8, transfer=[0.1] * 200)
    assert is_partition(bounds, 200, 8)
    even = uniform(200, 8)
    assert max(stage_times(compute, [0.1] * 200, bounds)) <= max(stage_times(compute, [0.1] * 200, even))
    assert is_partition(balanced(compute, 16), 200, 16)


def test_stage_costs():
    assert stage_costs([1, 2, 3, 4], [0, 1, 4]) == [1.0, 9.0]
    assert stage_costs([1, 2], [0, 2]) == [3.0]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: uniform(4, 5), "pp=5 stages but the model has only 4 blocks; use pp <= 4"),
        (lambda: balanced([1, 1, 1, 1], 5), "pp=5 stages but the model has only 4 blocks; use pp <= 4"),
        (lambda: min_max_time([1, 1], 3), "pp=3 stages but the model has only 2 blocks; use pp <= 2"),
        (lambda: brute_force(2, 3, sum), "use pp <= 2"),
        (lambda: uniform(4, 0), "pp=0 stages is invalid; use an integer pp >= 1"),
        (lambda: balanced([1, 2], -1), "pp=-1"),
        (lambda: balanced([1, 2], 1.5), "pp=1.5"),
        (lambda: uniform(0, 1), "0 blocks"),
        (lambda: balanced([], 1), "0 blocks"),
        (lambda: balanced([1, -2, 3], 2), r"costs\[1\] = -2.*>= 0"),
        (lambda: balanced([1, float("nan")], 1), "finite"),
        (lambda: min_max_time([1, 2], 1, transfer=[float("inf"), 0]), r"transfer\[0\]"),
        (lambda: min_max_time([1, 2, 3], 2, transfer=[1, 1, 1], memory=[1, -1, 1]), r"memory\[1\]"),
        (lambda: min_max_time([1, 2, 3], 2, transfer=[1, 1]), "transfer has 2 entries but there are 3 blocks"),
        (lambda: min_max_time([1, 2, 3], 2, memory=[1, 1, 1, 1]), "memory has 4 entries but there are 3 blocks"),
        (lambda: uniform(3, 1, weights=[True]), "weights has 1 entries but there are 3 blocks"),
        (lambda: uniform(4, 3, weights=[False, True, True, False]), "only 2 blocks are marked as repeated"),
        (lambda: min_max_time([1, 2], 1, memory_cap=3.0), "memory_cap=3.0 was given without memory"),
        (lambda: min_max_time([1, 2], 1, memory=[1, 1], memory_cap="big"), "not a number"),
        (lambda: min_max_time([1, 2], 2, memory=[3, 3], memory_cap=2), "smallest cap that fits is 3.0"),
        (lambda: stage_costs([1, 2, 3], [0, 2, 2, 3]), "do not describe a partition of 3 blocks"),
        (lambda: stage_costs([1, 2, 3], [1, 3]), "strictly increasing ints from 0 to 3"),
    ],
)
def test_bad_input_raises_config_error(call, words):
    with pytest.raises(ConfigError, match=words):
        call()
