"""autopar: train unmodified PyTorch models with data, tensor and pipeline parallelism.

    import autopar
    autopar.Trainer(model, train_data, strategy=autopar.Strategy(dp=2),
                    config=autopar.TrainConfig(steps=100)).train()

The names below are imported when first used, not with the package: `autopar --help` and
`autopar models` then start without torch (a second or more of imports).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from .version import __version__

_EXPORTS = {"Trainer": ".trainer", "TrainResult": ".trainer", "Strategy": ".config", "TrainConfig": ".config",
            "JobConfig": ".config", "ModelConfig": ".config", "DataConfig": ".config", "LaunchConfig": ".config",
            "AutoparError": ".errors", "plan_auto": ".autoplan", "Plan": ".search.auto",
            "replay_init": ".models.materialize"}

__all__ = ["Trainer", "TrainResult", "Strategy", "TrainConfig", "JobConfig", "ModelConfig", "DataConfig",
           "LaunchConfig", "AutoparError", "__version__", "plan_auto", "Plan",
           "replay_init"]

if TYPE_CHECKING:  # what type checkers and editors see
    from .autoplan import plan_auto
    from .config import DataConfig, JobConfig, LaunchConfig, ModelConfig, Strategy, TrainConfig
    from .errors import AutoparError
    from .models.materialize import replay_init
    from .search.auto import Plan
    from .trainer import Trainer, TrainResult


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:  # `autopar.errors` after a bare `import autopar`: the submodule, as before
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'autopar' has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # once: later look-ups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
