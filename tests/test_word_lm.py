"""The word-level tokenizer and the word LMs with untied input embeddings."""

from __future__ import annotations

import pytest
import torch

from autopar.data import Corpus, WordTokenizer, build_tokenizer
from autopar.errors import DataError
from autopar.models import build_model, materialize
from autopar.models.materialize import tied_groups
from autopar.sparse.classify import classify_tables

TEXT = b"def f(x):\n    return x + 1\n\ndef g(y):\n    return f(y) * 2\n"


def corpus(train: bytes, held_out: bytes = b"") -> Corpus:
    return Corpus(name="test", train=train, eval=held_out, num_files=1, fingerprint="0")


def test_vocabulary_is_deterministic_frequency_ordered_and_from_the_training_split():
    a = build_tokenizer("word", corpus=corpus(TEXT, b"unseen_word only_in_eval"), vocab_size=64)
    b = WordTokenizer.train(TEXT, 64)
    assert a.words == b.words
    assert a.words[:4] == ["<unk>", "<pad>", "<mask>", "<eos>"]
    assert a.words[4] == "\n"  # most frequent first: 5 newlines
    distinct = {"def", "f", "(", "x", ")", ":", "\n", "return", "+", "1", "g", "y", "*", "2"}
    assert a.vocab_size == 64 and a.words_in_use == 4 + len(distinct)  # ids past the words are never produced
    ids = a.encode("return unseen_word")
    assert ids.tolist() == [a.ids["return"], a.unk_id]
    assert a.decode(a.encode("def f ( x ) :")) == "def f ( x ) :"


def test_vocab_size_caps_the_words_and_rare_ones_become_unk():
    tok = WordTokenizer.train(TEXT, 6)
    assert tok.words_in_use == 6 and tok.vocab_size == 6
    encoded = tok.encode(TEXT)
    assert int((encoded == tok.unk_id).sum()) > 0 and int(encoded.max()) < 6


def test_word_tokenizer_errors():
    with pytest.raises(DataError, match="vocab_size must be an integer >= 5"):
        WordTokenizer.train(TEXT, 3)
    with pytest.raises(DataError, match="pass corpus="):
        build_tokenizer("word")
    with pytest.raises(DataError, match="unknown tokenizer"):
        build_tokenizer("sentencepiece")
    with pytest.raises(DataError, match="pass text= or corpus="):
        build_tokenizer("bpe")


@pytest.mark.parametrize("name,table,head", [("word-lstm", "embed", "head"), ("word-gpt", "tok_emb", "head")])
def test_word_models_have_untied_input_embeddings(name, table, head):
    model, info = build_model(name, vocab_size=500, device="meta")
    model = materialize(model, torch.device("cpu"), seed=0)
    assert info.vocab_size == 500 and getattr(model, table).weight.shape[0] == 500
    assert getattr(model, table).weight is not getattr(model, head).weight
    assert tied_groups(model) == ([], [])
    assert model(torch.randint(0, 500, (2, 7))).shape == (2, 7, 500)


def test_classification_by_measured_density_and_tied_tables_stay_dense():
    model = materialize(build_model("word-gpt", vocab_size=2000, device="meta")[0], torch.device("cpu"), seed=0)
    ids = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    tables = {t.param_name: t for t in classify_tables(model, lambda: model(ids), threshold=0.1, group=None)}
    assert tables["tok_emb.weight"].sparse and tables["tok_emb.weight"].rows_touched == len(set(ids.view(-1).tolist()))
    assert tables["pos_emb.weight"].rows_touched == 16  # 16 of 256 positions: measured, so sparse at 0.1 ...
    assert tables["pos_emb.weight"].sparse
    dense = {t.param_name: t for t in classify_tables(model, lambda: model(ids), threshold=0.05, group=None)}
    assert not dense["pos_emb.weight"].sparse and dense["tok_emb.weight"].sparse  # ... and dense at 0.05
    gpt = materialize(build_model("gpt-tiny", vocab_size=2000, device="meta")[0], torch.device("cpu"), seed=0)
    tied = {t.param_name: t for t in classify_tables(gpt, lambda: gpt(ids), threshold=0.5, group=None)}
    assert not tied["tok_emb.weight"].sparse and "tied to lm_head.weight" in tied["tok_emb.weight"].reason
