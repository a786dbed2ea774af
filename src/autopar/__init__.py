"""autopar: train unmodified PyTorch models with data, tensor and pipeline parallelism.

    import autopar
    autopar.Trainer(model, train_data, strategy=autopar.Strategy(dp=2),
                    config=autopar.TrainConfig(steps=100)).train()
"""

from .autoplan import plan_auto
from .config import DataConfig, JobConfig, LaunchConfig, ModelConfig, Strategy, TrainConfig
from .errors import AutoparError
from .models.materialize import replay_init
from .search.auto import Plan
from .trainer import Trainer, TrainResult
from .version import __version__

__all__ = ["Trainer", "TrainResult", "Strategy", "TrainConfig", "JobConfig", "ModelConfig", "DataConfig",
           "LaunchConfig", "AutoparError", "__version__", "plan_auto", "Plan",
           "replay_init"]
