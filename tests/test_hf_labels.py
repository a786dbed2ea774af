"""Hugging Face labels: autopar's loss is the model's own `model(**batch).loss`, under every layout.

Hugging Face's collators give a causal LM labels equal to the input ids (-100 on pads) and the
model's loss scores position i against labels[i + 1]; a masked LM and T5 score position i against
labels[i]. autopar follows the model's convention (train/loss.py): the first training loss of one
process (two micro-batches of 4, normalised by the global target count) equals the model's loss on
the whole batch, and dp2, pp2 and tp2 train to one process's losses. The built-in data of
`autopar train --model hf:llama` is already shifted and keeps the loss it always had.
Cases: tests/hf_label_cases.py (tiny llama and gpt2, bert, t5, built for real, dropout off).
"""

from __future__ import annotations

import pytest

import hf_label_cases as cases

LOSS_RTOL = 1e-5
CAUSAL = ["llama", "gpt2"]


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_first_loss_is_the_models_own_loss(rank_pool, tmp_path):
    got = rank_pool(1).run(cases.first_losses, list(cases.FAMILIES), str(tmp_path), timeout=300)[0]
    for family, (ours, theirs) in got.items():
        assert relative(ours, theirs) < LOSS_RTOL, (family, ours, theirs)


_reference: dict = {}


@pytest.mark.parametrize("layout", [{"dp": 2}, {"pp": 2}, {"tp": 2}], ids=["dp2", "pp2", "tp2"])
def test_layouts_match_one_process(rank_pool, tmp_path, tmp_path_factory, layout):
    if not _reference:
        _reference.update(rank_pool(1).run(cases.train_many, CAUSAL, str(tmp_path_factory.mktemp("one")),
                                           timeout=300)[0])
    micro = 2 if "dp" in layout else 4  # two micro-batches per replica either way
    results = rank_pool(2).run(cases.train_many, CAUSAL, str(tmp_path), strategy=layout, micro_batch_size=micro,
                               timeout=300)
    for rank, got in enumerate(results):
        for family in CAUSAL:
            want, have = _reference[family], got[family]
            assert len(want) == len(have) == 2, (family, want, have)
            assert all(relative(h, w) < LOSS_RTOL for h, w in zip(have, want)), (rank, family, want, have)


def test_builtin_windows_keep_their_loss(rank_pool, tmp_path):
    """The CLI's hf:llama on built-in windows: labels are shifted already, so autopar does not shift again and
    the loss is the one it always computed (each position against its own label)."""
    got = rank_pool(1).run(cases.builtin_job_losses, str(tmp_path), timeout=300)[0]
    assert got["pre_shifted"] and not got["shift"], got
    assert relative(got["loss"], got["unshifted"]) < LOSS_RTOL, got


def test_label_convention_follows_the_model_class():
    import torch
    from autopar.errors import ConfigError
    from autopar.train.loss import label_shift, next_token_targets

    with torch.device("meta"):
        models = {f: cases.build(f) for f in cases.FAMILIES}
    assert {f: label_shift(m, "model") for f, m in models.items()} == \
        {"llama": True, "gpt2": True, "bert": False, "t5": False}
    assert not any(label_shift(m, "aligned") for m in models.values())
    assert not label_shift(torch.nn.Linear(2, 2), "model")  # not Hugging Face: labels are token-aligned
    assert label_shift(torch.nn.Linear(2, 2), "causal") and label_shift(models["bert"], "causal")
    with pytest.raises(ConfigError, match="label_convention"):
        label_shift(models["llama"], "shifted")
    assert next_token_targets(torch.tensor([[-100, 5, 6, 7]])).tolist() == [[5, 6, 7, -100]]
