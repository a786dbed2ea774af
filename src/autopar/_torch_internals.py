"""Every private torch API autopar uses, one small function each, and nothing else.

Why one module: torch may rename or drop any underscore name in any release. Here each one is
named once, with what it is for, its public fallback where torch has one (used when the private
name is gone), and the torch versions it was checked on; `tests/test_torch_internals.py` touches
every function and fails naming the API that went missing, and `tests/test_private_torch.py` fails
on a private torch name used anywhere else in src/.

Checked on: torch 2.13.0 (CPU build; the whole test suite). The GPU image carries torch 2.11: the
range in pyproject.toml admits it, but these functions have not been run on it from here; run
`pytest tests/test_torch_internals.py` there to check them.

This module imports nothing from autopar (it is the lowest layer): callers turn a missing API
into their own error where a fallback cannot stand in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class PrivateApi:
    """One private torch name this module wraps: what it is, its public fallback, where it was run."""

    function: str  # the function of this module that wraps it
    private: str  # the torch name
    fallback: str  # what runs without it ("none": the caller's feature is refused or skipped)
    checked_on: tuple[str, ...] = ("2.13.0",)


APIS: dict[str, PrivateApi] = {}


def _wraps(private: str, fallback: str) -> Callable:
    def register(fn: Callable) -> Callable:
        APIS[fn.__name__] = PrivateApi(fn.__name__, private, fallback)
        return fn
    return register


# ------------------------------------------------------------------ process groups and stores

@_wraps("ProcessGroupGloo._Options, Options._timeout",
        "None: the group is made without options and gets torch's default timeout")
def backend_options(backend: str, timeout_s: float) -> Any | None:
    """Backend options carrying a timeout (sub-groups do not inherit the world's; new_group's public
    `timeout` does not reach a DeviceMesh's groups, which take only options)."""
    try:
        options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
    except AttributeError:
        return None
    return options


@_wraps("torch.distributed.rendezvous._create_c10d_store", "dist.TCPStore(host, port, world, rank == 0)")
def tcp_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta):
    """The job's TCP store as torchrun's rendezvous makes it (same server/client choice and options)."""
    try:
        from torch.distributed.rendezvous import _create_c10d_store
    except ImportError:
        return dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    return _create_c10d_store(host, port, rank, world_size, timeout)


@_wraps("distributed_c10d._world.pg_map", "an empty list: nothing is found to destroy")
def registered_process_groups() -> list:
    """Every process group this process holds, the default one included (torch keeps no public list)."""
    from torch.distributed import distributed_c10d as c10d
    world = getattr(c10d, "_world", None)
    return list(getattr(world, "pg_map", {}))


@_wraps("distributed_c10d._get_default_store", "None: failures are raised on their own rank only")
def default_store():
    """The default process group's store (torch has no public accessor); None without one."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


@_wraps("Work._source_rank", "None: a receive from any rank does not say its source")
def work_source_rank(work) -> int | None:
    """The rank a finished receive-from-any got its message from."""
    source = getattr(work, "_source_rank", None)
    if source is None:
        return None
    try:
        return source()
    except RuntimeError:
        return None


@_wraps("torch.distributed.tensor._redistribute._gen_transform_infos, "
        "torch.distributed.tensor.debug._clear_sharding_prop_cache",
        "whatever of the three this torch lacks is skipped")
def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding and redistribution decisions (they hold destroyed groups)."""
    with contextlib.suppress(ImportError):
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
        _clear_sharding_prop_cache()
    with contextlib.suppress(ImportError):
        from torch.distributed.tensor import _redistribute
        _redistribute._gen_transform_infos.cache_clear()
        if hasattr(_redistribute, "clear_redistribute_planner_cache"):
            _redistribute.clear_redistribute_planner_cache()


# ------------------------------------------------------------------ autograd

@_wraps("torch._C._current_autograd_node", "False: not known to run in backward")
def in_backward() -> bool:
    """Whether this code runs inside an autograd backward (a node is executing)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current is not None and current() is not None


@_wraps("torch._C._autograd._top_saved_tensors_default_hooks, torch.utils.checkpoint's _checkpoint_hook",
        "False: not known to run in a checkpointed region")
def in_checkpointed_region() -> bool:
    """Whether the innermost saved-tensor hooks are non-reentrant checkpoint's (its forward runs now)."""
    top = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
    hooks = top(True) if top is not None else None
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


def _accumulate_grad_by_graph() -> type:
    leaf = torch.zeros((), requires_grad=True)
    return type((leaf * 1).grad_fn.next_functions[0][0])


@_wraps("torch._C._functions.AccumulateGrad", "the type of a leaf's accumulator node in a tiny graph")
def accumulate_grad_type() -> type:
    """The class of the autograd node that accumulates a leaf's gradient."""
    functions = getattr(torch._C, "_functions", None)
    return getattr(functions, "AccumulateGrad", None) or _accumulate_grad_by_graph()


@_wraps("Node._input_metadata", "none (split backward cannot place its gradients)")
def input_metadata(node) -> Sequence:
    """Per input of an autograd node: the shape and dtype autograd expects its gradient to have."""
    return node._input_metadata


@_wraps("Node._saved_<name>", "none (split backward takes autograd's own path for the op)")
def saved(node, name: str) -> Any:
    """A tensor or value an autograd node saved for its backward, by the derivative formula's name."""
    return getattr(node, "_saved_" + name)


@_wraps("torch.autograd.graph._engine_run_backward", "torch.autograd.grad")
def engine_grad(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence) -> tuple:
    """torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True) without its
    Python per-argument checks (the caller checks shapes)."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    return run(tuple(outputs), tuple(grads), True, False, tuple(inputs), True, accumulate_grad=False)


@_wraps("torch.autograd.graph._engine_run_backward", "torch.autograd.backward")
def engine_backward(roots: Sequence, grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                    retain_graph: bool = True) -> None:
    """torch.autograd.backward(roots, grads, inputs=inputs, retain_graph=retain_graph) without its per-root
    Python checks; `roots` may be tensors or gradient edges."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:
        torch.autograd.backward(list(roots), list(grads), inputs=list(inputs), retain_graph=retain_graph)
    else:
        run(tuple(roots), tuple(grads), retain_graph, False, tuple(inputs), allow_unreachable=True,
            accumulate_grad=True)


# ------------------------------------------------------------------ tensors and modules

@_wraps("Tensor._version", "none")
def tensor_version(t: torch.Tensor) -> int:
    """A tensor's in-place write counter: it changes whenever anything writes the tensor."""
    return t._version


@_wraps("Module._parameters", "none (setattr refuses a plain tensor where a Parameter was)")
def parameter_table(module: nn.Module) -> dict:
    """The module's own parameter slots, to replace a parameter (or swap in a plain tensor) in place."""
    return module._parameters


@_wraps("Module._parameters", "none (a shallow copy of a module shares its parameter slots)")
def own_parameter_table(module: nn.Module) -> None:
    """Give a shallow copy of a module parameter slots of its own, so replacing one leaves the original alone."""
    module._parameters = dict(module._parameters)


@_wraps("Module._buffers", "none")
def buffer_table(module: nn.Module) -> dict:
    """The module's own buffer slots, to replace a buffer in place, keeping its persistence."""
    return module._buffers


@_wraps("MultiheadAttention._reset_parameters", "None: the module is initialised by the other rules")
def private_reset(module: nn.Module) -> Callable | None:
    """The initialiser of torch modules that name it privately (nn.MultiheadAttention, nn.Transformer)."""
    method = getattr(module, "_reset_parameters", None)
    return method if callable(method) else None


@_wraps("torch._foreach_norm", "one torch.linalg.vector_norm per tensor")
def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm, in its own dtype, as one fused call."""
    fused = getattr(torch, "_foreach_norm", None)
    return list(fused(tensors)) if fused is not None else [torch.linalg.vector_norm(t) for t in tensors]


@_wraps("torch._foreach_copy_", "one copy_ per tensor")
def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """targets[i].copy_(sources[i]) for every i, as one fused call."""
    fused = getattr(torch, "_foreach_copy_", None)
    if fused is not None:
        fused(targets, sources)
    else:
        for target, source in zip(targets, sources):
            target.copy_(source)


@_wraps("torch.ops.aten._safe_softmax", "softmax, with rows that attend to nothing set to 0")
def safe_softmax(scores: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax where a row of only -inf gives zeros, not NaN (what SDPA's math path uses)."""
    op = getattr(torch.ops.aten, "_safe_softmax", None)
    if op is not None:
        return op(scores, dim)
    return torch.softmax(scores, dim).masked_fill(scores.isneginf().all(dim, keepdim=True), 0.0)


# ------------------------------------------------------------------ operators, dispatch and tracing

@_wraps("OpOverload._schema", "None: the operation's arguments are not known by name")
def op_schema(op: Any):
    """An aten operation's schema (argument names, defaults, which arguments it writes)."""
    return getattr(op, "_schema", None)


@_wraps("torch._C.DispatchKey.CompositeImplicitAutograd", "True: every operation may decompose")
def decomposes(op: Any) -> bool:
    """Whether an aten operation is a composite that dispatch modes see as the operations it is made of (as
    torch.utils.flop_counter does, counting a linear as its addmm); True where that cannot be told."""
    try:
        return bool(op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd))
    except (AttributeError, RuntimeError):
        return True


@_wraps("torch.utils._python_dispatch.TorchDispatchMode", "None: the caller refuses what needs it")
def dispatch_mode_base() -> type | None:
    """torch's base class for dispatch modes (torch's extension guide documents it; its module is private)."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        return None
    return TorchDispatchMode


@_wraps("torch._subclasses.fake_tensor.FakeTensorMode", "None: the caller traces on meta")
def fake_tensor_mode():
    """A fresh FakeTensorMode that refuses real tensors as inputs; None where this torch lacks it."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:
        return None
    return FakeTensorMode(allow_non_fake_inputs=False)


@_wraps("torch.utils._pytree.tree_leaves", "none")
def tree_leaves(tree: Any) -> list:
    """The leaves of nested lists, tuples, dicts and dataclass outputs (torch's pytree rules)."""
    from torch.utils import _pytree
    return _pytree.tree_leaves(tree)


@_wraps("torch.utils._pytree.tree_unflatten", "none")
def tree_unflatten(leaves: Iterable, spec: Any) -> Any:
    """Rebuild the structure `spec` (a pytree TreeSpec, e.g. an exported program's output spec)."""
    from torch.utils import _pytree
    return _pytree.tree_unflatten(list(leaves), spec)


@_wraps("FSDPModule._get_fsdp_state()._fsdp_param_group, FSDPParam._unsharded_inner_tensors",
        "an empty list: FSDP2's gathered parameters go uncounted")
def fsdp_unsharded_tensors(module) -> list[torch.Tensor]:
    """The tensors whose storages FSDP2 resizes in place (its gathered parameters) for one FSDP2 unit."""
    state = getattr(module, "_get_fsdp_state", None)
    group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
    tensors: list[torch.Tensor] = []
    for fp in (group.fsdp_params if group is not None else ()):
        tensors += [*fp.all_gather_outputs, *getattr(fp, "_unsharded_inner_tensors", ())]
    return tensors


FX_GENERATED_FILE = "<eval_with_key>"


@_wraps("torch.fx's file name for generated code, '<eval_with_key>.N'", "none: failures name no node")
def is_fx_generated(filename: str) -> bool:
    """Whether a frame's file is code torch.fx generated for a graph (one `name = op(...)` line per node)."""
    return filename.startswith(FX_GENERATED_FILE)


# ------------------------------------------------------------------ torch.compile's own accounting

@_wraps("torch._dynamo.utils.counters, torch._dynamo.utils.calculate_time_spent",
        "empty: compiled runs report no graph breaks, recompilations or compile time")
def compile_counters() -> dict[str, Any]:
    """What torch.compile did so far in this process: frames compiled, graph breaks (reason -> count),
    inductor cache hits and misses, seconds spent compiling. torch has no public account of these."""
    try:
        from torch._dynamo.utils import calculate_time_spent, counters
    except ImportError:
        return {}
    spent = calculate_time_spent()
    return {"frames": int(counters["frames"]["total"]), "graph_breaks": dict(counters["graph_break"]),
            "cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "cache_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
            "seconds": float(sum(v for k, v in spent.items() if k.startswith("entire_")))}


@_wraps("torch._dynamo.config.recompile_limit",
        "none: past torch's limit (8 per code object), further blocks of one class run eagerly, with a warning")
def allow_compiled_regions(count: int) -> None:
    """Let one code object (a block class's forward) hold a cache entry per region: torch guards each compiled
    block on its own module, so n blocks of one class are n entries of that code object's cache even where
    they share one graph; past the default limit torch would run the later blocks eagerly."""
    try:
        from torch._dynamo import config
    except ImportError:
        return
    if hasattr(config, "recompile_limit"):
        config.recompile_limit = max(config.recompile_limit, 2 * count)
