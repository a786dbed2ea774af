"""Tensor-parallel layers against a sliced single-process reference: outputs and every gradient, tp in {2, 4}."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar.errors import ConfigError
from autopar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                     vocab_parallel_cross_entropy)


def _close(a, b) -> float:
    return float((a - b).abs().max())


def _mlp_pair() -> dict:
    """Column -> GELU -> row, as an MLP; compared with the unsharded MLP on every rank."""
    group, rank, tp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    up, down = nn.Linear(8, 16), nn.Linear(16, 8)
    x = torch.randn(3, 5, 8)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = down(F.gelu(up(x_ref)))
    ref.square().sum().backward()
    col, row = ColumnParallelLinear.from_linear(up, group), RowParallelLinear.from_linear(down, group)
    out = row(F.gelu(col(x_par)))
    out.square().sum().backward()
    part = 16 // tp
    rows = slice(rank * part, (rank + 1) * part)
    return {"out": _close(out, ref), "x": _close(x_par.grad, x_ref.grad),
            "up_w": _close(col.weight.grad, up.weight.grad[rows]), "up_b": _close(col.bias.grad, up.bias.grad[rows]),
            "down_w": _close(row.weight.grad, down.weight.grad[:, rows]), "down_b": _close(row.bias.grad, down.bias.grad)}


def _embedding_and_loss() -> dict:
    group, rank, tp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    vocab = 24
    emb = nn.Embedding(vocab, 6)
    head = nn.Linear(6, vocab, bias=False)
    ids = torch.randint(0, vocab, (2, 7))
    targets = torch.randint(0, vocab, (2, 7))
    targets[0, :3] = -100  # ignored positions
    ref_loss = F.cross_entropy(head(emb(ids)).flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    ref_loss.backward()
    par_emb = VocabParallelEmbedding.from_embedding(emb, group)
    par_head = ColumnParallelLinear.from_linear(head, group)
    logits_local = par_head(par_emb(ids))
    loss = vocab_parallel_cross_entropy(logits_local, targets, vocab_start=par_emb.start, group=group).sum()
    loss.backward()
    part = vocab // tp
    rows = slice(rank * part, (rank + 1) * part)
    return {"loss": abs(float(loss) - float(ref_loss)), "emb": _close(par_emb.weight.grad, emb.weight.grad[rows]),
            "head": _close(par_head.weight.grad, head.weight.grad[rows]), "local_vocab": logits_local.shape[-1]}


@pytest.mark.parametrize("tp", [2, 4])
def test_column_row_pair_matches_the_unsharded_mlp(rank_pool, tp):
    for result in rank_pool(tp).run(_mlp_pair):
        assert max(result.values()) < 1e-5, result


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_and_loss_never_gather_logits(rank_pool, tp):
    for result in rank_pool(tp).run(_embedding_and_loss):
        assert result["local_vocab"] == 24 // tp  # each rank only ever holds its slice of the logits
        assert result["loss"] < 1e-4 and result["emb"] < 1e-5 and result["head"] < 1e-5, result


def _bad_split() -> str:
    try:
        ColumnParallelLinear(torch.zeros(10, 4), None, dist.group.WORLD)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_tp_that_does_not_divide_gets_a_clear_error(rank_pool):
    for message in rank_pool(4).run(_bad_split):
        assert message == "tp=4 does not divide out_features=10; use a tp that divides 10"
