"""Mixture-of-experts layers found in the traced graph, and their experts sharded over ranks (--ep).

detect.py   the router (linear, softmax/sigmoid, top-k), the experts (3-d weights with one row per
            expert, read under the router's choices) and the combine, from the graph alone
dispatch.py tokens sent to the rank holding their expert and back (all-to-all, variable splits)
shard.py    a whole model's experts cut to this rank's rows, gathered back whole for checkpoints
splice.py   the dispatch put in traced stage graphs in place of the experts' operations (with pp or tp)
"""

from .detect import ExpertLayer, ExpertPlan, find_experts
from .dispatch import ExpertParallelForward, all_to_all_variable
from .shard import ShardedExperts, shard_experts

__all__ = ["ExpertLayer", "ExpertPlan", "ExpertParallelForward", "ShardedExperts", "all_to_all_variable",
           "find_experts", "shard_experts"]
