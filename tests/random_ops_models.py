"""Models of tests/test_random_ops.py: random operations reached the ways users reach them.

- an nn.TransformerEncoder language model (batch_first, torch's default dropout 0.1 on the
  attention weights inside nn.MultiheadAttention and on both residual branches), built for
  real and on meta;
- a model whose own attention calls F.scaled_dot_product_attention(dropout_p=0.1), its
  blocks alternating with self-normalising ones (nn.AlphaDropout, F.feature_alpha_dropout,
  nn.RReLU);
- a model that adds torch.randn noise in training (noise injection), which autopar refuses.

Module level (no test code) so the rank pool's spawned workers can import it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from zoo_models import SEQ, VOCAB, plain_lm

WIDTH, HEADS = 32, 4


class EncoderLM(nn.Module):
    """Embedding, a causal nn.TransformerEncoder of torch's own layers (default dropout), a head."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=2 * WIDTH, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=input_ids.device)
        return self.head(self.encoder(self.embed(input_ids), mask=causal, is_causal=True))


class SdpaBlock(nn.Module):
    """Pre-norm attention block calling F.scaled_dot_product_attention with dropout on its weights."""

    def __init__(self, attention_dropout: float = 0.1):
        super().__init__()
        self.attention_dropout = attention_dropout
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, HEADS, c // HEADS).transpose(1, 2) for y in self.qkv(self.norm1(x)).split(c, dim=2))
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attention_dropout if self.training else 0.0,
                                              is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class SeluBlock(nn.Module):
    """A self-normalising MLP block: SELU with alpha dropout, then a randomized leaky ReLU."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.act, self.drop, self.rrelu = nn.SELU(), nn.AlphaDropout(0.1), nn.RReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.up(x)))
        h = F.feature_alpha_dropout(h.unsqueeze(-1), 0.05, self.training).squeeze(-1)  # one draw per feature
        return x + self.rrelu(self.down(h))


class MixedRandomLM(nn.Module):
    """Attention blocks with dropout on their weights alternating with self-normalising blocks."""

    def __init__(self, pairs: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([block for _ in range(pairs) for block in (SdpaBlock(), SeluBlock())])
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class NoisyLM(MixedRandomLM):
    """Gaussian noise added to the embeddings in training (noise injection): drawn with torch.randn_like."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.training:
            x = x + 0.1 * torch.randn_like(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _on_meta(cls: type):
    def build() -> nn.Module:
        with torch.device("meta"):
            return cls()
    return build


def _for_real(cls: type):
    def build() -> nn.Module:
        torch.manual_seed(0)  # the same weights in every process
        return cls()
    return build


MODELS = {
    "encoder-real": _for_real(EncoderLM),
    "encoder-meta": _on_meta(EncoderLM),
    "sdpa-alpha-rrelu": _on_meta(MixedRandomLM),
}
REFUSED = {"noise-injection": _on_meta(NoisyLM)}

STEPS, GLOBAL_BATCH = 2, 8


def train(name: str, out: str, strategy: dict, micro_batch_size: int) -> dict:
    """Train model `name` for STEPS steps; its losses and this rank's parameters (tp slices gathered)."""
    from helpers import whole_parameters

    build = MODELS[name] if name in MODELS else REFUSED[name]
    config = autopar.TrainConfig(steps=STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch_size,
                                 lr=1e-3, warmup_steps=0, adam_eps=1e-6, out=out, progress=False, timeout_s=60)
    trainer = autopar.Trainer(build(), plain_lm(), strategy=autopar.Strategy(**strategy), config=config)
    try:
        result = trainer.train()
        return {"losses": result.losses, "params": whole_parameters(trainer)}
    finally:
        trainer.close()


def train_all(names: list[str], out: str, strategy: dict, micro_batch_size: int) -> dict:
    """Every model of `names` trained in turn (one pool task): name -> result, or the error it raised."""
    results = {}
    for name in names:
        folder = Path(out) / name
        try:
            results[name] = train(name, str(folder), strategy, micro_batch_size)
        except Exception as exc:  # the test judges the type and the message
            metrics = folder / "metrics.jsonl"
            results[name] = {"error": type(exc).__name__, "autopar_error": isinstance(exc, autopar.AutoparError),
                             "message": str(exc), "stepped": metrics.exists() and bool(metrics.read_text().strip())}
    return results
