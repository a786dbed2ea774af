"""Fixed-length training samples cut from a token stream.

A sample is a dict {"input_ids": LongTensor[seq], "labels": LongTensor[seq]}; labels of
-100 are ignored by the loss. Labels are token-aligned: labels[i] is the target of output
position i (the next token, for causal windows), for every model, Hugging Face causal LMs
included: each dataset says so with `label_convention = "aligned"`, which the Trainer reads.
Samples are a pure function of their index (masked-LM masking is seeded by the index), so
any data-parallel layout sees identical batches.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ..errors import DataError

IGNORE_INDEX = -100


class CausalLMWindows(Dataset):
    """Non-overlapping windows; labels are the inputs shifted by one token."""

    label_convention = "aligned"  # a window of seq_len + 1 tokens gives seq_len targets, none lost to a shift

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if tokens.numel() < seq_len + 1:
            raise DataError(f"the text has {tokens.numel()} tokens, fewer than one sample needs "
                            f"(seq_len + 1 = {seq_len + 1}); use a shorter --seq-len or more text")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1].long()
        return {"input_ids": window[:-1], "labels": window[1:]}


class MaskedLMWindows(Dataset):
    """BERT-style masking: 15% of positions are targets; of those 80% <mask>, 10% random, 10% kept."""

    label_convention = "aligned"

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, mask_id: int, random_vocab: int,
                 seed: int, mask_prob: float = 0.15):
        if tokens.numel() < seq_len:
            raise DataError(f"the text has {tokens.numel()} tokens, fewer than one sample needs "
                            f"({seq_len}); use a shorter --seq-len or more text")
        self.tokens, self.seq_len = tokens, seq_len
        self.mask_id, self.random_vocab, self.seed, self.mask_prob = mask_id, random_vocab, seed, mask_prob

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_len
        original = self.tokens[start:start + self.seq_len].long()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        chosen = torch.rand(self.seq_len, generator=gen) < self.mask_prob
        action = torch.rand(self.seq_len, generator=gen)
        random_ids = torch.randint(0, self.random_vocab, (self.seq_len,), generator=gen)
        inputs = original.clone()
        inputs[chosen & (action < 0.8)] = self.mask_id
        swap = chosen & (action >= 0.8) & (action < 0.9)
        inputs[swap] = random_ids[swap]
        labels = torch.where(chosen, original, torch.full_like(original, IGNORE_INDEX))
        return {"input_ids": inputs, "labels": labels}


def build_datasets(corpus, tokenizer, *, seq_len: int, task: str, seed: int) -> tuple[Dataset, Dataset]:
    """Train and eval datasets for a model task ('causal-lm' or 'masked-lm')."""
    train_tokens, eval_tokens = tokenizer.encode(corpus.train), tokenizer.encode(corpus.eval)
    if task == "causal-lm":
        return CausalLMWindows(train_tokens, seq_len), CausalLMWindows(eval_tokens, seq_len)
    if task == "masked-lm":
        make = lambda t, s: MaskedLMWindows(t, seq_len, mask_id=tokenizer.mask_id, random_vocab=256, seed=s)
        return make(train_tokens, seed), make(eval_tokens, seed + 1)
    raise DataError(f"no built-in data for model task {task!r}; use causal-lm or masked-lm")
