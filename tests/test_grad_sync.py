"""GradientSynchronizer against a plain all-reduce, with buckets, accumulation and misuse."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopar.data_parallel import GradientSynchronizer


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
        self.unused = nn.Linear(16, 16)  # gets no gradient: must still reduce as zeros
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


def _loss(model, ids):
    return model(ids).square().mean()


def _sync_vs_reference(bucket_mb: float, micro: int, steps: int, skip_zero_grad: bool) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    sync = GradientSynchronizer(model.parameters(), dist.group.WORLD, bucket_mb=bucket_mb, first_bucket_mb=bucket_mb)
    worst = 0.0
    for step in range(steps):
        batches = [torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(100 * step + 10 * rank + i))
                   for i in range(micro)]
        for i, ids in enumerate(batches):
            with (contextlib.nullcontext() if i == micro - 1 else sync.no_sync()):
                _loss(model, ids).backward()
            _loss(reference, ids).backward()
        sync.finish()
        for p in reference.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            expected = q.grad if q.grad is not None else torch.zeros_like(q)
            worst = max(worst, float((p.grad - expected).abs().max()))
        if skip_zero_grad:
            for p in model.parameters():
                p.grad = None  # what optimizer.zero_grad() does
        else:
            sync.zero_grad()
        reference.zero_grad(set_to_none=True)
    sync.remove()
    return {"worst": worst, "buckets": sync.num_buckets}


@pytest.mark.parametrize("bucket_mb,micro,skip_zero_grad", [(25.0, 1, False), (0.001, 1, False), (0.001, 3, False),
                                                            (0.001, 2, True)])
def test_sums_like_a_plain_all_reduce(rank_pool, bucket_mb, micro, skip_zero_grad):
    results = rank_pool(2).run(_sync_vs_reference, bucket_mb, micro, 3, skip_zero_grad)
    for r in results:
        assert r["worst"] < 1e-6
    assert results[0]["buckets"] == (1 if bucket_mb == 25.0 else 7)


def _second_backward_raises() -> str:
    model = Net()
    sync = GradientSynchronizer(model.parameters(), dist.group.WORLD, bucket_mb=0.001)
    ids = torch.randint(0, 50, (2, 4))
    _loss(model, ids).backward()
    try:
        _loss(model, ids).backward()
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    sync.finish()
    sync.remove()
    return message


def test_a_second_synchronised_backward_is_an_error(rank_pool):
    for message in rank_pool(2).run(_second_backward_raises):
        assert "backward ran twice" in message and "no_sync" in message
