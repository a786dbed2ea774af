"""Data parallelism: gradient synchronisation across replicas."""

from .grad_sync import GradientSynchronizer

__all__ = ["GradientSynchronizer"]
