"""autopar: train unmodified PyTorch models with data, tensor and pipeline parallelism.

    import autopar
    autopar.Trainer(model, train_data, strategy=autopar.Strategy(dp=2),
                    config=autopar.TrainConfig(steps=100)).train()
"""

from .version import __version__

from .config import DataConfig, JobConfig, LaunchConfig, ModelConfig, Strategy, TrainConfig  # noqa: E402
from .errors import AutoparError  # noqa: E402
from .trainer import Trainer, TrainResult  # noqa: E402

__all__ = ["Trainer", "TrainResult", "Strategy", "TrainConfig", "JobConfig", "ModelConfig", "DataConfig",
           "LaunchConfig", "AutoparError", "__version__"]
