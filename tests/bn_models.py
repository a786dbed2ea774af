"""Models with BatchNorm as users write them, and the function the rank pool runs to train them.

Module level, so spawned ranks can import it (tests/test_batchnorm.py runs it).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import autopar

CLASSES, FEATURES, SIDE = 4, 12, 6
STEPS, GLOBAL_BATCH, MICRO = 2, 8, 2


class ConvBlock(nn.Module):
    """A residual block: 3x3 convolution, batch norm, ReLU."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    """A stem, an nn.Sequential of residual blocks (what a pipeline cuts between), a pooled linear head."""

    def __init__(self, width: int = 8, blocks: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width, momentum=0.3), nn.ReLU())
        self.blocks = nn.Sequential(*[ConvBlock(width) for _ in range(blocks)])
        self.head = nn.Linear(width, CLASSES)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(inputs)).mean(dim=(2, 3)))


class BatchNormMLP(nn.Module):
    """Linear -> BatchNorm1d -> ReLU layers in a ModuleList; the first norm keeps a cumulative average."""

    def __init__(self, width: int = 32, layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width, momentum=None if i == 0 else 0.2), nn.ReLU())
            for i in range(layers))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.inp(inputs)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class InstanceNormNet(nn.Module):
    """An instance norm that keeps running statistics: refused where the layout would change them."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.norm = nn.InstanceNorm2d(width, affine=True, track_running_stats=True)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(inputs)).mean(dim=(2, 3)))


def _on_meta(cls: type) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.device("meta"):
            return cls()
    return build


def _for_real(cls: type) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)  # the same weights in every process
        return cls()
    return build


def images(count: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"inputs": torch.randn(3, SIDE, SIDE, generator=gen) * 2 + 1,
             "labels": torch.randint(0, CLASSES, (), generator=gen)} for _ in range(count)]


def features(count: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"inputs": torch.randn(FEATURES, generator=gen) * 3 - 1,
             "labels": torch.randint(0, CLASSES, (), generator=gen)} for _ in range(count)]


class SharedNormBlock(nn.Module):
    """Two convolutions normalised by one BatchNorm: the module runs twice in each forward."""

    def __init__(self, width: int = 8, inputs: int = 8):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(inputs, width, 3, padding=1), nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv2(F.relu(self.norm(self.conv1(x))))))


class SharedNormNet(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.blocks = nn.Sequential(SharedNormBlock(width, inputs=3), SharedNormBlock(width))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(inputs).mean(dim=(2, 3)))


MODELS = {
    "cnn-meta": (_on_meta(SmallCNN), images),
    "cnn-real": (_for_real(SmallCNN), images),
    "mlp-meta": (_on_meta(BatchNormMLP), features),
    "instance-norm": (_for_real(InstanceNormNet), images),
    "shared-norm": (_for_real(SharedNormNet), images),
}


def class_loss(output: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(output, batch["labels"])


def running_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every running statistic this rank holds (under pp: its stage's), by the model's names."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def train_bn(name: str, out: str, strategy: dict | None = None, micro_batch_size: int = MICRO,
             optimizer: str = "sgd", **strategy_fields) -> dict:
    """Train model `name` for STEPS steps; its losses, eval loss and this rank's running statistics."""
    build, data = MODELS[name]
    # SGD: a bias just before a norm has a gradient that is zero up to rounding, which Adam would turn into
    # a step of lr either way (a difference between layouts that is Adam's, not the statistics')
    config = autopar.TrainConfig(steps=STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch_size,
                                 optimizer=optimizer, lr=0.1, warmup_steps=0, eval_batches=1, out=out, progress=False, timeout_s=60)
    trainer = autopar.Trainer(build(), data(STEPS * GLOBAL_BATCH, seed=1), eval_data=data(GLOBAL_BATCH, seed=2),
                              strategy=autopar.Strategy(**(strategy or {}), **strategy_fields), config=config,
                              loss_fn=class_loss)
    try:
        result = trainer.train()
        return {"losses": result.losses, "eval_loss": result.eval_loss, "buffers": running_buffers(trainer.model)}
    finally:
        trainer.close()


def train_many(cases: list[tuple]) -> list[dict]:
    """Several (model, out, strategy[, micro-batch size[, optimizer]]) trainings in one pool task."""
    return [train_bn(name, out, strategy, *rest) for name, out, strategy, *rest in cases]


def refusal(name: str, out: str, strategy: dict | None = None, **strategy_fields) -> dict:
    """Train a case that must be refused: the error (type and message)."""
    try:
        train_bn(name, out, strategy, **strategy_fields)
    except Exception as exc:  # the test judges the type
        return {"error": type(exc).__name__, "autopar_error": isinstance(exc, autopar.AutoparError),
                "message": str(exc)}
    return {"error": None}
