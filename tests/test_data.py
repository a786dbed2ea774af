"""Data: the embedded corpus, tokenizer, samples and the layout-independent sampler."""

from __future__ import annotations

import pytest
import torch

from autopar.data import (IGNORE_INDEX, ByteTokenizer, CausalLMWindows, GlobalBatchSampler, MaskedLMWindows,
                          load_corpus, padded_vocab_size)
from autopar.errors import DataError


def test_stdlib_corpus_is_real_and_split():
    corpus = load_corpus("stdlib")
    assert len(corpus.train) > 1_000_000 and len(corpus.eval) > 10_000
    assert b"def " in corpus.train and corpus.eval not in corpus.train
    assert load_corpus("stdlib").fingerprint == corpus.fingerprint


def test_corpus_from_a_folder_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    corpus = load_corpus(str(tmp_path))
    assert corpus.num_files == 1 and corpus.train.startswith(b"hello") and corpus.eval
    with pytest.raises(DataError, match="unknown corpus 'nowhere'"):
        load_corpus("nowhere")


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids.max() < 256 and tok.decode(ids) == "héllo"
    assert padded_vocab_size(tok.vocab_size) == 320


def test_causal_windows_shift_by_one():
    ds = CausalLMWindows(torch.arange(100, dtype=torch.int32), seq_len=10)
    assert len(ds) == 9
    sample = ds[2]
    assert sample["input_ids"].tolist() == list(range(20, 30)) and sample["labels"].tolist() == list(range(21, 31))
    with pytest.raises(DataError, match="fewer than one sample needs"):
        CausalLMWindows(torch.arange(5), seq_len=10)


def test_masked_windows_are_deterministic_per_index():
    tokens = torch.randint(0, 256, (5000,), dtype=torch.int32)
    ds = MaskedLMWindows(tokens, 64, mask_id=256, random_vocab=256, seed=3)
    a, b = ds[7], ds[7]
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    targets = a["labels"] != IGNORE_INDEX
    assert 0 < targets.sum() < 64
    assert torch.equal(a["labels"][targets], tokens[7 * 64:8 * 64].long()[targets])
    assert (a["input_ids"] == 256).any()


@pytest.mark.parametrize("dp,micro", [(1, 8), (1, 2), (2, 4), (4, 1), (8, 1)])
def test_sampler_slices_the_same_global_batch(dp, micro):
    sampler = GlobalBatchSampler(50, 8, seed=1)
    for step in (0, 3, 6, 7):  # 50 samples: steps 6 and 7 cross into the next epoch
        pieces = [sampler.local_micro_batches(step, dp_rank=r, dp_size=dp, micro_batch_size=micro) for r in range(dp)]
        assert all(len(m) == micro for rank in pieces for m in rank)
        flat = [i for rank in pieces for m in rank for i in m]
        assert flat == sampler.global_batch(step)


def test_sampler_covers_each_epoch_once_and_reshuffles():
    sampler = GlobalBatchSampler(40, 8, seed=0)
    first = [i for s in range(5) for i in sampler.global_batch(s)]
    second = [i for s in range(5, 10) for i in sampler.global_batch(s)]
    assert sorted(first) == sorted(second) == list(range(40))
    assert first != second
