"""A small reference GPT in plain PyTorch.

This is the model autopar's own tests and benchmarks train. It is deliberately written
like an ordinary user model (nanoGPT style) with no parallelism code in it, because
autopar's job is to parallelise models it did not write. Two choices make it friendly
to that without knowing about it:

* attention infers the number of heads from the projection width (`view(b, t, -1, d)`),
  so sharding the q/k/v projections column-wise leaves a module that still works;
* the output head is an `nn.Linear` whose weight *is* the token-embedding Parameter,
  so the tie is visible to anything that walks `named_parameters(remove_duplicate=False)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import ModelError


@dataclass
class GPTConfig:
    """Shape and regularisation of a GPT; every field is a plain value (TOML-friendly)."""

    vocab_size: int = 256
    """Number of token ids the embedding and the output head cover."""
    max_seq_len: int = 256
    """Longest sequence accepted; the size of the learned position embedding."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide d_model."""
    d_model: int = 64
    """Width of the residual stream."""
    d_ff: int = 0
    """Hidden width of the MLP; 0 means 4 * d_model (resolved on construction)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention and residual branches (0 keeps runs deterministic)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers have a bias."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if value <= 0:
                raise ModelError(f"gpt: {name} must be a positive integer, got {value}")
        if self.d_ff < 0:
            raise ModelError(f"gpt: d_ff must be >= 0 (0 means 4 * d_model), got {self.d_ff}")
        if self.d_model % self.n_head:
            raise ModelError(
                f"gpt: d_model {self.d_model} is not divisible by n_head {self.n_head}; "
                f"pick n_head from the divisors of {self.d_model}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ModelError(f"gpt: dropout must be in [0, 1), got {self.dropout}")
        if self.norm_eps <= 0:
            raise ModelError(f"gpt: norm_eps must be > 0, got {self.norm_eps}")
        if self.d_ff == 0:
            self.d_ff = 4 * self.d_model

    @classmethod
    def field_names(cls) -> list[str]:
        """All argument names, for error messages and argument checking."""
        return [f.name for f in fields(cls)]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v projections."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_head
        self.q_proj = nn.Linear(d, d, bias=cfg.bias)
        self.k_proj = nn.Linear(d, d, bias=cfg.bias)
        self.v_proj = nn.Linear(d, d, bias=cfg.bias)
        self.out_proj = nn.Linear(d, d, bias=cfg.bias)
        self.attn_dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # [b, t, heads * head_dim] -> [b, heads, t, head_dim]; heads inferred from the width.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear -> GELU -> Linear."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only language model; `model(input_ids)` returns logits [batch, seq, vocab]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Weight tying: one Parameter reachable as tok_emb.weight and lm_head.weight.
        self.lm_head.weight = self.tok_emb.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation; residual output projections get std / sqrt(2 * n_layer).

        Called on construction and again by `materialize` after a meta-device build; on
        meta tensors it does nothing (and costs nothing).
        """
        init_gpt_weights(self, self.blocks, skip=self.lm_head)  # lm_head's weight is tok_emb.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ModelError(
                f"gpt expects input_ids of shape [batch, seq], got shape {tuple(input_ids.shape)}"
            )
        t = input_ids.shape[1]
        if t > self.config.max_seq_len:
            raise ModelError(
                f"sequence length {t} is longer than the model's max_seq_len "
                f"{self.config.max_seq_len}; use sequences of at most {self.config.max_seq_len} "
                f"tokens or build the model with max_seq_len={t}"
            )
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@torch.no_grad()
def init_gpt_weights(root: nn.Module, blocks: nn.ModuleList, skip: nn.Module | None = None) -> None:
    """GPT-2 initialisation of every module under `root` (normal 0.02; the blocks' residual output
    projections get std / sqrt(2 * layers); norms 1 and 0), `skip` aside (a tied alias)."""
    std = 0.02
    resid_std = std / math.sqrt(2 * len(blocks))
    residual = {id(m) for b in blocks for m in (b.attn.out_proj, b.mlp.fc_out)}
    for module in root.modules():
        if module is skip:
            continue
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, resid_std if id(module) in residual else std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
