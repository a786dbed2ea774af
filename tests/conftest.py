"""Shared fixtures: `rank_pool(n)` gives a pool of n gloo CPU ranks, started once per session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so spawned ranks can import the test helpers

from rank_pool import RankPool  # noqa: E402


@pytest.fixture(scope="session")
def rank_pool():
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
