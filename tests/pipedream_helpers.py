"""Functions the rank pool runs for tests/test_pipedream.py (module level, so spawned ranks import them)."""

from __future__ import annotations

from helpers import train_builtin


def _train_keeping_engine(model_name: str, out: str, **kwargs) -> tuple[dict, object]:
    """train_builtin, and the engine the Trainer built (read after training)."""
    import autopar.trainer as trainer_module

    seen = {}
    original = trainer_module.Trainer.train

    def train(self):
        try:
            return original(self)
        finally:
            seen["engine"] = self.engine

    trainer_module.Trainer.train = train
    try:
        result = train_builtin(model_name, out, **kwargs)
    finally:
        trainer_module.Trainer.train = original
    return result, seen["engine"]


def train_2bw(model_name: str, out: str, **kwargs) -> dict:
    """train_builtin, with the parameters only (not the 2BW older versions) and the engine's storage count."""
    result, engine = _train_keeping_engine(model_name, out, **kwargs)
    versions = getattr(engine, "versions", None)
    result["params"] = {k: v for k, v in result["params"].items() if not k.startswith("pipedream_2bw.")}
    if versions is not None:
        result["older"] = {n: t.detach().clone() for n, t in zip(versions.names, versions.older())}
        result["num_params"] = len(versions.names)
        result["peak_storages"] = engine.peak_storages
    return result


def train_stash(model_name: str, out: str, **kwargs) -> dict:
    """train_2bw for --schedule pipedream, with each parameter's reading stages (for the oracle)."""
    result, engine = _train_keeping_engine(model_name, out, **kwargs)
    result["stages_of"] = engine.stages_of_parameters()
    result["peak_storages"] = engine.peak_storages
    result["num_params"] = len(engine.versions.names)
    result["stage"] = engine.pp_rank
    return result


def train_stash_oracle(model_name: str, out: str, *, pp: int, stages_of: dict, vertical_sync: bool,
                       tied_delay: int | None = None, **kwargs) -> dict:
    """The one-process rule (tests/stash_oracle.py) through the ordinary Trainer, given a strategy table
    of one entry: the data-parallel entry, building the oracle engine."""
    import dataclasses

    from autopar.pipeline.async_schedules import flush_steps
    from autopar.strategies import STRATEGIES
    from stash_oracle import StashOracleEngine

    def build(ctx, options):
        cfg = ctx.config
        return StashOracleEngine(**ctx.common(), forward_fn=ctx.forward_fn, pp=pp, stages_of=stages_of,
                                 vertical_sync=vertical_sync, tied_delay=tied_delay,
                                 steps=cfg.steps, flush_after=flush_steps(cfg.steps, eval_every=cfg.eval_every,
                                                                          checkpoint_every=cfg.checkpoint_every))

    data_parallel = next(entry for entry in STRATEGIES if entry.name == "data-parallel")
    return train_builtin(model_name, out, strategies=(dataclasses.replace(data_parallel, name="stash-oracle",
                                                                          engine=build),), **kwargs)


def train_until_signal(model_name: str, out: str, *, fault: str, **kwargs) -> str:
    """train_builtin with AUTOPAR_FAULT set (e.g. a SIGTERM at some step); returns the Preempted message."""
    import os

    from autopar.errors import Preempted

    os.environ["AUTOPAR_FAULT"] = fault
    try:
        train_builtin(model_name, out, **kwargs)
        return "no stop"
    except Preempted as exc:
        return str(exc)
    finally:
        del os.environ["AUTOPAR_FAULT"]


def train_with_a_slow_stage(model_name: str, out: str, *, slow_stage: int, delay_s: float, **kwargs) -> list[dict]:
    """train_builtin with every forward of stage `slow_stage` made `delay_s` slower (a sleep inside it, so it
    counts as that stage's compute); returns the run's metrics records (rank 0; every stage's statistics)."""
    import json
    import time
    from pathlib import Path

    from autopar.pipeline.runtime import PipelineRuntime

    original = PipelineRuntime._forward

    def slow_forward(self, stage, x, batch, loss_fn):
        if stage == slow_stage:
            time.sleep(delay_s)
        return original(self, stage, x, batch, loss_fn)

    PipelineRuntime._forward = slow_forward
    try:
        train_builtin(model_name, out, **kwargs)
    finally:
        PipelineRuntime._forward = original
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
