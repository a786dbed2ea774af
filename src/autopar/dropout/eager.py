"""Layout-free randomness for a model run whole (eager): intercept the random calls of one micro-batch.

A TorchFunctionMode, active while one micro-batch runs forward and backward, sees every
torch function the model calls. Random calls in training mode are numbered in call order,
which is the order of the traced graph's drawing nodes (graph.py), and computed with the
layout-free draws of that number (ops.py): dropout (F.dropout, dropout1d/2d/3d,
torch.dropout / feature_dropout / native_dropout and their in-place forms), alpha and
feature-alpha dropout, rrelu, F.scaled_dot_product_attention with dropout_p > 0, and
F.multi_head_attention_forward (nn.MultiheadAttention, so torch's Transformer layers).
Any other torch function that draws is refused (random_ops.py).

torch's composite Python functions hide their bodies from a function mode (torch switches
the mode off while it handles a call), so multi-head attention's dropout on its attention
weights is reached one level down: the call runs under a TorchDispatchMode that replaces
its one draw (bernoulli_ on CPU; native_dropout elsewhere, with the math attention backend
pinned for that call) by the layout-free mask. In the first step of a run every aten
operation is also checked by a second dispatch mode (`RandomOpScan`), so a draw inside any
other composite is refused too, before the first optimizer step. The scan costs ~20% of a
small CPU model's step (a Python call per aten operation), so later steps skip it.

A model that checkpoints its own layers (torch.utils.checkpoint) recomputes them in
backward without this mode (torch restores only device modes there), so their dropout
would silently draw torch's mask: a dropout in a checkpointed region (or with gradients
off in a training forward: reentrant checkpointing) is refused instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._torch_internals import dispatch_mode_base, in_backward, in_checkpointed_region
from ..errors import ConfigError, ModelError
from . import ops
from .compiled import OpAtRunTime
from .random_ops import ALWAYS_DRAWING, RECURRENT, draws, recurrent_draws, refusal
from .scope import DropoutScope

aten = torch.ops.aten

# (argument names, defaults); a None name is a slot the call cannot pass (its default applies)
_FUNCTIONAL = (("input", "p", "training", "inplace"), (None, 0.5, True, False))  # F.dropout, F.dropout2d, ...
_FUNCTIONAL_ALPHA = (("input", "p", "training", "inplace"), (None, 0.5, False, False))  # F.alpha_dropout: eval default
_NATIVE = (("input", "p", "train", None), (None, None, None, False))  # torch.dropout, torch.feature_dropout
_NATIVE_INPLACE = (("input", "p", "train", None), (None, None, None, True))  # torch.dropout_, ...
_RRELU = (("input", "lower", "upper", "training", "inplace"), (None, 1.0 / 8, 1.0 / 3, False, False))  # F.rrelu
_TORCH_RRELU = (("input", "lower", "upper", "training", None), (None, 1.0 / 8, 1.0 / 3, False, False))
_TORCH_RRELU_INPLACE = (("input", "lower", "upper", "training", None), (None, 1.0 / 8, 1.0 / 3, False, True))

# function -> (kind, signature): kind picks the ops.py computation
_DROPOUTS = {F.dropout: ("dropout", _FUNCTIONAL), torch.dropout: ("dropout", _NATIVE),
             torch.dropout_: ("dropout", _NATIVE_INPLACE),
             F.dropout1d: ("channel", _FUNCTIONAL), F.dropout2d: ("channel", _FUNCTIONAL),
             F.dropout3d: ("channel", _FUNCTIONAL), torch.feature_dropout: ("channel", _NATIVE),
             torch.feature_dropout_: ("channel", _NATIVE_INPLACE),
             F.alpha_dropout: ("alpha", _FUNCTIONAL_ALPHA), torch.alpha_dropout: ("alpha", _NATIVE),
             torch.alpha_dropout_: ("alpha", _NATIVE_INPLACE),
             F.feature_alpha_dropout: ("feature_alpha", _FUNCTIONAL_ALPHA),
             torch.feature_alpha_dropout: ("feature_alpha", _NATIVE),
             torch.feature_alpha_dropout_: ("feature_alpha", _NATIVE_INPLACE)}
_RRELUS = {F.rrelu: _RRELU, torch.rrelu: _TORCH_RRELU, torch.rrelu_: _TORCH_RRELU_INPLACE}
_SDPA = (("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
         (None, None, None, None, 0.0, False, None, False))
_MHA_DROPOUT, _MHA_TRAINING = 10, 13  # positions of dropout_p and training in F.multi_head_attention_forward


def _dispatch_mode_base() -> type:
    """torch's base class for dispatch modes (its module is private, though torch's extension guide documents
    the class). Without it, a stand-in refuses what needs it (the attention dropout of nn.MultiheadAttention,
    the first-step scan) rather than letting torch draw."""
    base = dispatch_mode_base()
    if base is None:
        class Unavailable:
            def __init__(self, *args, **kwargs):
                pass

            def __enter__(self):
                raise ModelError("this torch has no TorchDispatchMode, which layout-"
                                 "free attention dropout in nn.MultiheadAttention needs: set its dropout to 0")

            def __exit__(self, *exc) -> bool:
                return False
        return Unavailable
    return base


TorchDispatchMode = _dispatch_mode_base()


def _bind(names: tuple, defaults: tuple, args: tuple, kwargs: dict) -> list:
    values = list(args) + [None] * (len(names) - len(args))
    for i, name in enumerate(names):
        if i >= len(args):
            values[i] = defaults[i] if name is None else kwargs.get(name, defaults[i])
    return values


def _argument(args: tuple, kwargs: dict, index: int, name: str, default):
    return args[index] if len(args) > index else kwargs.get(name, default)


class LayoutFreeDropoutMode(TorchFunctionMode):
    """The random calls of one micro-batch, with layout-free draws numbered in call order; others refused.

    Inside a compiled region (`compiled_region`) the draws are numbered from the region's first number, held in a
    tensor the graph reads when it runs (`region_base`), plus their count so far in the region (`region_ops`): the
    graph holds only the offsets, the same in every copy of a repeated block (compiled.py)."""

    def __init__(self, scope: DropoutScope, scan: RandomOpScan | None = None):
        super().__init__()
        self.scope, self.next_op, self.scan = scope, 0, scan
        self.region_base: torch.Tensor | None = None
        self.region_ops = 0

    @contextlib.contextmanager
    def region(self):
        """A compiled region's call: its draws continue the numbering from a run-time tensor."""
        self.region_base, self.region_ops = torch.tensor(self.next_op, dtype=torch.int64), 0
        try:
            yield
        finally:
            self.next_op += self.region_ops
            self.region_base, self.region_ops = None, 0

    def _take_op(self) -> int | OpAtRunTime:
        if _inside_checkpoint():
            raise ConfigError("a dropout runs inside a layer the model checkpoints itself (torch.utils.checkpoint, "
                              "e.g. gradient_checkpointing_enable()): its recomputation in backward would draw "
                              "torch's own mask, not this one. Turn off the model's own checkpointing (use autopar's "
                              "--recompute / --memory-budget-mb instead) or set dropout to 0")
        if self.region_base is not None:
            offset, self.region_ops = self.region_ops, self.region_ops + 1
            if torch.compiler.is_compiling():
                return OpAtRunTime(self.region_base, offset)
            return self.next_op + offset  # the region run eagerly (a run's first step, a graph break's eager part)
        op, self.next_op = self.next_op, self.next_op + 1
        return op

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            kind, signature = _DROPOUTS[func]
            x, p, training, inplace = _bind(*signature, args, kwargs)
            if training:
                return self._dropout(kind, x, float(p), bool(inplace))
        elif func in _RRELUS:
            x, lower, upper, training, inplace = _bind(*_RRELUS[func], args, kwargs)
            if training:
                return ops.rrelu(x, float(lower), float(upper), self._take_op(), self.scope, inplace=bool(inplace))
        elif func is torch.native_dropout:
            x, p = args[0], float(_argument(args, kwargs, 1, "p", 0.5))
            if _argument(args, kwargs, 2, "train", None) is not False:  # None: training, as torch reads it
                kept = ops.keep(tuple(x.shape), p, self._take_op(), self.scope, device=x.device)
                noise = kept.to(x.dtype)
                return x * (noise.div_(1.0 - p) if p < 1 else noise), kept  # as ops.dropout_noise computes it
        elif func is F.scaled_dot_product_attention:
            q, k, v, mask, p, causal, scale, gqa = _bind(*_SDPA, args, kwargs)
            if p and p > 0:
                return ops.attention(q, k, v, mask, float(p), bool(causal), scale, bool(gqa), self._take_op(),
                                     self.scope)
        elif func is F.multi_head_attention_forward:
            p = float(_argument(args, kwargs, _MHA_DROPOUT, "dropout_p", 0.0))
            if p > 0 and _argument(args, kwargs, _MHA_TRAINING, "training", True):
                with CompositeDraw(p, self._take_op(), self.scope, "nn.MultiheadAttention"), \
                        _math_attention(args[0].device):
                    return func(*args, **kwargs)
        elif func in ALWAYS_DRAWING or (func in RECURRENT and recurrent_draws(args)):
            raise refusal(_name(func), "inside the model's forward")
        if self.scan is None:
            return func(*args, **kwargs)
        with self.scan.inside(func):
            return func(*args, **kwargs)

    def _dropout(self, kind: str, x: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
        op = self._take_op()
        if p == 0:
            return x
        if kind in ("alpha", "feature_alpha"):
            return ops.alpha_dropout(x, p, op, self.scope, channel=kind == "feature_alpha", inplace=inplace)
        return ops.dropout(x, p, op, self.scope, channel=kind == "channel", inplace=inplace)


_ACTIVE_MODE: ContextVar[LayoutFreeDropoutMode | None] = ContextVar("autopar_dropout_mode", default=None)


@contextlib.contextmanager
def layout_free_dropout(scope: DropoutScope, scan: RandomOpScan | None = None):
    """The random calls of the code run inside, layout-free (the mode active, and findable by `compiled_region`)."""
    mode = LayoutFreeDropoutMode(scope, scan)
    token = _ACTIVE_MODE.set(mode)
    try:
        with mode:
            yield mode
    finally:
        _ACTIVE_MODE.reset(token)


def compiled_region(forward: Callable) -> Callable:
    """A compiled region's forward (torch.compile'd), called so that the dropouts inside it are numbered at run time
    (LayoutFreeDropoutMode.region): one graph serves every copy of a repeated block."""
    @functools.wraps(forward)
    def run(*args, **kwargs):
        mode = _ACTIVE_MODE.get()
        if mode is None or mode.region_base is not None:  # outside a step, or inside an enclosing region
            return forward(*args, **kwargs)
        with mode.region():
            return forward(*args, **kwargs)
    return run


class CompositeDraw(TorchDispatchMode):
    """The one dropout draw inside one call of a torch composite function, replaced by the layout-free mask of
    operation `op`; any other draw there is refused. Active only during that call (not its backward)."""

    def __init__(self, p: float, op: int, scope: DropoutScope, caller: str):
        super().__init__()
        self.p, self.op, self.scope, self.caller, self.done = p, op, scope, caller, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.done and func is aten.bernoulli_.float and abs(float(args[1]) - (1.0 - self.p)) < 1e-12:
            noise = args[0]  # torch's CPU dropout: empty_like(x).bernoulli_(1 - p), then scaled and multiplied
            self.done = True
            return noise.copy_(ops.keep(tuple(noise.shape), self.p, self.op, self.scope, device=noise.device))
        if not self.done and func is aten.native_dropout.default and args[2] is not False:
            x = args[0]  # the fused dropout of other devices
            self.done = True
            kept = ops.keep(tuple(x.shape), self.p, self.op, self.scope, device=x.device)
            return x * kept.to(x.dtype).div_(1.0 - self.p), kept
        if draws(func, args, kwargs):
            raise refusal(str(func), f"inside {self.caller}, after its dropout" if self.done else
                          f"inside {self.caller}, in place of the dropout expected there")
        return func(*args, **kwargs)


def _math_attention(device: torch.device):
    """Pin torch's math attention backend on accelerators (their fused kernels draw their own dropout mask, which
    no dispatch mode can replace); the CPU picks the math backend whenever dropout is on."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.MATH)


class RandomOpScan(TorchDispatchMode):
    """Every aten operation of a micro-batch checked: one that draws (random_ops.draws) is refused, naming the
    outermost torch function the model called around it."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    @contextlib.contextmanager
    def inside(self, func):
        self.calls.append(_name(func))
        try:
            yield
        finally:
            self.calls.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if draws(func, args, kwargs):
            raise refusal(str(func), f"inside {self.calls[0]}" if self.calls else "")
        return func(*args, **kwargs)


def _name(func) -> str:
    module = getattr(func, "__module__", None) or ("torch.Tensor" if "Tensor" in getattr(func, "__qualname__", "")
                                                   else "torch")
    return f"{module}.{getattr(func, '__name__', func)}"


def _inside_checkpoint() -> bool:
    """Whether this call runs in a checkpointed region (whose backward-time recomputation torch runs
    without this mode: torch.utils.checkpoint restores only device modes) or in backward itself."""
    if not torch.is_grad_enabled():  # a training forward with gradients off: reentrant checkpoint (or no_grad)
        return True
    if torch.compiler.is_compiling():  # a compiled region is traced once, in forward; a checkpoint inside it is
        return False  # the compiler's, which recomputes the same graph, mask operator included (compiled.py)
    return in_backward() or in_checkpointed_region()
