"""The optimizer (AdamW by default; Adam, SGD, Adagrad, sparse-adam on request) with weight decay on matrices only,
and warm-up + cosine learning rate."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import TrainConfig
from ..errors import ModelError


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """Weight decay on >= 2-D weights (matrices, embeddings); none on biases and norms.

    AdamW decays decoupled from the gradient; Adam, SGD and Adagrad add weight_decay * w to
    the gradient (torch's convention for them). SGD has no momentum: it is the plain rule
    that the decentralized and asynchronous methods are stated for.
    """
    seen: set[int] = set()
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:  # a rank holding only frozen parameters (a pipeline stage of a frozen backbone) steps nothing
        groups = [{"params": [], "weight_decay": 0.0}]
    kernel = optimizer_kernel(model, decay + no_decay, config)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, **kernel)
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad(groups, lr=config.lr, **kernel)
    if config.optimizer in ("adam", "sparse-adam"):  # sparse-adam: Adam on dense params (see sparse/optim.py)
        return torch.optim.Adam(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.adam_eps,
                                **kernel)
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.adam_eps,
                             **kernel)


FUSED_DEVICES = ("cpu", "cuda")  # where torch has one-kernel Adam, AdamW, SGD and Adagrad steps


def optimizer_kernel(model: nn.Module, params: list[torch.Tensor], config: TrainConfig) -> dict[str, bool]:
    """How the update's element-wise math runs: {"fused": True} (the default, `optimizer_kernel`) where torch has
    the kernel, else {"foreach": True}.

    The update is element-wise work over every parameter (AdamW: ~10 passes over four tensors of the model's size
    with foreach): a third of a gpt-small step on one CPU thread. torch's fused step does it in one pass: 108 ms of
    CPU against foreach's 460 ms (and an inductor-compiled step's 130 ms, after a 2-minute compile) on gpt-small's
    86M parameters (docs/features/compile.md). It differs from foreach by an ulp or so per step (its own operation
    order); every layout builds the same one, so layouts still equal one process. foreach where fused has no
    kernel: parameters on another device or of an integer dtype, sparse gradients (an embedding with
    sparse=True, sparse-adam's tables), and ZeRO-3's sharded parameters under SGD or Adagrad (DTensor has no
    sharding rule for their fused kernels)."""
    modules = model.modules() if isinstance(model, nn.Module) else ()  # (a parameter list: the sparse engine's dense part)
    sparse = config.optimizer == "sparse-adam" or any(getattr(m, "sparse", False) is True for m in modules)
    # Sharded parameters (ZeRO-3's DTensors) step through DTensor, which shards fused Adam and AdamW only.
    sharded = any(isinstance(p, DTensor) for p in params) and config.optimizer not in ("adam", "adamw")
    fusable = not (sparse or sharded) and all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    return {"fused": True} if config.optimizer_kernel == "fused" and fusable else {"foreach": True}


def check_trainable(model: nn.Module) -> None:
    """Refuse a model with nothing to train (every parameter frozen) before any rank builds anything.

    Frozen parameters (requires_grad False) are kept as they are under every layout and get neither
    gradients nor optimizer state; a tied weight is one Parameter, so it is frozen wherever it is read."""
    params = list({id(p): p for p in model.parameters()}.values())
    if any(p.requires_grad for p in params):
        return
    what = (f"all {len(params)} parameters ({sum(p.numel() for p in params):,} elements) have requires_grad=False"
            if params else "it has no parameters")
    raise ModelError(f"{type(model).__name__} has nothing to train: {what}. Unfreeze what should train "
                     f"(e.g. module.requires_grad_(True) on a head or adapters) before passing it to the Trainer")


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of the peak lr at `step`: linear warm-up, then cosine down to min_lr_ratio."""
    if config.warmup_steps and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
