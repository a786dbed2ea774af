"""Tensor parallelism: parallel layers with conjugate communication operators."""

from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tp, reduce_from_tp,
                     vocab_parallel_cross_entropy)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "copy_to_tp", "reduce_from_tp",
           "vocab_parallel_cross_entropy"]
