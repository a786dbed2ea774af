"""Tokenizers from the `tokenizers` library: a pretrained tokenizer.json, or a byte-level BPE trained here.

`--tokenizer hf:PATH` reads a tokenizer.json (or a folder holding one, as `save_pretrained` writes it);
`--tokenizer bpe --vocab-size N` trains a byte-level BPE on the training text. Either is saved into the
run folder as tokenizer.json, so a resumed run and an exported model use the very same one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..errors import DataError

SPECIAL_TOKENS = ("<pad>", "<eos>", "<mask>")
"""Specials of a BPE trained here, ids 0, 1, 2."""

_CHUNK = 1 << 16  # characters per piece of text handed to encode_batch (encoded in parallel)


def _tokenizers():
    try:
        import tokenizers
    except ImportError as exc:
        raise DataError("this tokenizer needs the tokenizers package: pip install tokenizers") from exc
    return tokenizers


def _first_present(vocab: dict[str, int], names: tuple[str, ...]) -> int | None:
    return next((vocab[n] for n in names if n in vocab), None)


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the shape autopar's tokenizers have (data/tokenizer.py)."""

    def __init__(self, tokenizer, name: str):
        self.tokenizer, self.name = tokenizer, name
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = _first_present(vocab, ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "[SEP]"))
        pad = _first_present(vocab, ("<pad>", "[PAD]", "<|pad|>"))
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        mask = _first_present(vocab, ("<mask>", "[MASK]"))
        self.mask_id = mask if mask is not None else self.pad_id

    @classmethod
    def from_path(cls, path: str | Path) -> HFTokenizer:
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"--tokenizer hf:{path}: no tokenizer.json there; pass a tokenizer.json file or a folder "
                            f"holding one (as save_pretrained writes it)")
        try:
            tokenizer = _tokenizers().Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises plain Exceptions
            raise DataError(f"--tokenizer hf:{path}: {file} is not a tokenizers JSON file ({exc})") from None
        return cls(tokenizer, f"hf:{path}")

    @classmethod
    def train_bpe(cls, text: str, vocab_size: int) -> HFTokenizer:
        """A byte-level BPE learned from `text` (deterministic for the same text and size)."""
        tk = _tokenizers()
        minimum = 256 + len(SPECIAL_TOKENS)
        if vocab_size < minimum:
            raise DataError(f"--tokenizer bpe: --vocab-size {vocab_size} is too small; a byte-level BPE needs at "
                            f"least {minimum} (256 bytes and {len(SPECIAL_TOKENS)} special tokens)")
        tokenizer = tk.Tokenizer(tk.models.BPE())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tokenizer.train_from_iterator(_chunks(text), trainer=trainer)
        return cls(tokenizer, f"bpe-{vocab_size}")

    def encode(self, data: bytes | str) -> torch.Tensor:
        text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
        ids: list[int] = []
        for encoding in self.tokenizer.encode_batch(list(_chunks(text)), add_special_tokens=False):
            ids.extend(encoding.ids)
        return torch.tensor(ids, dtype=torch.int32)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel (no special tokens added)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.tokenizer.decode(values)

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def _chunks(text: str) -> list[str]:
    """`text` cut at line ends into pieces of about _CHUNK characters (concatenated they are `text`)."""
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    return pieces
