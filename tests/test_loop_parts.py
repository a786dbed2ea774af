"""The training loop's parts on their own: each decides its own cadence, fault injection wraps the steps
only when asked, and a Trainer can be given a strategy table of its own (no ranks needed)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from autopar.strategies import STRATEGIES, resolve
from autopar.train.checkpointer import Checkpointer
from autopar.train.deferred import Finished, StepResult
from autopar.train.evaluator import Evaluator
from autopar.train.faults import Fault, FaultySteps
from autopar.train.metrics import MetricsLog
from autopar.train.steps import StepInputs


def _due(part, steps: int) -> list[int]:
    return [n for n in range(1, steps + 1) if part.due(n)]


def test_each_part_decides_its_own_cadence():
    config = autopar.TrainConfig(steps=10, eval_every=4, checkpoint_every=3, log_every=5)
    assert _due(MetricsLog(None, every=config.log_every, last=config.steps), 10) == [5, 10]
    evaluator = Evaluator(engine=None, loader=None, losses=None, eval_data=None, config=config, device=None,
                          replica=(0, 1))
    assert _due(evaluator, 10) == [4, 8, 10]  # and always after the last step
    checkpointer = Checkpointer(run_dir=None, engine=None, model=None, optimizer=None, scheduler=None, config=config,
                                manifest_info={})
    assert _due(checkpointer, 10) == [3, 6, 9]  # the last step's checkpoint is the run's end's
    never = dataclasses.replace(config, eval_every=0, checkpoint_every=0)
    assert _due(Evaluator(engine=None, loader=None, losses=None, eval_data=None, config=never, device=None,
                          replica=(0, 1)), 10) == [10]
    assert _due(Checkpointer(run_dir=None, engine=None, model=None, optimizer=None, scheduler=None, config=never,
                             manifest_info={}), 10) == []


class _RecordingSteps:
    """Stands in for a StepsBase: records what it ran, with the loss its inputs give."""

    def __init__(self):
        self.ran: list[tuple[int, bool, float]] = []

    def inputs(self, step: int) -> StepInputs:
        return StepInputs(batches=[], samples=[], loss_fn=lambda output, batch: torch.tensor(1.5), tokens=4)

    def run(self, step: int, stop) -> list[Finished]:
        loss = float(self.inputs(step).loss_fn(None, None))
        self.ran.append((step, stop.requested, loss))
        return [Finished(step + 1, StepResult(loss, 1.0, 4), 0.1)]

    def settle_for_stop(self) -> list[Finished]:
        return []


class _Stop:
    requested = False


def test_a_nan_fault_poisons_only_its_step_on_its_rank():
    inner = _RecordingSteps()
    steps = FaultySteps(inner, Fault("nan", rank=1, step=2), rank=1, attempt=0)
    for step in range(3):
        steps.run(step, _Stop())
    losses = [loss for _, _, loss in inner.ran]
    assert losses[0] == 1.5 and math.isnan(losses[1]) and losses[2] == 1.5
    other_rank = _RecordingSteps()
    steps = FaultySteps(other_rank, Fault("nan", rank=1, step=2), rank=0, attempt=0)
    steps.run(1, _Stop())
    assert other_rank.ran[0][2] == 1.5


def test_an_injected_sigterm_is_seen_by_the_step_it_strikes(monkeypatch):
    """The fault strikes before the step reads the stop flag: the stop travels with that very step."""
    stop = _Stop()
    monkeypatch.setattr(Fault, "strike", lambda self, rank, step, attempt: setattr(stop, "requested", step == 2))
    inner = _RecordingSteps()
    steps = FaultySteps(inner, Fault("sigterm", rank=0, step=2), rank=0, attempt=0)
    steps.run(0, stop)
    steps.run(1, stop)
    assert [requested for _, requested, _ in inner.ran] == [False, True]


def test_a_strategy_table_of_ones_own_replaces_the_default():
    data_parallel = next(e for e in STRATEGIES if e.name == "data-parallel")
    mine = dataclasses.replace(data_parallel, name="mine")
    config = autopar.TrainConfig(global_batch_size=4, micro_batch_size=2)
    assert resolve(autopar.Strategy(dp=2), config, 2, strategies=(mine,)).entry is mine
    assert resolve(autopar.Strategy(dp=2), config, 2).entry is data_parallel
    only_gossip = tuple(e for e in STRATEGIES if e.name == "gossip")
    with pytest.raises(ConfigError, match="no strategy entry applies .* the entries given were: gossip"):
        resolve(autopar.Strategy(dp=2), config, 2, strategies=only_gossip)
    with pytest.raises(ConfigError, match="StrategyEntry"):
        autopar.Trainer(torch.nn.Linear(2, 2), [], strategies=["data-parallel"])


def test_the_deferred_engines_provide_what_the_protocol_declares():
    """train/deferred.py's DeferredEngine lists what DeferredSteps uses; both no-flush engines define each
    member (methods on the class; `waits` is set on the instance by PipelineEngine)."""
    from autopar.pipeline.async_engine import PipeDream2BWEngine
    from autopar.pipeline.async_stash_engine import PipeDreamStashEngine
    from autopar.train.deferred import DeferredEngine

    declared = {name for name in vars(DeferredEngine) if not name.startswith("_")} | set(
        DeferredEngine.__annotations__)
    assert {"local_squares", "scale_to_norm", "drains", "update_hook", "deferred_rule"} <= declared
    for engine in (PipeDream2BWEngine, PipeDreamStashEngine):
        missing = sorted(name for name in declared - {"waits"} if not hasattr(engine, name))
        assert not missing, (engine.__name__, missing)
        assert engine.deferred_rule in ("global", "per-stage")
