"""Dropout (and every other random op) that every parallel layout draws exactly as one process would.

Each mask is a function of (seed, step, global sample index, operation number, element
index) only (mask.py), so data, pipeline and tensor parallelism, the micro-batch size,
tp sub-batches, the schedule and recomputation all see the same masks, and replicated
activations get the same mask on every tp rank (replicated parameters stay identical).

- scope.py: the trainer opens `dropout_step(seed, step, micro_batches)`; the engines open
  `micro_batch(i)` around micro-batch i (and again when they recompute it);
- eager.py: a model run whole gets its random calls intercepted (`eager_micro_batch`);
- graph.py: pipeline / tensor-parallel stage pieces get their random nodes replaced;
- ops.py: the dropout, alpha-dropout, rrelu and attention-dropout arithmetic both use;
- random_ops.py: which operations draw, and the refusal for those not made layout-free.

Which random op gets which treatment (random_ops.py):

- layout-free: F.dropout, dropout1d/2d/3d, torch.dropout / feature_dropout /
  native_dropout (and in-place forms), alpha_dropout, feature_alpha_dropout, rrelu in
  training, F.scaled_dot_product_attention with dropout_p > 0, and the attention dropout
  inside nn.MultiheadAttention (nn.Transformer, TransformerEncoderLayer/DecoderLayer;
  their fused fast path runs only in eval, where nothing is drawn);
- refused with a ModelError before the first optimizer step, on every rank: any other op
  that draws in a training forward (rand/randn/randint/*_like/randperm/normal/bernoulli/
  multinomial/poisson, Tensor.uniform_/normal_/bernoulli_/..., F.gumbel_softmax, the
  dropout between nn.LSTM/GRU/RNN layers, fused attention kernels with dropout). Its draws
  would depend on the layout; there is no opt-in to run them anyway.

Traced stages are checked node by node when they are built. A model run whole has its
visible torch calls checked on every step, and every aten op of its first step scanned
(eager.RandomOpScan), which also finds draws inside torch's composite functions; a draw
hidden in a composite that only a later step reaches is not caught.

Cost, measured with benchmarks/dropout_cost.py (gpt-tiny, dropout 0.1 on embeddings,
residual branches and attention weights; one process, one CPU thread, forward + backward +
AdamW; median of 20 alternating steps), batch 8 x 128 tokens on a quiet 2-core Xeon:
1.23x torch's own dropout step time eager, 1.14x traced (docs/benchmarks.md; an earlier run
on a heavily loaded machine gave 1.22-1.35x, and 1.02-1.23x at 8 x 32 tokens). The hash is ~10 int64 element-wise passes per dropped element
(per-element halves cached per step), and attention dropout gives up the fused attention
kernel for the written-out form, which dominates at long sequences. Not measured: the
first eager step's scan (a Python call per aten op: ~20% of gpt-tiny's CPU step, once per
run), nn.MultiheadAttention's dropout on accelerators (the math attention backend is
pinned for that call), rrelu and alpha dropout (a float draw or an affine correction on
top of the mask).

Not covered: a model that checkpoints its own layers under a whole-model engine is refused
when it drops during backward (eager.py).
"""

from __future__ import annotations

import contextlib

import torch

from .eager import compiled_region
from .graph import GraphDropout, dropout_numbering, replace_dropout_nodes, shard_dropout
from .scope import DropoutScope, active_scope, checkpoint_context_fn, dropout_step, micro_batch

__all__ = ["DropoutScope", "GraphDropout", "active_scope", "checkpoint_context_fn", "compiled_region",
           "dropout_numbering", "dropout_step", "eager_micro_batch", "micro_batch", "replace_dropout_nodes",
           "shard_dropout"]


@contextlib.contextmanager
def eager_micro_batch(index: int):
    """Micro-batch `index` of a model run whole: its dropout calls get layout-free masks.

    Keep it open over the micro-batch's backward too, so that a recomputation there is
    caught (eager.py). Outside a step scope, nothing changes (torch's own dropout).
    """
    from .eager import RandomOpScan, layout_free_dropout
    with micro_batch(index) as scope:
        if scope is None:
            yield
        elif scope.scan_random_ops:
            # the scan must see every aten op, so compiled regions (--compile) run eagerly for this micro-batch;
            # torch.compile would skip them under a dispatch mode anyway, and then for good, not just this once
            with torch.compiler.set_stance("force_eager"), RandomOpScan() as scan, layout_free_dropout(scope, scan):
                yield
        else:
            with layout_free_dropout(scope):
                yield
