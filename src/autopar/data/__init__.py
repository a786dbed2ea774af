"""Data: embedded corpora, tokenizers, fixed-length samples and deterministic sampling."""

from .corpus import Corpus, load_corpus
from .datasets import IGNORE_INDEX, CausalLMWindows, MaskedLMWindows, build_datasets
from .sampler import GlobalBatchSampler
from .tokenizer import ByteTokenizer, Tokenizer, build_tokenizer, padded_vocab_size
from .word_tokenizer import WordTokenizer

__all__ = ["Corpus", "load_corpus", "IGNORE_INDEX", "CausalLMWindows", "MaskedLMWindows", "build_datasets",
           "GlobalBatchSampler", "ByteTokenizer", "WordTokenizer", "Tokenizer", "build_tokenizer", "padded_vocab_size"]
