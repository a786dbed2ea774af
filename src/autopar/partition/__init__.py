"""Cut a traced model into pipeline stages and build one module per stage."""

from .algorithms import balanced, brute_force, min_max_time, uniform
from .plan import METHODS, CostModel, CrossingValue, Partition, StageReport, crossings, partition
from .stages import StageModule, StageSpec, materialize_stage, plan_stages

__all__ = ["balanced", "brute_force", "min_max_time", "uniform", "METHODS", "CostModel", "CrossingValue",
           "Partition", "StageReport", "crossings", "partition", "StageModule", "StageSpec", "materialize_stage",
           "plan_stages"]
