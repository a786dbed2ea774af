"""Running statistics of normalisation layers (BatchNorm) kept as one process keeps them.

One process that accumulates gradients over micro-batches 0..M-1 of a global batch updates
each BatchNorm's running buffers once per micro-batch, in that order:
`r <- (1 - m) r + m * stat(micro-batch)` (the mean, and the unbiased variance for
running_var), `num_batches_tracked += 1`, with m = 1 / num_batches_tracked when momentum
is None. Under dp a replica sees only its own micro-batches; under pp a stage's traced graph
would update its buffers in place per call (recomputation included) and could not switch to
the running statistics in eval mode. So every training forward of a BatchNorm records the
(mean, unbiased variance) the kernel computed for its micro-batch and leaves the running
buffers alone (`record.py`: hooks on a whole model, a module in place of each traced
batch_norm node); at the end of the step the replicas of each stage gather the records of
every micro-batch of the global batch and replay the sequential update in global
micro-batch order (`replay.py`), so every replica, stage and tp rank holds one process's
buffers. Normalisation itself is untouched (each micro-batch's own statistics).

The replay reproduces the update up to rounding, not bitwise: the kernel keeps its sums more
precisely than the fp32 statistics it reports (torch's CPU kernel divides its variance sum
in double inside the update), so a replayed buffer may differ from one process's in the last
bits of fp32. `layers.py` says which layers are replayed and refuses the others.
"""

from .layers import (batch_norm_layers, check_batch_norm_subbatches, check_running_stats,
                     check_traced_buffer_updates, traceable_cumulative_averages)
from .record import EagerBatchNorms, GraphBatchNorm, replace_batch_norm_nodes
from .replay import RunningStatsReplay

__all__ = ["EagerBatchNorms", "GraphBatchNorm", "RunningStatsReplay", "batch_norm_layers", "check_batch_norm_subbatches",
           "check_running_stats",
           "check_traced_buffer_updates", "replace_batch_norm_nodes", "traceable_cumulative_averages"]
