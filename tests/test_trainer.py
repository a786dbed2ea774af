"""Trainer API behaviours beyond equivalence: real models, bf16, API misuse."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import autopar
from autopar.errors import ConfigError, DataError
from helpers import max_param_difference, max_relative_difference, train_builtin


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(128, 6, generator=gen)
    return TensorDataset(x, x.sum(-1, keepdim=True).tanh())


def _train_real_model(out: str, model_seed: int | None) -> dict:
    """A model built for real, with a different init on each rank unless model_seed is given."""
    torch.manual_seed(model_seed if model_seed is not None else 1000 + dist.get_rank())
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    trainer = autopar.Trainer(model, _data(), config=autopar.TrainConfig(
        steps=8, global_batch_size=16, micro_batch_size=4, lr=1e-2, out=out, progress=False, timeout_s=60),
        loss_fn=lambda y, b: F.mse_loss(y, b["labels"]))
    result = trainer.train()
    return {"losses": result.losses, "params": {k: v.clone() for k, v in trainer.model.state_dict().items()}}


def test_a_real_model_starts_every_replica_from_replica_0(rank_pool, tmp_path):
    ranks = rank_pool(2).run(_train_real_model, str(tmp_path / "dp"), None)
    assert max_param_difference(ranks[0]["params"], ranks[1]["params"]) == 0.0  # bitwise: one all-reduced grad
    single = rank_pool(1).run(_train_real_model, str(tmp_path / "one"), 1000)[0]  # rank 0's init
    assert max_relative_difference(single["losses"], ranks[0]["losses"]) < 1e-5


def _train_twice_with_close(out: str) -> dict:
    """Two identical ZeRO-3 (FSDP2) runs in one process, each closed (train_builtin calls Trainer.close)."""
    from autopar.distributed import process_groups
    before = process_groups()
    first = train_builtin("gpt-tiny", out + "/a", steps=2, strategy={"zero": 3})
    left = process_groups() - before
    second = train_builtin("gpt-tiny", out + "/b", steps=2, strategy={"zero": 3})
    return {"left": len(left), "first": first, "second": second}


def test_close_destroys_the_runs_groups_and_a_later_run_is_unaffected(rank_pool, tmp_path):
    """Trainer.close leaves no process group behind (idle gloo groups cost CPU in long-lived processes), and a
    second FSDP2 run on an equal-shaped mesh trains exactly as the first: DTensor's caches, which compare meshes
    by shape, must not hand it the destroyed groups."""
    for got in rank_pool(2).run(_train_twice_with_close, str(tmp_path)):
        assert got["left"] == 0
        assert got["first"]["losses"] == got["second"]["losses"]  # bitwise: the same ops in the same order
        assert max_param_difference(got["first"]["params"], got["second"]["params"]) == 0.0


def test_bf16_autocast_trains_close_to_fp32(rank_pool, tmp_path):
    fp32 = rank_pool(2).run(train_builtin, "gpt-tiny", str(tmp_path / "fp32"), steps=10)[0]
    bf16 = rank_pool(2).run(train_builtin, "gpt-tiny", str(tmp_path / "bf16"), steps=10, dtype="bf16-autocast")[0]
    assert bf16["losses"][-1] < bf16["losses"][0]
    assert max_relative_difference(fp32["losses"], bf16["losses"]) < 0.02
    assert all(v.dtype == torch.float32 for v in bf16["params"].values())  # master weights stay fp32


def test_api_misuse_gets_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="needs an nn.Module"):
        autopar.Trainer(lambda x: x, _data())
    with pytest.raises(DataError, match="train_data is empty"):
        autopar.Trainer(nn.Linear(2, 2), TensorDataset(torch.zeros(0, 2), torch.zeros(0, 2)),
                        config=autopar.TrainConfig(out=str(tmp_path))).train()
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp = 2\*1\*1 does not equal the number of processes \(1\)"):
        autopar.Trainer(nn.Linear(2, 2), _data(), strategy=autopar.Strategy(dp=2)).train()


def _train_with_custom_functions(out: str, strategy: dict, forward: bool) -> dict | str:
    """gpt-tiny with a user loss (token-mean cross-entropy on whole logits), optionally a user forward."""
    from autopar.data import padded_vocab_size
    from autopar.models import build_model
    from helpers import small_data
    model, info = build_model("gpt-tiny", {"n_layer": 2}, vocab_size=padded_vocab_size(258), device="meta")
    train_data, _ = small_data(info.task, 32)
    extra = {"forward_fn": lambda m, b: m(b["input_ids"])} if forward else {}
    trainer = autopar.Trainer(model, train_data, strategy=autopar.Strategy(**strategy), config=autopar.TrainConfig(
        steps=4, global_batch_size=8, micro_batch_size=4, lr=1e-3, out=out, progress=False, timeout_s=60),
        loss_fn=lambda logits, b: F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten()), **extra)
    try:
        return {"losses": trainer.train().losses}
    except ConfigError as exc:
        return str(exc)


def test_tensor_parallel_custom_loss_sees_whole_logits(rank_pool, tmp_path):
    single = rank_pool(1).run(_train_with_custom_functions, str(tmp_path / "one"), {}, False)[0]
    for got in rank_pool(2).run(_train_with_custom_functions, str(tmp_path / "tp"), {"tp": 2}, False):
        assert max_relative_difference(single["losses"], got["losses"]) < 1e-5
    errors = rank_pool(2).run(_train_with_custom_functions, str(tmp_path / "fwd"), {"tp": 2}, True)
    assert all("custom forward_fn cannot be used with pp=1 tp=2" in e for e in errors), errors
