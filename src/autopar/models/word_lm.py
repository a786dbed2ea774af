"""Word-level language models with UNTIED input embeddings: where embedding sparsity matters.

With a word vocabulary (data/word_tokenizer.py) the input table is large and each step
reads a few percent of its rows, so its gradient is sparse; the output projection is a
separate dense weight. (Tying them would give the table a dense gradient through the
softmax, and sparse-embedding communication would have nothing to win; see
sparse/classify.py.) Both models are plain PyTorch with no parallelism code.

- `word-lstm`: embedding -> LSTM -> linear, the classic word LM (Zaremba et al. shape);
- `word-gpt`: embedding + learned positions -> pre-norm transformer blocks (the
  reference GPT's blocks) -> linear.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import nn

from autopar.errors import ModelError

from .gpt import Block, GPTConfig, init_gpt_weights


@dataclass
class WordLSTMConfig:
    vocab_size: int = 32768
    """Rows of the input embedding and outputs of the head (the tokenizer's vocabulary)."""
    d_embed: int = 64
    """Width of the input embedding (the sparse table's row)."""
    d_hidden: int = 128
    """LSTM hidden width."""
    n_layer: int = 1
    """Stacked LSTM layers."""
    max_seq_len: int = 1024
    """Longest sequence accepted (an LSTM has no position table; this only bounds the data)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ModelError(f"word-lstm: {f.name} must be a positive integer, got {getattr(self, f.name)}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class WordLSTM(nn.Module):
    """`model(input_ids)` -> logits [batch, seq, vocab]; input table and output head untied."""

    def __init__(self, config: WordLSTMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_embed)
        self.lstm = nn.LSTM(config.d_embed, config.d_hidden, num_layers=config.n_layer, batch_first=True)
        self.head = nn.Linear(config.d_hidden, config.vocab_size)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Called on construction and by `materialize` after a meta build (no-op on meta)."""
        nn.init.normal_(self.embed.weight, 0.0, 0.1)
        bound = 1.0 / math.sqrt(self.config.d_hidden)
        for p in self.lstm.parameters():
            nn.init.uniform_(p, -bound, bound)
        nn.init.normal_(self.head.weight, 0.0, 0.02)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ModelError(f"word-lstm expects input_ids of shape [batch, seq], got {tuple(input_ids.shape)}")
        hidden, _ = self.lstm(self.embed(input_ids))
        return self.head(hidden)


class WordGPT(nn.Module):
    """A GPT whose token embedding is NOT tied to the output head (the reference GPT's is)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        init_gpt_weights(self, self.blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ModelError(f"word-gpt expects input_ids of shape [batch, seq], got {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.config.max_seq_len:
            raise ModelError(f"sequence length {t} is longer than word-gpt's max_seq_len {self.config.max_seq_len}; "
                             f"use --model-arg max_seq_len={t} or shorter sequences")
        x = self.tok_emb(input_ids) + self.pos_emb(torch.arange(t, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
