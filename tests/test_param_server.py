"""Parameter server (--dp-mode async): one worker is plain SGD, staleness 0 is synchronous averaged SGD,
the stale-synchronous bound holds under random worker delays, bad layouts fail clearly.

Round-robin identity with the single-process delayed-SGD simulator: tests/test_delayed_sgd.py.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar.async_sgd import Roles, train_with_parameter_server
from autopar.async_sgd.engine import check_async_setup
from autopar.strategies import resolve
from autopar.errors import ConfigError
from helpers import max_param_difference, max_relative_difference, train_builtin

STEPS = 10


def _records(out: str) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _trainer_run(rank_pool, world: int, out: str, strategy: dict | None = None, **train) -> list[dict]:
    kwargs = dict(steps=STEPS, global_batch_size=8, optimizer="sgd", lr=0.2, warmup_steps=2)
    return rank_pool(world).run(train_builtin, "gpt-tiny", out, strategy=strategy, **{**kwargs, **train})


def test_one_worker_is_plain_sgd(rank_pool, tmp_path):
    """1 worker + 1 server at any bound: the same bits as SGD in one process (clipping, decay, schedule)."""
    reference = _trainer_run(rank_pool, 1, str(tmp_path / "ref"), micro_batch_size=8)[0]
    out = str(tmp_path / "ps")
    results = _trainer_run(rank_pool, 2, out, {"dp_mode": "async", "staleness": 3, "servers": 1},
                           micro_batch_size=8)
    # bitwise: the worker runs the reference's forward/backward/eval on the same shapes (eval split as training)
    # and the server's SGD is the same elementwise update on tensors of the same sizes
    for got in results:  # the server rank ends with the same parameters
        assert got["losses"] == reference["losses"]
        assert max_param_difference(reference["params"], got["params"]) == 0.0
        assert got["eval_loss"] == reference["eval_loss"]
        assert got["grad_norms"] == reference["grad_norms"]
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # SGD at this rate really trains
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["staleness_histogram"] == {"0": STEPS}  # a lone worker is never stale
    assert (Path(out) / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    assert len(json.loads((Path(out) / "staleness.json").read_text())["pushes"]) == STEPS


def test_staleness_zero_is_synchronous_averaged_sgd(rank_pool, tmp_path):
    """2 workers + 2 servers (a shard boundary inside a weight), S=0: synchronous SGD on the global batch.

    Weight decay is off: split over the W pushes of a step it matches only to first order in lr.
    """
    train = dict(micro_batch_size=2, weight_decay=0.0, grad_clip=0.0)
    reference = _trainer_run(rank_pool, 1, str(tmp_path / "ref"), **train)[0]
    out = str(tmp_path / "ps")
    results = _trainer_run(rank_pool, 4, out, {"dp_mode": "async", "staleness": 0, "servers": 2}, **train)
    for got in results:
        assert max_relative_difference(reference["losses"], got["losses"]) < 1e-5
        assert max_param_difference(reference["params"], got["params"]) < 1e-5
        assert abs(got["eval_loss"] - reference["eval_loss"]) / reference["eval_loss"] < 1e-5
    records = _records(out)
    # in lockstep, on each shard the second push of a step lands one update after the pull (staleness 1);
    # per (worker, step) the largest over the two shards is recorded
    histogram = records[-1]["staleness_histogram"]
    assert set(histogram) <= {"0", "1"} and sum(histogram.values()) == 2 * STEPS
    assert all(r["staleness_max"] == 1 for r in records)
    # and without the bound the same run is different: the test can tell
    loose = _trainer_run(rank_pool, 4, str(tmp_path / "loose"), {"dp_mode": "async", "staleness": 4, "servers": 2},
                         **train)
    assert max_relative_difference(reference["losses"], loose[0]["losses"]) > 1e-3


# ---------------------------------------------------------------------------- the bound under random delays

WORKERS_DATA_SEED = 11


def tiny_problem():
    """A small regression MLP and its data, identical in every process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    gen = torch.Generator().manual_seed(WORKERS_DATA_SEED)
    inputs, targets = torch.randn(96, 8, generator=gen), torch.randn(96, 1, generator=gen)

    def batch_fn(step: int, worker: int, workers: int):
        start = ((step * workers + worker) * 4) % 96
        return inputs[start:start + 4], targets[start:start + 4]

    def loss_fn(module: nn.Module, batch) -> torch.Tensor:
        return ((module(batch[0]) - batch[1]) ** 2).mean()

    return model, batch_fn, loss_fn


def _random_delays(step: int, worker: int) -> None:
    """Worker 0 is often slow, the others sometimes: they run ahead and must be held back."""
    rng = random.Random(1000 * worker + step)
    time.sleep(rng.choice([0.0, 0.02, 0.04]) if worker == 0 else rng.choice([0.0, 0.0, 0.005]))


def _delayed_run(staleness: int, servers: int, steps: int) -> dict:
    model, batch_fn, loss_fn = tiny_problem()
    result = train_with_parameter_server(model, loss_fn, batch_fn, steps=steps, lr=0.05, staleness=staleness,
                                         servers=servers, before_push=_random_delays, timeout_s=60)
    return {"pushes": result.pushes, "pulls": result.pulls, "params": result.params, "losses": result.losses,
            "workers": torch.distributed.get_world_size() - servers}


@pytest.mark.parametrize("staleness", [1, 2])
def test_random_delays_never_serve_a_pull_beyond_the_bound(rank_pool, staleness):
    steps = 12
    got = rank_pool(4).run(_delayed_run, staleness, 1, steps)[0]
    workers = got["workers"]
    assert len(got["pulls"]) == workers * steps and len(got["pushes"]) == workers * steps
    for pull in got["pulls"]:  # parameters for step c include every worker's steps <= c - S - 1
        assert pull.min_clock >= pull.clock - staleness, pull
    bound = (workers - 1) * (2 * staleness + 1)
    assert all(0 <= push.staleness <= bound for push in got["pushes"])
    # the delays made the bound bite and let workers run ahead: the checks above were not vacuous
    assert any(pull.waited for pull in got["pulls"])
    assert max(push.staleness for push in got["pushes"]) > workers - 1


def test_random_delays_at_staleness_zero_stay_synchronous(rank_pool):
    """Whatever the arrival order, S=0 gives synchronous averaged SGD (computed here in one process)."""
    steps = 10
    got = rank_pool(4).run(_delayed_run, 0, 2, steps)[0]
    workers = got["workers"]
    model, batch_fn, loss_fn = tiny_problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        total = 0.0
        for worker in range(workers):
            loss = loss_fn(model, batch_fn(step, worker, workers))
            (loss / workers).backward()
            total += float(loss.detach()) / workers
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert float((flat - got["params"]).abs().max()) < 1e-6
    assert max_relative_difference(losses, got["losses"]) < 1e-5


# ---------------------------------------------------------------------------- bad input


def test_bad_layouts_are_clear_errors():
    sgd = autopar.TrainConfig(optimizer="sgd", global_batch_size=8, micro_batch_size=2)
    with pytest.raises(ConfigError, match="staleness must be a non-negative integer, got -1"):
        autopar.Strategy(dp_mode="async", staleness=-1).resolved(4)
    with pytest.raises(ConfigError, match="servers must be a positive integer, got 0"):
        autopar.Strategy(dp_mode="async", servers=0).resolved(4)
    with pytest.raises(ConfigError, match="--servers 4 with 4 process.*leaves no worker.*--servers <= 3"):
        resolve(autopar.Strategy(dp_mode="async", servers=4), sgd, 4)
    with pytest.raises(ConfigError, match="does not combine with pp=2"):
        resolve(autopar.Strategy(dp_mode="async", pp=2), sgd, 4)
    with pytest.raises(ConfigError, match="--optimizer adamw; use --optimizer sgd"):
        resolve(autopar.Strategy(dp_mode="async"), autopar.TrainConfig(global_batch_size=6, micro_batch_size=2), 4)
    with pytest.raises(ConfigError, match="--eval-every"):
        resolve(autopar.Strategy(dp_mode="async"), autopar.TrainConfig(optimizer="sgd", eval_every=5), 4)
    with pytest.raises(ConfigError, match="3 worker.*dp\\*micro_batch_size = 3\\*2"):
        check_async_setup(autopar.Strategy(dp_mode="async").resolved(4), sgd, 4)
    with pytest.raises(ConfigError, match="staleness must be an integer >= 0"):
        Roles.check(4, 1, -2)


def test_too_many_servers_fails_on_every_rank(rank_pool, tmp_path):
    with pytest.raises(AssertionError, match=r"(?s)failed on rank\(s\) \[0, 1\].*leaves no worker"):
        _trainer_run(rank_pool, 2, str(tmp_path), {"dp_mode": "async", "servers": 2}, micro_batch_size=4)
