"""Small and oddly shaped user models (a plain nn.Sequential of two Linears, an activation or a
log_softmax between or after them, a block whose only state is a buffer), and the rank-pool
function that trains several of them in one task (module level, so spawned ranks can import it)."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import autopar

FEATURES, HIDDEN, CLASSES = 16, 32, 4


class Scale(nn.Module):
    """A fixed per-feature scale held as a buffer: a block whose only state is not trained."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("scale", torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:  # (sets the buffer of a model built on meta too)
        with torch.no_grad():
            self.scale.copy_(torch.linspace(0.5, 1.5, self.scale.numel()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))


def build(kind: str) -> nn.Module:
    """The model of one case: meta-built unless its name ends in -real (built for real, as a first script does)."""
    if kind == "mlp-real":
        torch.manual_seed(7 + torch.distributed.get_rank())  # differently on every rank: rank 0's weights win
        return mlp()
    with torch.device("meta"):
        if kind in ("mlp", "mlp-init-fn"):
            return mlp()
        if kind == "log-softmax":  # the loss-side op is the model's last module
            return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES),
                                 nn.LogSoftmax(dim=-1))
        if kind == "activation-first":  # a parameter-free module before the first Linear
            return nn.Sequential(nn.Tanh(), nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))
        if kind == "buffer":  # a block whose only state is a buffer, between the Linears
            return nn.Sequential(nn.Linear(FEATURES, HIDDEN), Scale(HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))
    raise ValueError(kind)


def small_init(model: nn.Module) -> None:
    """A user's init function: every weight from N(0, 0.1), every bias zero."""
    for name, p in model.named_parameters():
        nn.init.normal_(p, std=0.1) if name.endswith("weight") else nn.init.zeros_(p)


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(16, FEATURES, generator=gen), torch.randint(0, CLASSES, (16,), generator=gen))


def cross_entropy(output: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(output, batch["labels"])


def nll(output: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.nll_loss(output, batch["labels"])


def train_small_model(kind: str, out: str, strategy: dict) -> dict:
    """Train one case for 2 steps; its losses, eval loss and whole parameters (tp slices gathered)."""
    from helpers import trained_and_closed
    config = autopar.TrainConfig(steps=2, global_batch_size=8, micro_batch_size=4, lr=1e-2, warmup_steps=0,
                                 eval_batches=1, out=out, progress=False, timeout_s=60, checkpoint_every=0)
    trainer = autopar.Trainer(build(kind), data(), strategy=autopar.Strategy(**strategy), config=config,
                              eval_data=data(), loss_fn=nll if kind == "log-softmax" else cross_entropy,
                              init_fn=small_init if kind == "mlp-init-fn" else None)
    return trained_and_closed(trainer)


def train_small_models(cases: list[tuple[str, dict]], out: str) -> list[dict | str]:
    """Every (kind, strategy) case in turn, in one rank-pool task; a case that fails gives its error's text."""
    from user_models import error_of
    results = []
    for i, (kind, strategy) in enumerate(cases):
        message = error_of(lambda: results.append(train_small_model(kind, f"{out}/{i}", strategy)))
        if message:
            results.append(message)
    return results
