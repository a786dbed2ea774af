"""Tensor parallelism: parallel layers, a plan found in the traced graph, and its application."""

from .apply import TensorParallel, parallelize_stage
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tp, reduce_from_tp,
                     vocab_parallel_cross_entropy)
from .plan import TensorParallelPlan, plan_tensor_parallel

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallel", "TensorParallelPlan",
           "VocabParallelEmbedding", "copy_to_tp", "parallelize_stage", "plan_tensor_parallel", "reduce_from_tp",
           "vocab_parallel_cross_entropy"]
