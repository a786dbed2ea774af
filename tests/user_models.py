"""Ordinary user modules, written as people write them (no autopar in sight), and the rank-pool
functions that train them (module level, so spawned ranks can import them)."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import autopar

VOCAB, SEQ, WIDTH = 64, 8, 16


class MlpBlock(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(F.gelu(self.fc_in(self.norm(x))))


class SequentialLM(nn.Module):
    """A token model whose blocks sit in an nn.Sequential (as in the README's example)."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[MlpBlock(width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(input_ids))))


class BareViT(nn.Module):
    """A ViT-shaped classifier: patch projection, bare cls token and position embedding, a Sequential of
    blocks; no init method (its bare parameters are set in __init__ only, which meta loses)."""

    def __init__(self, image: int = 8, patch: int = 4, channels: int = 3, width: int = WIDTH, depth: int = 2,
                 classes: int = 5):
        super().__init__()
        self.patch = nn.Conv2d(channels, width, kernel_size=patch, stride=patch)
        patches = (image // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.zeros(1, patches + 1, width))
        self.blocks = nn.Sequential(*[MlpBlock(width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class TinyViT(BareViT):
    """The same ViT with an init method, as timm's have."""

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d, nn.LayerNorm)):
                module.reset_parameters()


class PartlyInitViT(BareViT):
    """An init method that forgets the bare parameters (a common slip): the check after init must catch it."""

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)


class NoStackMlp(nn.Module):
    """Two linears and no container of blocks: tensor parallelism needs none."""

    def __init__(self, features: int = 8, hidden: int = 32):
        super().__init__()
        self.fc_in = nn.Linear(features, hidden)
        self.fc_out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x))).squeeze(-1)


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))))


class TinyUNet(nn.Module):
    """A U-Net with long skip connections (encoder features concatenated into the decoder)."""

    def __init__(self, channels: int = 2, width: int = 4):
        super().__init__()
        self.down = nn.ModuleList([ConvBlock(channels, width), ConvBlock(width, 2 * width)])
        self.middle = ConvBlock(2 * width, 2 * width)
        self.up = nn.ModuleList([ConvBlock(4 * width, width), ConvBlock(2 * width, width)])
        self.out = nn.Conv2d(width, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.avg_pool2d(x, 2)
        x = self.middle(x)
        for block in self.up:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            x = block(torch.cat([x, skips.pop()], dim=1))
        return self.out(x)


class LogOfNegative(nn.Module):
    """Produces NaN from the first forward: the log of a negative number."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(-self.fc(x).abs() - 1.0).squeeze(-1)


def token_data(samples: int = 32, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=gen)
    return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]


def image_data(samples: int = 16, channels: int = 3, size: int = 8, classes: int = 5, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, channels, size, size, generator=gen),
                         torch.randint(0, classes, (samples,), generator=gen))


def denoise_data(samples: int = 16, channels: int = 2, size: int = 8, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    clean = torch.randn(samples, channels, size, size, generator=gen)
    return TensorDataset(clean + 0.1 * torch.randn(clean.shape, generator=gen), clean)


def mse(output: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.mse_loss(output, batch["labels"])


def cross_entropy(output: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(output, batch["labels"])


def build(kind: str) -> tuple[nn.Module, object, object]:
    """(model, train data, loss_fn) of one case; meta-built where people would, real where they would not."""
    if kind == "sequential-lm":
        with torch.device("meta"):
            model = SequentialLM()
        return model, token_data(), None
    if kind in ("vit", "vit-no-init", "vit-part-init"):
        with torch.device("meta"):
            model = {"vit": TinyViT, "vit-no-init": BareViT, "vit-part-init": PartlyInitViT}[kind]()
        return model, image_data(), cross_entropy
    if kind == "root-sequential":  # the model is itself the stack (a plain MLP)
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1),
                                  nn.Flatten(0))
        gen = torch.Generator().manual_seed(0)
        return model, TensorDataset(torch.randn(16, 8, generator=gen), torch.randn(16, generator=gen)), mse
    if kind == "no-stack":
        with torch.device("meta"):
            model = NoStackMlp()
        gen = torch.Generator().manual_seed(0)
        return model, TensorDataset(torch.randn(16, 8, generator=gen), torch.randn(16, generator=gen)), mse
    if kind in ("vit-real", "unet"):
        # built for real, and differently on every rank (as unseeded builds are): rank 0's weights must be used
        torch.manual_seed(7 + torch.distributed.get_rank())
        return (TinyViT(), image_data(), cross_entropy) if kind == "vit-real" else (TinyUNet(), denoise_data(), mse)
    if kind == "nan":
        with torch.device("meta"):
            model = LogOfNegative()
        return model, TensorDataset(torch.randn(16, 4), torch.randn(16)), mse
    raise ValueError(kind)


def train_user_model(kind: str, out: str, *, strategy: dict | None = None, steps: int = 3,
                     global_batch_size: int = 8, micro_batch_size: int = 4, lr: float = 1e-2) -> dict:
    """Train one case with the Trainer API; returns losses, eval loss and the whole parameters."""
    from helpers import trained_and_closed
    model, data, loss_fn = build(kind)
    config = autopar.TrainConfig(steps=steps, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                                 lr=lr, warmup_steps=0, eval_batches=1, out=out, progress=False, timeout_s=60)
    trainer = autopar.Trainer(model, data, strategy=autopar.Strategy(**(strategy or {})), config=config,
                              eval_data=data, loss_fn=loss_fn)
    return trained_and_closed(trainer)


def error_of(fn, *args, **kwargs) -> str:
    """The message of the error `fn` raises on this rank ("" when it returns)."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # the test checks the text
        return f"{type(exc).__name__}: {exc}"
    return ""
