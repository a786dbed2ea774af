"""Data parallelism: gradient synchronisation across replicas, and the delayed-network link layer."""

from .grad_sync import GradientSynchronizer
from .links import LinkModel, Links

__all__ = ["GradientSynchronizer", "LinkModel", "Links"]
