"""What the rule table (config/rules.py) reads: the user's choices, and the facts derived from them that
several rules share (the schedule's entry, the replicas a batch is split over, the micro-batches)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from . import TrainConfig  # the package's __init__ is loaded first and does not import this module
from .schedules import ScheduleSpec, schedule_spec
from .strategy import Strategy


@dataclass(frozen=True)
class Setup:
    """What the rules read: the user's choices before any process group exists."""

    strategy: Strategy  # resolved (dp filled in), except for the search's rules (phase "search")
    config: TrainConfig
    world: int
    custom_forward: bool = False  # the Trainer got a forward_fn of its own
    pretrained: bool = False  # the Trainer got pretrained weights to load
    custom_loss: bool = False  # the Trainer got a loss_fn of its own

    @property
    def spec(self) -> ScheduleSpec:
        return schedule_spec(self.strategy.pipeline.schedule)

    @property
    def sparse(self) -> bool:
        """Sparse embedding exchange, or SparseAdam (its tables' rows travel sparsely too)."""
        return self.strategy.sparse.mode != "dense" or self.config.optimizer == "sparse-adam"

    @property
    def pipelined(self) -> bool:
        """A pipeline schedule runs (stages over ranks, or several chunks per rank)."""
        return self.strategy.pp > 1 or self.strategy.pipeline.chunks > 1

    @property
    def replicas(self) -> int:
        """Over how many processes a global batch is split: dp, or the parameter server's workers."""
        s = self.strategy
        return self.world - s.replicas.servers if s.replicas.mode == "async" else s.dp

    @cached_property
    def micro_config(self) -> TrainConfig:
        """The train config with --micro-batches resolved into a micro-batch size (an error if it does not divide)."""
        return self.config.with_micro_batches(self.replicas)

    @cached_property
    def microbatches(self) -> int:
        """Micro-batches per replica per step (an error if the batch sizes do not divide)."""
        return self.config.accumulation_steps(self.replicas)

    @property
    def other_dp_mode(self) -> str | None:
        """The way replicas combine when it is not synchronous all-reduce of dense gradients, as a flag."""
        s = self.strategy
        if s.replicas.mode == "gossip":
            return "--dp-mode gossip"
        if s.replicas.mode == "async":
            return "--dp-mode async (the parameter server)"
        if self.sparse:
            return f"--sparse-embeddings {s.sparse.mode} / --optimizer {self.config.optimizer}"
        return None
