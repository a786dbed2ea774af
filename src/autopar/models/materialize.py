"""Turn a meta-device model into real, deterministically initialised tensors.

Models are built on the meta device so that no rank ever holds a full copy it does not
need; each rank (and the single-process reference run) then materialises what it keeps
with the same seed, which is what makes every copy bit-identical without broadcasting
weights. `Module.to_empty` replaces every Parameter separately, silently un-tying shared
weights (e.g. the embedding / output head), so ties are recorded first and restored after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

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
                if attr in owner._parameters:
                    owner._parameters[attr] = shared
                else:
                    owner._buffers[attr] = shared


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


@torch.no_grad()
def _initialise(module: nn.Module) -> None:
    if callable(getattr(module, "init_weights", None)):
        # Our GPT and transformers' PreTrainedModel (which also refills non-persistent
        # buffers such as rotary inv_freq and BERT's position_ids).
        _clear_hf_init_flags(module)
        module.init_weights()
        return
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()


def materialize(module: nn.Module, device: str | torch.device = "cpu", *, seed: int) -> nn.Module:
    """Allocate `module` on `device` and initialise it from `seed`; returns the same module.

    Same seed, same device type -> bit-identical weights on every call and every rank.
    A module that is not on the meta device is only moved (its weights are kept).
    Caveat: a module with neither `init_weights` nor `reset_parameters` everywhere keeps
    uninitialised memory for whatever those do not cover (custom Parameters, buffers).
    """
    target = to_device(device)
    params, buffers = tied_groups(module)
    if not _has_meta(module):
        module.to(target)
        retie(module, params, buffers)
        return module
    module.to_empty(device=target)
    retie(module, params, buffers)
    if callable(getattr(module, "tie_weights", None)):
        module.tie_weights()  # transformers: re-applies ties it knows about by config
    with seeded(target, seed):
        _initialise(module)
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
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for path, p in module.named_parameters(remove_duplicate=False):
        owner_path, _, attr = path.rpartition(".")
        owners.setdefault(id(p), []).append((module.get_submodule(owner_path), attr, path))
    kept_ids = {pid for pid, places in owners.items() if any(path in keep for _, _, path in places)}
    dropped = [places[0][0]._parameters[places[0][1]] for pid, places in owners.items() if pid not in kept_ids]
    scratch: dict[torch.dtype, torch.Tensor] = {}
    for p in dropped:
        size = max(p.numel(), scratch[p.dtype].numel() if p.dtype in scratch else 0)
        scratch[p.dtype] = torch.empty(size, dtype=p.dtype, device=target)
    for pid, places in owners.items():
        old = places[0][0]._parameters[places[0][1]]
        data = (torch.empty(old.shape, dtype=old.dtype, device=target) if pid in kept_ids
                else scratch[old.dtype][:old.numel()].view(old.shape))
        new = nn.Parameter(data, requires_grad=old.requires_grad)
        for owner, attr, _ in places:
            owner._parameters[attr] = new
    for sub in module.modules():
        for name, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:
                sub._buffers[name] = torch.empty_like(b, device=target)
    retie(module, params, buffers)
    with seeded(target, seed):
        _initialise(module)
    for pid, places in owners.items():
        if pid not in kept_ids:
            old = places[0][0]._parameters[places[0][1]]
            ghost = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="meta"), requires_grad=old.requires_grad)
            for owner, attr, _ in places:
                owner._parameters[attr] = ghost
    return module
