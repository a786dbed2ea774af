"""A word-level tokenizer built from the training text, so embedding tables are large and sparse.

Byte tokens touch almost every row of a 258-row table each step; words spread over tens
of thousands of rows, of which one step reads only a few percent. That sparsity is what
EmbRace-style sharded embeddings exploit, so the sparse-embedding work needs this
vocabulary to have something to measure.

Words are runs of letters/digits/underscores, single punctuation characters, and a
newline token (code layout carries meaning). The vocabulary is the `vocab_size - 4`
most frequent words of the TRAINING split only (ties broken alphabetically, so it is a
pure function of the text), after four special tokens; everything else is <unk>.
`vocab_size` is the id space (the embedding table's rows) as configured: a text with
fewer distinct words leaves the top ids unused (`words_in_use` says how many are real);
the embedded stdlib corpus has about 26.9k distinct words, so the default 32768-row
table has about 18% rows that are never read, as a real vocabulary's rare tail nearly is.
"""

from __future__ import annotations

import re
from collections import Counter

import torch

from ..errors import DataError

WORD_PATTERN = re.compile(r"\w+|\n|[^\w\s]")
SPECIALS = ("<unk>", "<pad>", "<mask>", "<eos>")
MIN_VOCAB = len(SPECIALS) + 1


def split_words(text: str) -> list[str]:
    return WORD_PATTERN.findall(text)


class WordTokenizer:
    """Ids 0..3 are <unk>, <pad>, <mask>, <eos>; then words by descending training frequency."""

    name = "word"
    unk_id, pad_id, mask_id, eos_id = 0, 1, 2, 3

    def __init__(self, words: list[str], vocab_size: int | None = None):
        self.words = [*SPECIALS, *words]
        self.ids = {w: i for i, w in enumerate(self.words)}
        self.words_in_use = len(self.words)
        self.vocab_size = max(vocab_size or 0, self.words_in_use)

    @classmethod
    def train(cls, text: bytes | str, vocab_size: int) -> WordTokenizer:
        """The most frequent words of `text` (ties alphabetical): deterministic for a given text."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
            raise DataError(f"word tokenizer: vocab_size must be an integer >= {MIN_VOCAB} "
                            f"({len(SPECIALS)} special tokens + at least one word), got {vocab_size!r}")
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        counts = Counter(split_words(text))
        if not counts:
            raise DataError("word tokenizer: the training text holds no words")
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        return cls([w for w, _ in ranked[:vocab_size - len(SPECIALS)]], vocab_size)

    def encode(self, data: bytes | str) -> torch.Tensor:
        if isinstance(data, bytes):
            data = data.decode("utf-8", errors="replace")
        lookup, unk = self.ids.get, self.unk_id
        return torch.tensor([lookup(w, unk) for w in split_words(data)], dtype=torch.int32)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        out = []
        for v in values:
            word = self.words[v] if 0 <= v < self.words_in_use else "<unk>"
            out.append(word if word == "\n" or not out or out[-1] == "\n" else " " + word)
        return "".join(out)
