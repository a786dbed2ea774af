"""The training loop, losses, optimizer, metrics and checkpoints."""

from .trainer import Trainer, TrainResult

__all__ = ["Trainer", "TrainResult"]
