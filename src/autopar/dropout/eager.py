"""Layout-free dropout for a model run whole (eager): intercept the dropout calls of one forward.

A TorchFunctionMode, active while one micro-batch runs forward and backward, sees every
torch function the model calls. Dropout calls in training mode (nn.Dropout, F.dropout,
dropout1d/2d/3d, torch.dropout, and scaled_dot_product_attention with dropout_p > 0) are
numbered in call order, which is the order of the dropout nodes of the traced graph
(graph.py), and computed with the layout-free mask of that number. Everything else passes
through untouched. Alpha dropout is refused: its affine correction is not implemented here.

A model that checkpoints its own layers (torch.utils.checkpoint) recomputes them in
backward without this mode (torch restores only device modes there), so their dropout
would silently draw torch's mask: a dropout in a checkpointed region (or with gradients
off in a training forward: reentrant checkpointing) is refused instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import ConfigError
from . import ops
from .scope import DropoutScope

_FUNCTIONAL = (("input", "p", "training", "inplace"), (None, 0.5, True, False))  # F.dropout, F.dropout2d, ...
_NATIVE = (("input", "p", "train", None), (None, None, None, False))  # torch.dropout, torch.feature_dropout
_ELEMENTWISE = {F.dropout: _FUNCTIONAL, torch.dropout: _NATIVE}
_CHANNEL = {F.dropout1d: _FUNCTIONAL, F.dropout2d: _FUNCTIONAL, F.dropout3d: _FUNCTIONAL,
            torch.feature_dropout: _NATIVE}
_REFUSED = {F.alpha_dropout, F.feature_alpha_dropout, torch.alpha_dropout, torch.feature_alpha_dropout}
_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def _bind(names: tuple, defaults: tuple, args: tuple, kwargs: dict) -> list:
    values = list(args) + [None] * (len(names) - len(args))
    for i, name in enumerate(names):
        if i >= len(args):
            values[i] = defaults[i] if name is None else kwargs.get(name, defaults[i])
    return values


class LayoutFreeDropoutMode(TorchFunctionMode):
    """Dropout calls of one micro-batch's forward, with layout-free masks numbered in call order."""

    def __init__(self, scope: DropoutScope):
        super().__init__()
        self.scope, self.next_op = scope, 0

    def _take_op(self) -> int:
        if _inside_checkpoint():
            raise ConfigError("a dropout runs inside a layer the model checkpoints itself (torch.utils.checkpoint, "
                              "e.g. gradient_checkpointing_enable()): its recomputation in backward would draw "
                              "torch's own mask, not this one. Turn off the model's own checkpointing (use autopar's "
                              "--recompute / --memory-budget-mb instead) or set dropout to 0")
        op, self.next_op = self.next_op, self.next_op + 1
        return op

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ELEMENTWISE or func in _CHANNEL:
            x, p, training, inplace = _bind(*(_ELEMENTWISE.get(func) or _CHANNEL[func]), args, kwargs)
            if training:
                op = self._take_op()
                if p > 0:
                    return ops.dropout(x, float(p), op, self.scope, channel=func in _CHANNEL, inplace=bool(inplace))
                return x
        elif func in _REFUSED:
            training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", False))
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            if training and p > 0:
                raise ConfigError(f"{func.__name__} is not supported with layout-independent dropout; use dropout "
                                  f"or set its probability to 0")
        elif func is F.scaled_dot_product_attention:
            q, k, v, mask, p, causal, scale, gqa = _bind(_SDPA, _SDPA_DEFAULTS, args, kwargs)
            if p and p > 0:
                return ops.attention(q, k, v, mask, float(p), bool(causal), scale, bool(gqa), self._take_op(),
                                     self.scope)
        return func(*args, **kwargs)


def _inside_checkpoint() -> bool:
    """Whether this call runs in a checkpointed region (whose backward-time recomputation torch runs
    without this mode: torch.utils.checkpoint restores only device modes) or in backward itself."""
    if torch._C._current_autograd_node() is not None:
        return True
    if not torch.is_grad_enabled():  # a training forward with gradients off: reentrant checkpoint (or no_grad)
        return True
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")
