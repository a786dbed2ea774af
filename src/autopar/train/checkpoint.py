"""Checkpoints with torch.distributed.checkpoint (DCP), saved atomically.

Layout inside a run folder:

    checkpoints/step_00000100/     .metadata, __*_*.distcp (DCP), trainer.json, rng_rank*.pt, manifest.json
    checkpoints/latest             the name of the newest complete checkpoint

A save writes into `step_N.partial/`; only when every rank has finished does rank 0 write
the manifest (checksums of every file, train/manifest.py), rename the folder to `step_N/`
and then replace `latest` (write-to-temp + os.replace, both atomic on POSIX). A crash at
any point leaves the previous checkpoint and `latest` untouched.
DCP stores parameters by name and reshards on load, so a checkpoint is not tied to the
number of processes that wrote it. Tensor-parallel slices are gathered into whole tensors
before saving and sliced again after loading (`tensor_parallel`), so checkpoints always
hold the single-process layout and any (dp, tp, pp) can resume any other. All ranks must see the same folder (one machine, or a
shared filesystem across machines).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from ..checkpoint_names import checkpoint_name
from ..errors import CheckpointError
from . import manifest
from .manifest import LATEST, TRAINER_STATE


def _primary_names(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Drop aliases of tied tensors (keep the first name), so every layout saves and asks for the
    same keys: a pipeline stage holds one name for a tied weight, the whole model lists both."""
    kept, aliases, first = {}, {}, {}
    for key, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value  # a DTensor's own data_ptr is not its shard's
        same = ((local.data_ptr(), tuple(value.shape), value.dtype)
                if isinstance(value, torch.Tensor) and local.numel() else None)
        if same is not None and same in first:
            aliases[key] = first[same]
        else:
            if same is not None:
                first[same] = key
            kept[key] = value
    return kept, aliases


def _whole_state(model_sd: dict, optim_sd: dict, tensor_parallel: Any) -> tuple[dict, dict]:
    """Gather tensor-parallel slices (parameters and their optimizer state) into whole tensors."""
    if tensor_parallel is None:
        return model_sd, optim_sd  # ZeRO-3's DTensor shards are saved as they are: DCP stores them whole
    shapes = {k: tuple(v.shape) for k, v in model_sd.items()}
    # ZeRO-3 with tp: a slice sharded again over dp; gathered over dp first (the slice whole), then over tp
    model_sd = {k: tensor_parallel.gather(k, _whole_over_dp(v)) for k, v in model_sd.items()}
    state = {}
    for fqn, entries in optim_sd.get("state", {}).items():
        state[fqn] = {k: tensor_parallel.gather(fqn, _whole_over_dp(v)) if _is_slice_state(v, shapes.get(fqn))
                      else _whole_over_dp(v) for k, v in entries.items()}
    return model_sd, {**optim_sd, "state": state}


def _whole_over_dp(value: Any) -> Any:
    """A DTensor (ZeRO-3: FSDP2's dp shard) gathered whole (collective over its mesh); anything else as is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _placeholder(value: Any) -> Any:
    """Where DCP loads a whole tensor for a DTensor target (sliced into its shard afterwards)."""
    return torch.empty(value.shape, dtype=value.dtype, device=value.device) if isinstance(value, DTensor) else value


def _like(value: Any, target: Any) -> Any:
    """`value` (this rank's whole tp slice) as `target`'s DTensor shard, sliced locally (no communication)."""
    if isinstance(target, DTensor) and not isinstance(value, DTensor):
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    return value


def _is_slice_state(value: Any, param_shape: tuple | None) -> bool:
    return isinstance(value, torch.Tensor) and param_shape is not None and value.dim() > 0 \
        and tuple(value.shape) == param_shape


def _get_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state by parameter name, whole over dp: a sharded optimizer (zero/) gathers
    its shards, and its fp32 master weights stand for the parameters (bf16 runs save fp32)."""
    if not hasattr(optimizer, "whole_state_dict"):
        return get_state_dict(model, optimizer)
    masters = optimizer.whole_params()  # trainable parameters only: frozen ones (no master) are saved as they are
    primary = {id(p): name for name, p in model.named_parameters()}
    model_sd = {k: masters[primary[id(v)]] if primary.get(id(v)) in masters else v.detach()
                for k, v in model.state_dict(keep_vars=True).items()}
    return model_sd, optimizer.whole_state_dict()


def _set_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    if not hasattr(optimizer, "load_whole_state_dict"):
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return
    model.load_state_dict(model_sd)
    optimizer.load_whole_params(model_sd)
    optimizer.load_whole_state_dict(optim_sd)


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], tensor_parallel: Any = None, *,
                    manifest_info: dict[str, Any] | None = None, keep: int = 0) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint folder.

    manifest_info: what the manifest records besides step and checksums (layout, config fingerprint).
    keep > 0: then delete all but the newest `keep` complete checkpoints.
    """
    root = Path(run_dir) / "checkpoints"
    final = root / checkpoint_name(step)
    partial = root / (final.name + ".partial")
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    dist.barrier()
    model_sd, optim_sd = _whole_state(*_get_state(model, optimizer), tensor_parallel)
    dcp.save({"model": _primary_names(model_sd)[0], "optim": optim_sd}, checkpoint_id=partial)
    torch.save(torch.get_rng_state(), partial / f"rng_rank{rank}.pt")
    if rank == 0:
        manifest.write_atomic(partial / TRAINER_STATE, json.dumps({**trainer_state, "step": step,
                                                          "world_size": dist.get_world_size()}))
    dist.barrier()
    if rank == 0:
        manifest.write_manifest(partial, step, {"world_size": dist.get_world_size(), **(manifest_info or {})})
        if final.exists():  # re-saving the same step: keep the old one until the new one is complete
            shutil.rmtree(final)
        os.replace(partial, final)
        manifest.write_atomic(root / LATEST, final.name)
        manifest.prune(Path(run_dir), keep)
    dist.barrier()
    return final


def find_checkpoint(path: str | Path) -> Path:
    """Resolve --resume: a run folder (its newest checkpoint that verifies) or a checkpoint folder."""
    return manifest.choose_checkpoint(path)[0]


def _ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (a zero-lr step on zero grads) so DCP can load into them.

    torch's own helper skips this when gradients already exist, and ours always do (they are
    views into the all-reduce buckets).
    """
    if hasattr(optimizer, "ensure_state"):  # a sharded optimizer (zero/) creates its own
        optimizer.ensure_state()
        return
    if optimizer.state:
        return
    saved = []
    for group in optimizer.param_groups:
        saved.append(group["lr"])
        group["lr"] = 0.0
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr


def _root_cause(exc: BaseException) -> str:
    """One line for DCP's failure: its CheckpointException wraps each rank's own exception."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))
        exc = exc[0] if isinstance(exc, tuple) else exc  # DCP wraps each as (exception, traceback)
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    tensor_parallel: Any = None) -> dict[str, Any]:
    """Collective: load model and optimizer state in place; returns the trainer state (step, ...)."""
    try:
        trainer_state = json.loads((path / TRAINER_STATE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: {TRAINER_STATE} is unreadable ({exc})") from None
    _ensure_optimizer_state(optimizer)
    model_sd, optim_sd = _get_state(model, optimizer)
    primary, aliases = _primary_names(model_sd)
    shapes = {k: tuple(v.shape) for k, v in model_sd.items()}
    if tensor_parallel is not None:  # load whole tensors, then keep this rank's slices
        targets = {"model": primary, "optim": optim_sd}
        primary = {k: _placeholder(v) for k, v in primary.items()}  # ZeRO-3: dp shards made whole (below)
        optim_sd = {**optim_sd, "state": {fqn: {k: _placeholder(v) for k, v in entries.items()}
                                          for fqn, entries in optim_sd.get("state", {}).items()}}
        whole = lambda fqn, v: v.new_empty(tensor_parallel.full_shape(fqn, v))
        primary = {k: whole(k, v) if tensor_parallel.is_sharded(k) else v for k, v in primary.items()}
        optim_sd = {**optim_sd, "state": {
            fqn: {k: whole(fqn, v) if tensor_parallel.is_sharded(fqn) and _is_slice_state(v, shapes.get(fqn)) else v
                  for k, v in entries.items()} for fqn, entries in optim_sd.get("state", {}).items()}}
    state = {"model": primary, "optim": optim_sd}
    # The file's parameter groups are one rank's (DCP keeps one copy of a non-tensor entry), so a pipeline
    # rank would get another stage's parameter names (fatal for an optimizer with no state, e.g. plain SGD:
    # nothing else tells DCP which parameters are this rank's). This rank's own groups are loaded instead;
    # their hyperparameters come from this run's config anyway (below).
    own_groups = copy.deepcopy(optim_sd.get("param_groups"))
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        first = _root_cause(exc)
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded into this model ({first[:300]}); "
                              f"is it corrupt, or from another model?") from None
    if tensor_parallel is not None:
        state["model"] = {k: tensor_parallel.shard(k, v) for k, v in state["model"].items()}
        state["optim"]["state"] = {fqn: {k: tensor_parallel.shard(fqn, v) if tensor_parallel.is_sharded(fqn)
                                         and isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                         for k, v in entries.items()}
                                   for fqn, entries in state["optim"].get("state", {}).items()}
        state["model"] = {k: _like(v, targets["model"][k]) for k, v in state["model"].items()}
        old_state = targets["optim"].get("state", {})
        state["optim"]["state"] = {fqn: {k: _like(v, old_state[fqn][k]) for k, v in entries.items()}
                                   for fqn, entries in state["optim"]["state"].items()}
    if own_groups is not None:
        state["optim"]["param_groups"] = own_groups
    loaded = {**state["model"], **{alias: state["model"][key] for alias, key in aliases.items()}}
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    _set_state(model, optimizer, loaded, state["optim"])
    # Hyperparameters come from this run's config (the learning rate from the scheduler's
    # state, set by the caller), never from the file: measured with torch 2.13, a pipeline
    # rank whose tied weight another rank also saved gets its groups back without lr/betas/eps.
    for group, wanted in zip(optimizer.param_groups, configured):
        for key, value in wanted.items():
            group.setdefault(key, value)
    rng = path / f"rng_rank{dist.get_rank()}.pt"
    if rng.is_file() and trainer_state.get("world_size") == dist.get_world_size():
        torch.set_rng_state(torch.load(rng, weights_only=True))
    return trainer_state
