"""A GPT written the way nanoGPT-style code is (tests/test_meta_init.py): its constructor initialises it.

A LayerNorm with bare parameters (optional bias), attention through one fused `c_attn` cut by
`split`, the token embedding tied to the output head, and an `__init__` that runs
`self.apply(self._init_weights)` and then re-initialises every `c_proj.weight` by name with a
smaller std. Built on meta, no rule autopar knows reproduces that constructor; the tests give it
`autopar.replay_init` or an init function. Module level (no test code) for the rank pool's workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import autopar

VOCAB = 64
SEQ = 16
SAMPLES = 16
GLOBAL_BATCH = 8
SEED = 0


@dataclass
class GPTConfig:
    vocab_size: int = VOCAB
    block_size: int = SEQ
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    bias: bool = True


class LayerNorm(nn.Module):
    """LayerNorm whose bias can be switched off (bare parameters, no reset_parameters)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(config.n_embd, config.bias), CausalSelfAttention(config)
        self.ln_2, self.mlp = LayerNorm(config.n_embd, config.bias), MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def user_init(model: GPT) -> None:
    """An init function as a user writes one for GPT: the constructor's steps, LayerNorms included."""
    model.apply(model._init_weights)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * model.config.n_layer))
        elif name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            torch.nn.init.ones_(p)
        elif name.endswith(("ln_1.bias", "ln_2.bias", "ln_f.bias")):
            torch.nn.init.zeros_(p)


def on_meta() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig())


def for_real() -> GPT:
    torch.manual_seed(SEED)
    return GPT(GPTConfig())


def samples() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]


CASES = {  # name: (model, init_fn)
    "real": (for_real, lambda: None),
    "replay": (on_meta, lambda: autopar.replay_init(lambda: GPT(GPTConfig()))),
    "init_fn": (on_meta, lambda: user_init),
    "no_init": (on_meta, lambda: None),
}


def train(name: str, out: str, *, strategy: dict | None = None, micro_batch_size: int = 4) -> dict:
    """Case `name` trained 2 steps (on every rank of a pool): its losses, or the error that refused it."""
    build, init_fn = CASES[name]
    config = autopar.TrainConfig(steps=2, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch_size,
                                 lr=1e-3, warmup_steps=0, out=out, progress=False, timeout_s=60, seed=SEED)
    try:
        trainer = autopar.Trainer(build(), samples(), strategy=autopar.Strategy(**(strategy or {})), config=config,
                                  init_fn=init_fn())
        losses = trainer.train().losses
    except autopar.AutoparError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    trainer.close()
    return {"losses": losses}


def train_many(names: list[str], out: str, **kwargs) -> dict[str, dict]:
    return {name: train(name, f"{out}/{name}", **kwargs) for name in names}
