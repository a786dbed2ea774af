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


def test_overlap_pays_unless_the_ranks_outnumber_the_cores(monkeypatch):
    import os

    from autopar.data_parallel.grad_sync import overlap_pays
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
    assert not overlap_pays(torch.device("cpu"))
    assert overlap_pays(torch.device("cuda"))  # an accelerator's cores idle while the collective runs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert overlap_pays(torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")  # read as one rank on this host
    assert overlap_pays(torch.device("cpu"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert overlap_pays(torch.device("cpu"))


def _default_buckets(ranks_on_host: int) -> dict:
    """A synchronizer with its default sizes, this host said to run `ranks_on_host` ranks: its buckets, and how far
    its summed gradients are from a plain all-reduce."""
    import os
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_on_host)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(3)))  # 1 MiB a weight: over the first bucket
        reference = nn.Sequential(*(nn.Linear(512, 512) for _ in range(3)))
        reference.load_state_dict(model.state_dict())
        sync = GradientSynchronizer(model.parameters(), dist.group.WORLD)
        x = torch.randn(4, 512, generator=torch.Generator().manual_seed(dist.get_rank()))
        model(x).square().mean().backward()
        sync.finish()
        reference(x).square().mean().backward()
        worst = 0.0
        for p, q in zip(model.parameters(), reference.parameters()):
            dist.all_reduce(q.grad)
            worst = max(worst, float((p.grad - q.grad).abs().max()))
        sync.remove()
        from autopar.zero import ShardedGradients
        sharded = {}
        for level in (1, 2):
            zero = ShardedGradients(model.parameters(), dist.group.WORLD, level=level)
            sharded[level] = zero.num_buckets
            zero.remove()
        return {"buckets": sync.num_buckets, "worst": worst, "zero": sharded}
    finally:
        if before is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


def test_time_shared_cores_reduce_in_one_bucket_after_the_backward(rank_pool):
    """Ranks outnumbering the cores: one bucket (nothing to overlap with), not ZeRO's (one bucket slowed ZeRO-1);
    else the small first bucket and more."""
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    shared = rank_pool(2).run(_default_buckets, 64 * cores)
    for r in shared:
        assert r["buckets"] == 1 and r["worst"] < 1e-6
        assert r["zero"][1] >= 2 and r["zero"][2] >= 2  # ZeRO keeps its buckets (zero/grads.py)
    alone = rank_pool(2).run(_default_buckets, 1)  # one thread per rank (the pool's), one rank on the host
    for r in alone:
        assert r["buckets"] >= 2 and r["worst"] < 1e-6
        assert r["zero"][1] >= 2 and r["zero"][2] >= 2


def test_zeros_collectives_take_the_name_this_torch_gives_them(monkeypatch):
    """torch 2.13 names them all_gather_single / reduce_scatter_single (the former names deprecated); torch 2.11, the
    GPU image's, knows only all_gather_into_tensor / reduce_scatter_tensor: distributed.py calls whichever exists."""
    from autopar import distributed
    calls = []
    for new, old in (("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor")):
        monkeypatch.delattr(dist, new, raising=False)
        monkeypatch.setattr(dist, old, lambda out, inp, group=None, async_op=False, _n=old: calls.append((_n, async_op)))
    distributed.all_gather_single(torch.zeros(4), torch.zeros(2), async_op=True)
    distributed.reduce_scatter_single(torch.zeros(2), torch.zeros(4))
    assert calls == [("all_gather_into_tensor", True), ("reduce_scatter_tensor", False)]
    monkeypatch.undo()
    if hasattr(dist, "all_gather_single"):  # this torch's own name is preferred
        monkeypatch.setattr(dist, "all_gather_single", lambda out, inp, group=None, async_op=False: calls.append("new"))
        distributed.all_gather_single(torch.zeros(4), torch.zeros(2))
        assert calls[-1] == "new"
