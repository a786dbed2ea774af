"""Functions the rank pool runs for tests/test_pipedream.py (module level, so spawned ranks import them)."""

from __future__ import annotations

from helpers import train_builtin


def train_2bw(model_name: str, out: str, **kwargs) -> dict:
    """train_builtin, with the parameters only (not the 2BW older versions) and the engine's storage count."""
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
    engine = seen["engine"]
    versions = getattr(engine, "versions", None)
    result["params"] = {k: v for k, v in result["params"].items() if not k.startswith("pipedream_2bw.")}
    if versions is not None:
        result["older"] = {n: t.detach().clone() for n, t in zip(versions.names, versions.older())}
        result["num_params"] = len(versions.names)
        result["peak_storages"] = engine.peak_storages
    return result
