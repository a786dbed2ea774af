"""Cross-mesh resharding (after Alpa): moving a tensor from one tensor-parallel layout on one
set of ranks to another layout on another set, as tiles, each from a load-balanced sender, by
send/recv, scatter-gather (send 1/t, all-gather at the receivers) or broadcast."""

from .cost import boundary_cost
from .executor import PendingReshard, Resharder
from .layout import Layout
from .planner import METHODS, ReshardPlan, Tile, plan_resharding

__all__ = ["Layout", "METHODS", "PendingReshard", "ReshardPlan", "Resharder", "Tile", "boundary_cost",
           "plan_resharding"]
