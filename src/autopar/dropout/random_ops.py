"""Which random operations a model may run: layout-free ones, and the rest refused.

A random operation drawing from a process's generator gives every layout other draws (the
number of draws before it depends on the micro-batch size, the rank, the schedule), so a
model using one would train silently differently on dp, pp and tp than in one process.
Every random operation a model can reach therefore gets one of two treatments:

- layout-free (ops.py, drawn from the hash of mask.py): dropout, dropout1d/2d/3d,
  feature dropout, native_dropout, alpha and feature-alpha dropout, rrelu in training,
  attention dropout in F.scaled_dot_product_attention and inside nn.MultiheadAttention
  (so nn.Transformer*, TransformerEncoderLayer and TransformerDecoderLayer);
- refused with a ModelError before the first optimizer step (`refusal`): every other
  operation that draws: torch.rand/randn/randint/rand_like/randn_like/randint_like/
  randperm/normal/bernoulli/multinomial/poisson, Tensor.bernoulli_/uniform_/normal_/
  exponential_/..., F.gumbel_softmax, the dropout inside nn.LSTM/GRU/RNN (dropout > 0),
  fused attention kernels with dropout, and anything else torch tags as drawing.

Whether an aten operation draws is read from torch's own tag (`nondeterministic_seeded`)
and its arguments (an attention kernel with dropout_p == 0, an RNN without dropout or a
dropout in eval mode draws nothing): `draws`. Traced stages check every node (graph.py);
a model run whole has its visible torch calls checked on every step and every aten
operation of its first step scanned (eager.py), which also sees draws inside torch's own
composite functions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .._torch_internals import op_schema
from ..errors import ModelError

aten = torch.ops.aten
_SEEDED = torch.Tag.nondeterministic_seeded


def _bind(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The operation's arguments by schema name (defaults filled in).

    The schema is private (op_schema), but the only place torch names an aten operation's
    arguments; without it nothing is named and a tagged operation counts as drawing."""
    values = {}
    for i, argument in enumerate(getattr(op_schema(op), "arguments", ())):
        if i < len(args):
            values[argument.name] = args[i]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


def draws(op: Any, args: tuple, kwargs: dict | None = None) -> bool:
    """Whether calling aten operation `op` with these arguments draws random numbers."""
    if _SEEDED not in getattr(op, "tags", ()):
        return False
    name = getattr(op_schema(op), "name", str(op))
    if "sdp_choice" in name or name.endswith("_backward"):  # picks a kernel / replays the forward's draws
        return False
    values = _bind(op, args, kwargs or {})
    for flag in ("train", "training"):
        if flag in values and values[flag] is False:
            return False
    for rate in ("dropout_p", "dropout"):  # attention kernels, RNNs: no draw without dropout
        if isinstance(values.get(rate), (int, float)):
            return float(values[rate]) > 0
    return True


# torch functions (and Tensor methods) that always draw: refused on every training step of a model run whole
_ALWAYS_DRAWING = ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "normal",
                   "bernoulli", "multinomial", "poisson", "binomial", "_standard_gamma", "_sample_dirichlet")
_DRAWING_METHODS = ("bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
                    "cauchy_", "log_normal_", "multinomial")
ALWAYS_DRAWING = frozenset([getattr(torch, n) for n in _ALWAYS_DRAWING if hasattr(torch, n)]
                           + [getattr(torch.Tensor, n) for n in _DRAWING_METHODS if hasattr(torch.Tensor, n)]
                           + [F.gumbel_softmax])
# torch's recurrent functions: they draw only with dropout > 0 in training (between layers, inside the op)
RECURRENT = frozenset(getattr(torch, n) for n in ("lstm", "gru", "rnn_tanh", "rnn_relu") if hasattr(torch, n))


def recurrent_draws(args: tuple) -> bool:
    """torch.lstm/gru/rnn_* positional arguments: (input, hx, params, has_biases, layers, dropout, train, ...),
    or for packed sequences (data, batch_sizes, hx, params, has_biases, layers, dropout, train, ...)."""
    packed = len(args) > 3 and isinstance(args[3], (list, tuple))
    dropout, train = (args[6], args[7]) if packed else (args[5], args[6])
    return bool(train) and float(dropout) > 0


def refusal(what: str, where: str = "") -> ModelError:
    """The error for a random operation that would draw differently on each parallel layout."""
    place = f" ({where})" if where else ""
    return ModelError(
        f"the model draws random numbers with {what}{place} in training. Its draws would depend on the parallel "
        f"layout (which samples share a micro-batch, which rank runs them), so dp, pp and tp would train "
        f"differently from one process. autopar draws layout-free only dropout (F.dropout, dropout1d/2d/3d, "
        f"alpha dropout, attention dropout in F.scaled_dot_product_attention and nn.MultiheadAttention) and "
        f"rrelu: use one of those, pass the noise in as a batch field, or draw only in eval mode")


def stack_hint(node: Any) -> str:
    """The model's source line of a traced node (the last frame of its stack trace), if export kept it."""
    trace = (getattr(node, "meta", {}) or {}).get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File ")]
    return f"node {node.name}, {lines[-1]}" if lines else f"node {node.name}"
