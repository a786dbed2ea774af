"""Uneven replica shares: the split of a global batch, its refusals, and the sampler's slices."""

from __future__ import annotations

import pytest

import autopar
from autopar.config import Strategy, TrainConfig
from autopar.data.sampler import GlobalBatchSampler
from autopar.data.shares import parse_weights, split_samples
from autopar.errors import ConfigError
from autopar.strategies import resolve


@pytest.mark.parametrize("weights, batch, micro, want", [
    ((1, 1), 8, 2, (4, 4)),
    ((3, 1), 8, 2, (6, 2)),
    ((1, 1, 0.5, 0.5), 12, 1, (4, 4, 2, 2)),
    ((100, 1), 8, 2, (6, 2)),          # at least one micro-batch each
    ((1, 1, 1), 8, 1, (3, 3, 2)),      # the remainder by weight, then by position
])
def test_split_is_whole_micro_batches_in_proportion(weights, batch, micro, want):
    assert split_samples(weights, batch, micro) == want


def test_sampler_slices_cover_the_global_batch_in_order():
    sampler = GlobalBatchSampler(100, 8, seed=3, shares=(6, 2))
    even = GlobalBatchSampler(100, 8, seed=3)
    mine = [sampler.local_micro_batches(5, dp_rank=r, dp_size=2, micro_batch_size=2) for r in range(2)]
    assert [len(m) for m in mine] == [3, 1]
    assert sum(mine[0] + mine[1], []) == even.global_batch(5)
    positions = [sampler.local_micro_positions(5, dp_rank=r, dp_size=2, micro_batch_size=2) for r in range(2)]
    assert sum(positions[0] + positions[1], []) == list(range(40, 48))


@pytest.mark.parametrize("text, words", [
    ("3", "lists 1 weight(s) but dp is 2"),
    ("3,x", "must be 'even', 'auto'"),
    ("3,0", "every weight must be a finite number > 0"),
])
def test_bad_weights_are_refused(text, words):
    with pytest.raises(ConfigError, match=None) as error:
        parse_weights(text, 2)
    assert words in str(error.value)


@pytest.mark.parametrize("strategy, words", [
    (dict(dp=2, pp=2, chunks=2, dp_shares="3,1"), "rule dp-shares-data-parallel"),
    (dict(dp=2, pp=2, schedule="zb-h1", dp_shares="3,1"), "--schedule zb-h1"),
    (dict(dp=4, zero=1, dp_shares="3,1,1,3"), "--zero 1"),
    (dict(dp=4, dp_shares="auto"), "no --cluster was given"),
])
def test_unsupported_shares_are_refused_before_ranks_start(strategy, words):
    with pytest.raises(ConfigError) as error:
        resolve(Strategy(**strategy), TrainConfig(global_batch_size=8, micro_batch_size=1), 4)
    assert words in str(error.value)


def test_auto_shares_follow_the_cluster_devices(tmp_path):
    from test_hetero_cluster import MIXED
    path = tmp_path / "mixed.toml"
    path.write_text(MIXED)
    resolved = resolve(Strategy(dp=4, dp_shares="auto", cluster=str(path)),
                       TrainConfig(global_batch_size=12, micro_batch_size=1), 4)
    assert resolved.strategy.replicas.shares == "1,1,0.5,0.5"
    assert resolved.accumulation == 4  # the busiest replica's micro-batches
    assert autopar.Strategy(dp_shares="2,1").replicas.shares == "2,1"
