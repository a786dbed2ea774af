"""Turn a meta-device model into real, deterministically initialised tensors.

Models are built on the meta device so that no rank ever holds a full copy it does not
need; each rank (and the single-process reference run) then materialises what it keeps
with the same seed, which is what makes every copy bit-identical without broadcasting
weights. `Module.to_empty` replaces every Parameter separately, silently un-tying shared
weights (e.g. the embedding / output head), so ties are recorded first and restored after.

A model whose constructor initialises more than any rule here can see (nanoGPT re-initialises
its output projections by name after `apply(_init_weights)`) gets an init function attached
(`attach_init_fn`, the Trainer's `init_fn`): it then replaces the rules. `replay_init` makes one
that reruns the constructor itself for real and copies the values.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .._torch_internals import buffer_table, parameter_table, private_reset, tensor_version
from ..errors import ModelError
from .registry import to_device

TieGroups = list[list[str]]
"""Each inner list: every module path of one shared tensor, the first being canonical."""


def tied_groups(module: nn.Module) -> tuple[TieGroups, TieGroups]:
    """Paths of parameters (and buffers) reachable under more than one name."""

    def groups(named: Iterator[tuple[str, torch.Tensor]]) -> TieGroups:
        by_id: dict[int, list[str]] = {}
        for path, tensor in named:
            by_id.setdefault(id(tensor), []).append(path)
        return [paths for paths in by_id.values() if len(paths) > 1]

    return (
        groups(module.named_parameters(remove_duplicate=False)),
        groups(module.named_buffers(remove_duplicate=False)),
    )


def retie(module: nn.Module, params: TieGroups, buffers: TieGroups) -> None:
    """Make every path of each group point at the canonical (first) tensor again."""
    for group, get in ((params, module.get_parameter), (buffers, module.get_buffer)):
        for paths in group:
            shared = get(paths[0])
            for path in paths[1:]:
                owner_path, _, attr = path.rpartition(".")
                owner = module.get_submodule(owner_path)
                if attr in parameter_table(owner):
                    parameter_table(owner)[attr] = shared
                else:
                    buffer_table(owner)[attr] = shared


InitFn = Callable[[nn.Module], None]
"""Sets every parameter and buffer of the (materialised, uninitialised) whole model it is given."""

INIT_FN_ATTRIBUTE = "_autopar_init_fn"
"""Where `attach_init_fn` keeps the function on the model: it travels with the model through every copy a
layout makes (a pipeline stage materialises a deep copy), so each rank initialises exactly as one process."""


def attach_init_fn(module: nn.Module, init_fn: InitFn) -> None:
    """Initialise `module` (built on meta) with `init_fn(module)` instead of the rules `materialize` follows.

    `init_fn` runs on the whole model, under the run's seed, on every rank: a rank that keeps only a pipeline
    stage or a tensor-parallel slice runs it too (the tensors it drops share one scratch buffer meanwhile), so
    the random stream advances as in one process and the tensors it keeps get one process's values."""
    if not callable(init_fn):
        raise ModelError(f"init_fn must be a function taking the model, got {type(init_fn).__name__}")
    if not _has_meta(module):
        raise ModelError(f"init_fn initialises a model built on the meta device, but {type(module).__name__} "
                         f"holds real weights, which are trained as they are; build it on meta "
                         f"(with torch.device('meta'): ...) or drop init_fn")
    module.__dict__[INIT_FN_ATTRIBUTE] = init_fn


def _attached_init(module: nn.Module) -> InitFn | None:
    return module.__dict__.get(INIT_FN_ATTRIBUTE)


def replay_init(build: Callable[[], nn.Module]) -> InitFn:
    """An init function that reruns the model's constructor: `build()` (e.g. `lambda: GPT(config)`) builds the
    model for real on the CPU, under the run's seed, and every parameter and buffer is copied from it by name.

    The values are those of the model built for real after `torch.manual_seed(seed)`, whatever the
    constructor does (`apply(_init_weights)`, re-initialisation by name, buffers it computes). Cost: one whole
    copy of the model in host memory (fp32: 4 bytes a parameter) on every rank while it materialises, freed
    after; a model that does not fit there needs an init function that initialises in place instead."""

    def replay(module: nn.Module) -> None:
        with torch.device("cpu"):
            real = build()
        if not isinstance(real, nn.Module):
            raise ModelError(f"replay_init's function must build the model, got {type(real).__name__}")
        sources = {**dict(real.named_parameters()), **dict(real.named_buffers())}
        with torch.no_grad():
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                source = sources.get(name)
                if source is None or source.shape != tensor.shape or source.is_meta:
                    seen = "missing" if source is None else f"{tuple(source.shape)} on {source.device}"
                    raise ModelError(f"replay_init: the model it builds has no real {name!r} of shape "
                                     f"{tuple(tensor.shape)} ({seen}); its function must build the same model, "
                                     f"for real (not on meta)")
                tensor.copy_(source)

    return replay


def _has_meta(module: nn.Module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.is_meta for t in tensors)


@contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Seed the CPU generator and `device`'s generator; restore both afterwards.

    Only the generators init can use are touched, so the caller's RNG streams (data
    order, dropout) are unaffected by materialising a model.
    """
    if device.type in ("cpu", "meta"):
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            yield
        return
    mod = torch.get_device_module(device.type)
    index = device.index if device.index is not None else getattr(mod, "current_device", int)()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        torch.random.default_generator.manual_seed(seed)
        if hasattr(mod, "device"):
            with mod.device(index):
                mod.manual_seed(seed)  # seeds the current device only
        else:
            mod.manual_seed(seed)
        yield


def _clear_hf_init_flags(module: nn.Module) -> None:
    """transformers skips modules flagged `_is_hf_initialized`; fresh storage needs init."""
    for sub in module.modules():
        sub.__dict__.pop("_is_hf_initialized", None)


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Submodules, children before their parent: the order in which construction initialises them."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module


def _reset_method(module: nn.Module):
    """torch's modules' own initialiser (nn.MultiheadAttention names it privately)."""
    method = getattr(module, "reset_parameters", None)
    return method if callable(method) else private_reset(module)


def _model_init(module: nn.Module):
    """The model's own init method, if it has one: `init_weights()`, or `_init_weights(module)` applied to
    every submodule (the transformers / nanoGPT convention; a `_init_weights()` taking no module is called once)."""
    method = getattr(module, "init_weights", None)
    if callable(method):
        return method
    method = getattr(module, "_init_weights", None)
    if not callable(method):
        return None
    takes_module = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                       for p in inspect.signature(method).parameters.values())
    return (lambda: module.apply(method)) if takes_module else method


def check_init_rules(module: nn.Module) -> None:
    """Fail early (the same way on every rank) when a meta-built tensor has no rule to initialise it.

    A model with its own init method or an attached init function is trusted here (`materialize` checks the
    result); otherwise every parameter and buffer must belong to a module with `reset_parameters` (itself or an
    ancestor).
    """
    if _model_init(module) is not None or _attached_init(module) is not None:
        return
    covered: set[str] = set()
    for path, sub in module.named_modules():
        if _reset_method(sub) is not None:
            covered.add(path)
    missing = []
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in named:
            owner = name.rpartition(".")[0]
            ancestors = {owner.rsplit(".", k)[0] for k in range(owner.count(".") + 1)} | {""} if owner else {""}
            if tensor.is_meta and not ancestors & covered:
                missing.append(f"{kind} {name!r}")
    if missing:
        raise ModelError(_uninitialised_message(
            module, missing, "no module holding {them} has reset_parameters() and the model has no init method"))


def _uninitialised_message(module: nn.Module, missing: list[str], why: str) -> str:
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    them = "it" if len(missing) == 1 else "them"
    name = type(module).__name__
    return (f"{name} was built on the meta device, where tensors hold no values, and nothing would set {shown}: "
            f"{why.format(them=them)}. Without editing the model: pass the Trainer "
            f"init_fn=autopar.replay_init(lambda: {name}(...)) (reruns the constructor for real on the CPU under the "
            f"seed and copies the values: one whole copy of the model in host memory while it materialises), or "
            f"init_fn=a function that initialises the whole model given to it; or give the model an init_weights() "
            f"(or _init_weights(module)) that sets {them}; or build the model for real (not on meta)")


def _leaves_unwritten(module: nn.Module) -> str:
    who = "its init_fn" if _attached_init(module) is not None else "the model's init"
    return who + " leaves {them} unwritten"


def _fill_sentinels(module: nn.Module) -> dict[int, int]:
    """Fill fresh storage with values no init leaves behind (NaN; the largest integer; True), so that what
    the init did not write can be found; returns each non-float tensor's version counter."""
    versions = {}
    for t in [*module.parameters(), *module.buffers()]:
        with torch.no_grad():
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
            else:
                t.fill_(True if t.dtype == torch.bool else torch.iinfo(t.dtype).max)
                versions[id(t)] = tensor_version(t)
    return versions


def _unwritten(module: nn.Module, versions: dict[int, int], only: set[str] | None = None) -> list[str]:
    """Tensors (or parts) the init left at their sentinel; `only`: the parameters to look at."""
    found = []
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            if kind == "parameter" and only is not None and name not in only:
                continue
            if t.is_floating_point() or t.is_complex():
                stale = bool(torch.isnan(t).any())
            else:
                sentinel = True if t.dtype == torch.bool else torch.iinfo(t.dtype).max
                stale = versions.get(id(t)) == tensor_version(t) and bool((t == sentinel).all())
            if stale:
                found.append(f"{kind} {name!r}")
    return found


@torch.no_grad()
def _initialise(module: nn.Module) -> None:
    """Every submodule's reset_parameters (children first, as construction runs them), then the model's own
    init; a model with `init_weights()` (our GPT, transformers' PreTrainedModel: it also refills
    non-persistent buffers such as rotary inv_freq) is left to that alone, and one with an attached init
    function to that."""
    attached = _attached_init(module)
    if attached is not None:
        attached(module)
        return
    if callable(getattr(module, "init_weights", None)):
        _clear_hf_init_flags(module)
        module.init_weights()
        return
    for _, sub in _post_order(module):
        reset = _reset_method(sub)
        if reset is not None:
            reset()
    model_init = _model_init(module)
    if model_init is not None:
        model_init()


def materialize(module: nn.Module, device: str | torch.device = "cpu", *, seed: int) -> nn.Module:
    """Allocate `module` on `device` and initialise it from `seed`; returns the same module.

    Same seed, same device type -> bit-identical weights on every call and every rank.
    A module that is not on the meta device is only moved (its weights are kept).
    Every parameter and buffer must be set by a rule: its module's (or an ancestor's)
    `reset_parameters`, or the model's `init_weights()` / `_init_weights(module)`, or else by the init
    function attached to the model (`attach_init_fn`), which replaces the rules. One that no rule
    covers (a bare nn.Parameter on a model without an init method) or that the init leaves
    unwritten is a ModelError naming it, never NaN or garbage trained on silently.
    """
    target = to_device(device)
    params, buffers = tied_groups(module)
    if not _has_meta(module):
        module.to(target)
        retie(module, params, buffers)
        return module
    check_init_rules(module)
    module.to_empty(device=target)
    retie(module, params, buffers)
    if callable(getattr(module, "tie_weights", None)):
        module.tie_weights()  # transformers: re-applies ties it knows about by config
    versions = _fill_sentinels(module)
    with seeded(target, seed):
        _initialise(module)
    missing = _unwritten(module, versions)
    if missing:
        raise ModelError(_uninitialised_message(module, missing, _leaves_unwritten(module)))
    return module


def materialize_partial(module: nn.Module, keep: set[str], device: str | torch.device = "cpu", *,
                        seed: int) -> nn.Module:
    """Like `materialize`, but only the parameters named in `keep` get memory of their own.

    Every other parameter is a view into one shared scratch buffer (the size of the largest
    of them) while the model's own init runs: its shapes and call order are unchanged, so the
    random stream advances exactly as in a full materialisation, and the kept parameters
    come out bit-identical to `materialize(module, seed=seed)`. Afterwards the others go
    back to the meta device. Peak memory: the kept parameters, the buffers, one scratch.
    (An init that reads one parameter's values while initialising another would see
    scratch contents; no model we know of does.)
    """
    target = to_device(device)
    params, buffers = tied_groups(module)
    if not _has_meta(module):  # built for real: its weights are the user's, kept (as `materialize` does)
        module.to(target)
        retie(module, params, buffers)
        return module
    check_init_rules(module)
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for path, p in module.named_parameters(remove_duplicate=False):
        owner_path, _, attr = path.rpartition(".")
        owners.setdefault(id(p), []).append((module.get_submodule(owner_path), attr, path))
    kept_ids = {pid for pid, places in owners.items() if any(path in keep for _, _, path in places)}
    dropped = [parameter_table(places[0][0])[places[0][1]] for pid, places in owners.items() if pid not in kept_ids]
    scratch: dict[torch.dtype, torch.Tensor] = {}
    for p in dropped:
        size = max(p.numel(), scratch[p.dtype].numel() if p.dtype in scratch else 0)
        scratch[p.dtype] = torch.empty(size, dtype=p.dtype, device=target)
    for pid, places in owners.items():
        old = parameter_table(places[0][0])[places[0][1]]
        data = (torch.empty(old.shape, dtype=old.dtype, device=target) if pid in kept_ids
                else scratch[old.dtype][:old.numel()].view(old.shape))
        new = nn.Parameter(data, requires_grad=old.requires_grad)
        for owner, attr, _ in places:
            parameter_table(owner)[attr] = new
    for sub in module.modules():
        for name, b in list(buffer_table(sub).items()):
            if b is not None and b.is_meta:
                buffer_table(sub)[name] = torch.empty_like(b, device=target)
    retie(module, params, buffers)
    versions = _fill_sentinels(module)
    with seeded(target, seed):
        _initialise(module)
    kept_names = {path for pid, places in owners.items() if pid in kept_ids for _, _, path in places}
    missing = _unwritten(module, versions, only=kept_names)  # the others share scratch: not checkable here
    if missing:
        raise ModelError(_uninitialised_message(module, missing, _leaves_unwritten(module)))
    for pid, places in owners.items():
        if pid not in kept_ids:
            old = parameter_table(places[0][0])[places[0][1]]
            ghost = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="meta"), requires_grad=old.requires_grad)
            for owner, attr, _ in places:
                parameter_table(owner)[attr] = ghost
    return module
