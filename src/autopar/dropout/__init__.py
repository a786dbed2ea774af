"""Dropout that every parallel layout draws exactly as one process would.

Each mask is a function of (seed, step, global sample index, operation number, element
index) only (mask.py), so data, pipeline and tensor parallelism, the micro-batch size,
tp sub-batches, the schedule and recomputation all see the same masks, and replicated
activations get the same mask on every tp rank (replicated parameters stay identical).

- scope.py: the trainer opens `dropout_step(seed, step, micro_batches)`; the engines open
  `micro_batch(i)` around micro-batch i (and again when they recompute it);
- eager.py: a model run whole gets its dropout calls intercepted (`eager_micro_batch`);
- graph.py: pipeline / tensor-parallel stage pieces get their dropout nodes replaced;
- ops.py: the dropout and attention-dropout arithmetic both use.

Cost, measured with benchmarks/dropout_cost.py (gpt-tiny, dropout 0.1 on embeddings,
residual branches and attention weights; one process, one CPU thread, forward + backward +
AdamW; median of 20 alternating steps), batch 8 x 128 tokens on a quiet 2-core Xeon:
1.23x torch's own dropout step time eager, 1.14x traced (docs/benchmarks.md; an earlier run
on a heavily loaded machine gave 1.22-1.35x, and 1.02-1.23x at 8 x 32 tokens). The hash is ~10 int64 element-wise passes per dropped element
(per-element halves cached per step), and attention dropout gives up the fused attention
kernel for the written-out form, which dominates at long sequences.

Not covered: random ops other than dropout (torch.rand in a forward) still use the
process's stream (the trainer seeds one stream per tp group); a model that checkpoints its
own layers under a whole-model engine is refused when it drops during backward (eager.py);
alpha dropout is refused.
"""

from __future__ import annotations

import contextlib

from .graph import GraphDropout, dropout_numbering, replace_dropout_nodes, shard_dropout
from .scope import DropoutScope, active_scope, checkpoint_context_fn, dropout_step, micro_batch

__all__ = ["DropoutScope", "GraphDropout", "active_scope", "checkpoint_context_fn", "dropout_numbering",
           "dropout_step", "eager_micro_batch", "micro_batch", "replace_dropout_nodes", "shard_dropout"]


@contextlib.contextmanager
def eager_micro_batch(index: int):
    """Micro-batch `index` of a model run whole: its dropout calls get layout-free masks.

    Keep it open over the micro-batch's backward too, so that a recomputation there is
    caught (eager.py). Outside a step scope, nothing changes (torch's own dropout).
    """
    from .eager import LayoutFreeDropoutMode, RandomOpScan
    with micro_batch(index) as scope:
        if scope is None:
            yield
        elif scope.scan_random_ops:
            with RandomOpScan() as scan, LayoutFreeDropoutMode(scope, scan):
                yield
        else:
            with LayoutFreeDropoutMode(scope):
                yield
