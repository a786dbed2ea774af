"""Tokenizers turn corpus bytes into token ids.

`byte` needs no training and has a small vocabulary, which suits CPU tests; `word`
(data/word_tokenizer.py) is trained on the corpus's training split and has a large,
sparsely used vocabulary (for the sparse-embedding work). A tokenizer is anything with
the `Tokenizer` shape; register new ones in `TOKENIZERS`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..errors import DataError, choices


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    mask_id: int  # used by masked-LM models
    pad_id: int

    def encode(self, data: bytes | str) -> torch.Tensor: ...

    def decode(self, ids: torch.Tensor | list[int]) -> str: ...


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is <mask>, 257 is <pad>."""

    name = "byte"
    mask_id = 256
    pad_id = 257
    vocab_size = 258

    def encode(self, data: bytes | str) -> torch.Tensor:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(v for v in values if 0 <= v < 256).decode("utf-8", errors="replace")


TOKENIZERS = ("byte", "word", "bpe", "hf:PATH")


def build_tokenizer(name: str, *, corpus=None, vocab_size: int = 32768, text: str | None = None) -> Tokenizer:
    """A tokenizer by name; trained ones (`word`, `bpe`) learn the training text (`text`, else the corpus's
    training split); `hf:PATH` reads a tokenizer.json (data/hf_tokenizer.py)."""
    if name == "byte":
        return ByteTokenizer()
    if isinstance(name, str) and name.startswith("hf:") and len(name) > 3:
        from .hf_tokenizer import HFTokenizer
        return HFTokenizer.from_path(name[3:])
    if name == "bpe":
        if text is None and corpus is None:
            raise DataError("the bpe tokenizer is trained on text; pass text= or corpus= (the training split)")
        from .hf_tokenizer import HFTokenizer
        train = text if text is not None else corpus.train.decode("utf-8", errors="replace")
        return HFTokenizer.train_bpe(train, vocab_size)
    if name == "word":
        if corpus is None:
            raise DataError("the word tokenizer is trained on a corpus; pass corpus= (the training split is used)")
        from .word_tokenizer import WordTokenizer
        return WordTokenizer.train(corpus.train, vocab_size)
    raise DataError(f"unknown tokenizer {name!r}; available: {choices(TOKENIZERS)}")


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """Round a vocabulary up so embedding tables split evenly (and run faster)."""
    return -(-vocab_size // multiple) * multiple
