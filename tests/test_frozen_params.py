"""Frozen parameters (requires_grad=False) stay frozen under every layout, as in one process.

Fine-tuning freezes what it does not train: a backbone, the embeddings, the base weights of a
LoRA model (only the low-rank adapters train). Every layout must train exactly the trainable
parameters: frozen ones keep requires_grad False, come out bitwise equal to their initial
values and to one process's, get no optimizer state (so weight decay never reaches them), and
send no gradient: they are in no data-parallel or ZeRO bucket and no tied-weight all-reduce,
and the gradient norm is the one process's (over trainable parameters only). The gradient
traffic is counted: the elements the buckets reduce equal the trainable elements exactly.

Models (written here, in the styles users write them): a GPT-style causal LM with its token
embedding and first block frozen (built on meta, as the zoo builds, and for real); the same
with the head tied to the frozen embedding (one Parameter: frozen wherever it is read); and a
LoRA-style LM whose every linear is a frozen base plus trainable adapters A and B.
Layouts: dp2, pp2 (1f1b, zb-h1's split backward, recomputation, a stage with nothing to train), tp2
(with sub-batches too), ZeRO 1 and 3 with dp2, a resume from a ZeRO-1 checkpoint, and dp2 x tp2 x pp2
with ZeRO 1, each against one process (losses within 1e-5 relative); gossip (frozen parameters only:
it is not one process's SGD) and the sparse-embedding classification. A model with nothing to train
is refused with a clear error.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar

VOCAB, SEQ, WIDTH = 64, 16, 32
STEPS, GLOBAL_BATCH, SAMPLES = 2, 8, 16
LOSS_RTOL, NORM_RTOL, PARAM_ATOL = 1e-5, 1e-4, 1e-5


# ----------------------------------------------------------------------------- models


class Block(nn.Module):
    """A pre-norm causal transformer block; `linear` makes its projections (plain, or LoRA)."""

    def __init__(self, linear=nn.Linear, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v = linear(WIDTH, WIDTH), linear(WIDTH, WIDTH), linear(WIDTH, WIDTH)
        self.proj = linear(WIDTH, WIDTH)
        self.up, self.down = linear(WIDTH, 2 * WIDTH), linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm1(x)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (self.q(h), self.k(h), self.v(h)))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class CausalLM(nn.Module):
    """GPT-style: token and position embeddings, a ModuleList of blocks, a final norm and a head."""

    def __init__(self, layers: int = 4, linear=nn.Linear, tie: bool = False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block(linear) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def freeze_embedding_and_first_block(model: CausalLM) -> CausalLM:
    """What a fine-tune script does: freeze the token embedding (and a head tied to it) and block 0."""
    model.tok.weight.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    return model


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank update: y = base(x) + (x A^T B^T) * alpha / r."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base = nn.Linear(in_features, out_features)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank))
        self.scale = alpha / rank
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)  # the update starts at zero, as LoRA's does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scale


def freeze_lower_half(model: CausalLM) -> CausalLM:
    """A frozen backbone's lower half: embeddings and blocks 0-1 (a whole pipeline stage holds nothing to train)."""
    for module in (model.tok, model.pos, model.blocks[0], model.blocks[1]):
        module.requires_grad_(False)
    return model


def lora_lm() -> CausalLM:
    """Every projection a LoRA linear; embeddings, norms and head frozen: only the adapters train."""
    model = CausalLM(layers=2, linear=LoRALinear)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def _on_meta(make):
    def build():
        with torch.device("meta"):
            return make()
    return build


def _for_real(make):
    def build():
        torch.manual_seed(0)  # the same weights in every process
        return make()
    return build


MODELS = {
    "gpt-meta": _on_meta(lambda: freeze_embedding_and_first_block(CausalLM())),
    "gpt-real": _for_real(lambda: freeze_embedding_and_first_block(CausalLM())),
    "gpt-tied-meta": _on_meta(lambda: freeze_embedding_and_first_block(CausalLM(tie=True))),
    "gpt-half-meta": _on_meta(lambda: freeze_lower_half(CausalLM())),
    "gpt-tied-half-meta": _on_meta(lambda: freeze_lower_half(CausalLM(tie=True))),  # the head: tied, so frozen
    "lora-meta": _on_meta(lora_lm),
    "lora-real": _for_real(lora_lm),
}


def lm_data(seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (t := torch.randint(0, VOCAB, (SEQ + 1,), generator=g))[:-1], "labels": t[1:]}
            for _ in range(SAMPLES)]


# ----------------------------------------------------------------------------- what a rank reports


def _gradient_traffic(engine) -> dict:
    """Elements this rank's gradient collectives carry, read from the structures that issue them."""
    from autopar.data_parallel import GradientSynchronizer
    from autopar.zero import ShardedGradients

    sync = getattr(engine, "sync", None)
    traffic = {"tied": sum(p.numel() for p, *_ in getattr(engine, "_shared", []))}
    if isinstance(sync, GradientSynchronizer):  # each bucket buffer is all-reduced whole
        traffic["dp"] = sum(b.full.numel() for b in sync.buckets)
    elif isinstance(sync, ShardedGradients):  # ZeRO 1/2: each flat bucket (padded to a multiple of dp) reduce-scattered
        traffic["dp"] = sum(p.numel() for b in sync.buckets for p in b.params)
        traffic["dp_padding_ok"] = all(b.numel - sum(p.numel() for p in b.params) < sync.world for b in sync.buckets)
    if hasattr(engine, "flat"):  # gossip: the parameters mixed with the neighbours
        traffic["mixed"] = sum(p.numel() for p in engine.flat.params)
    return traffic


def _optimizer_params(optimizer) -> list[torch.Tensor]:
    pieces = getattr(optimizer, "_pieces", None)
    if pieces is not None:  # ZeRO: the model parameters its master slices stand for
        return [p for _, p, *_ in pieces]
    return [p for g in optimizer.param_groups for p in g["params"]]


def train_frozen(model_name: str, out: str, *, strategy: dict | None = None, micro_batch_size: int = GLOBAL_BATCH,
                 resume: str | None = None, checkpoint_every: int | None = None) -> dict:
    """Train one case through autopar.Trainer on every rank of a pool; what the test compares."""
    from autopar.models import materialize
    from helpers import whole_parameters

    model = MODELS[model_name]()
    config = autopar.TrainConfig(steps=STEPS, checkpoint_every=checkpoint_every, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch_size,
                                 lr=1e-2, warmup_steps=0, adam_eps=1e-6, weight_decay=0.1, out=out, progress=False,
                                 timeout_s=60, resume=resume)
    initial = {k: v.detach().clone() for k, v in
               materialize(copy.deepcopy(model), "cpu", seed=config.seed).state_dict().items()}
    frozen_names = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    reduce_scattered = []  # elements FSDP2 (ZeRO-3) reduce-scatters
    # the name FSDP2 calls it by: reduce_scatter_single on torch 2.13, reduce_scatter_tensor before
    name = "reduce_scatter_single" if hasattr(torch.distributed, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = getattr(torch.distributed, name)

    def counting(output, input, *args, **kwargs):
        reduce_scattered.append(input.numel())
        return original(output, input, *args, **kwargs)

    setattr(torch.distributed, name, counting)
    try:
        trainer = autopar.Trainer(model, lm_data(), strategy=autopar.Strategy(**(strategy or {})), config=config)
        result = trainer.train()
    finally:
        setattr(torch.distributed, name, original)
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    named = dict(trainer.model.named_parameters())
    local_frozen = [p for name, p in named.items() if not p.requires_grad]
    trainable = {id(p): p for p in named.values() if p.requires_grad}
    in_optimizer = {id(p) for p in _optimizer_params(trainer.optimizer)}
    got = {
        "losses": result.losses,
        "grad_norms": [r["grad_norm"] for r in records if r["step"] >= result.first_step],
        "params": whole_parameters(trainer),
        "initial": initial,
        "frozen_names": frozen_names,
        "local_frozen": sorted(name for name, p in named.items() if not p.requires_grad),
        "local_names": sorted(named),
        "frozen_with_grad": sorted(name for name, p in named.items() if not p.requires_grad and p.grad is not None),
        "frozen_in_optimizer": sorted(name for name, p in named.items() if not p.requires_grad
                                      and (id(p) in in_optimizer or p in trainer.optimizer.state)),
        "trainable_in_optimizer": all(id(p) in in_optimizer for p in trainable.values())
        if not hasattr(trainer.optimizer, "_pieces") else None,  # ZeRO: each rank holds only its shard
        "trainable_numel": sum(p.numel() for p in trainable.values()),
        "frozen_numel": sum(p.numel() for p in {id(p): p for p in local_frozen}.values()),
        "traffic": _gradient_traffic(trainer.engine),
        "reduce_scattered": sum(reduce_scattered),
    }
    trainer.close()
    return got


def train_cases(cases: list[tuple[str, dict]], out: str, micro_batch_size: int) -> list[dict]:
    """Several cases in one pool task (a pool start costs seconds on two cores)."""
    results = []
    for i, (model_name, strategy) in enumerate(cases):
        results.append(train_frozen(model_name, f"{out}/{i}", strategy=strategy, micro_batch_size=micro_batch_size))
    return results


def resume_case(model_name: str, strategy: dict, out: str, micro_batch_size: int) -> dict:
    """Two steps saving after each; then a run resumed from the first step's checkpoint: the whole run's result."""
    from autopar.train.checkpoint import checkpoint_name

    first = train_frozen(model_name, f"{out}/first", strategy=strategy, micro_batch_size=micro_batch_size,
                         checkpoint_every=1)
    second = train_frozen(model_name, f"{out}/second", strategy=strategy, micro_batch_size=micro_batch_size,
                          resume=f"{out}/first/checkpoints/{checkpoint_name(1)}")
    return {**second, "losses": first["losses"][:1] + second["losses"],
            "grad_norms": first["grad_norms"][:1] + second["grad_norms"]}


def refused(model_name: str, out: str, strategy: dict, micro_batch_size: int) -> dict:
    try:
        train_frozen(model_name, out, strategy=strategy, micro_batch_size=micro_batch_size)
    except Exception as exc:  # the test judges the kind
        return {"autopar_error": isinstance(exc, autopar.AutoparError), "message": str(exc)}
    return {"autopar_error": False, "message": "trained"}


def _all_frozen() -> CausalLM:
    with torch.device("meta"):
        return CausalLM(layers=2).requires_grad_(False)


MODELS["all-frozen-meta"] = _all_frozen


# ----------------------------------------------------------------------------- the tests

_references: dict = {}


def references(rank_pool, tmp_path_factory) -> dict:
    """One process, one micro-batch of 8, per model: computed once, in one pool task."""
    if not _references:
        out = str(tmp_path_factory.mktemp("frozen-reference"))
        names = [n for n in MODELS if n != "all-frozen-meta"]
        results = rank_pool(1).run(train_cases, [(n, {}) for n in names], out, GLOBAL_BATCH, timeout=300)[0]
        _references.update(zip(names, results))
    return _references


def assert_frozen_kept(got: dict, what: str) -> None:
    """What holds under any layout, synchronous or not: frozen parameters untouched and silent."""
    assert got["frozen_names"], what
    # every frozen parameter this rank holds is still frozen, and holds no gradient or optimizer state
    assert set(got["local_frozen"]) == set(got["local_names"]) & got["frozen_names"], what
    assert got["frozen_with_grad"] == [], (what, got["frozen_with_grad"])
    assert got["frozen_in_optimizer"] == [], (what, got["frozen_in_optimizer"])
    assert got["trainable_in_optimizer"] in (True, None), what
    moved = 0
    for name, value in got["params"].items():
        if name in got["frozen_names"]:  # bitwise: the initial values (weight decay never reached them)
            assert torch.equal(value, got["initial"][name]), (what, name)
        else:
            moved += int(not torch.equal(value, got["initial"][name]))
    assert moved or got["trainable_numel"] == 0, (what, "no trainable parameter moved")
    # gradient (and gossip's parameter) traffic: the trainable elements only; no tied sum for a frozen tie
    traffic = got["traffic"]
    for kind in ("dp", "mixed"):
        if kind in traffic:
            assert traffic[kind] == got["trainable_numel"], (what, traffic, got["trainable_numel"], got["frozen_numel"])
    assert traffic.get("dp_padding_ok", True), what
    if "tied" in what:
        assert traffic["tied"] == 0, (what, traffic)


def assert_frozen_and_equal(expected: dict, got: dict, what: str) -> None:
    """assert_frozen_kept, and the one process's losses, norms and parameters (frozen ones bitwise)."""
    assert_frozen_kept(got, what)
    assert got["frozen_names"] == expected["frozen_names"], what
    assert len(got["losses"]) == STEPS, what
    assert max(abs(x - y) / abs(x) for x, y in zip(expected["losses"], got["losses"])) < LOSS_RTOL, \
        (what, expected["losses"], got["losses"])
    # the norm is the one process's: frozen parameters are not counted in it
    assert max(abs(x - y) / abs(x) for x, y in zip(expected["grad_norms"], got["grad_norms"])) < NORM_RTOL, \
        (what, expected["grad_norms"], got["grad_norms"])
    for name, value in got["params"].items():
        want = expected["params"][name]
        assert value.shape == want.shape, (what, name)
        if name in got["frozen_names"]:
            assert torch.equal(value, want), (what, name)
        else:
            assert (value - want).abs().max() < PARAM_ATOL, (what, name, float((value - want).abs().max()))


DP2_CASES = [("gpt-meta", {"dp": 2}),
             ("gpt-meta", {"dp": 2, "zero": 1}), ("lora-real", {"dp": 2, "zero": 1}),
             ("gpt-meta", {"dp": 2, "zero": 3}), ("lora-meta", {"dp": 2, "zero": 3}),
             ("gpt-meta", {"pp": 2}), ("gpt-real", {"pp": 2}), ("gpt-tied-meta", {"pp": 2}), ("lora-meta", {"pp": 2}),
             ("gpt-half-meta", {"pp": 2, "partition": "uniform"}),  # stage 0: nothing to train
             ("gpt-meta", {"pp": 2, "schedule": "zb-h1"}),  # split backward (I and W)
             ("gpt-meta", {"pp": 2, "recompute": "all"}),
             ("gpt-meta", {"tp": 2}), ("gpt-real", {"tp": 2}), ("gpt-tied-meta", {"tp": 2}), ("lora-meta", {"tp": 2}),
             ("gpt-meta", {"tp": 2, "tp_subbatches": 2})]
GOSSIP_CASE = ("gpt-meta", {"dp": 2, "dp_mode": "gossip"})  # not one process's SGD: frozen parameters checked only


def test_frozen_parameters_stay_frozen_on_two_ranks(rank_pool, tmp_path, tmp_path_factory):
    expected = references(rank_pool, tmp_path_factory)
    results = rank_pool(2).run(train_cases, DP2_CASES + [GOSSIP_CASE], str(tmp_path), GLOBAL_BATCH // 2, timeout=600)
    for rank, per_case in enumerate(results):
        assert_frozen_kept(per_case[-1], f"{GOSSIP_CASE} rank {rank}")
        for (name, strategy), got in zip(DP2_CASES, per_case):
            what = f"{name} {strategy} rank {rank}"
            assert_frozen_and_equal(expected[name], got, what)
            if name == "gpt-half-meta":  # the case is what it says: stage 0's rank holds nothing to train
                assert (got["trainable_numel"] == 0) == (rank == 0), (what, got["trainable_numel"])
            if strategy.get("zero") == 3:  # FSDP2 reduce-scatters the trainable elements only, once a step
                whole_trainable = sum(v.numel() for k, v in expected[name]["params"].items()
                                      if k not in got["frozen_names"])
                assert got["reduce_scattered"] == STEPS * whole_trainable, (what, got["reduce_scattered"])


def test_frozen_parameters_survive_a_zero_checkpoint(rank_pool, tmp_path, tmp_path_factory):
    """Saved and resumed under ZeRO-1 (whose masters hold only trainable parameters): the whole run's result."""
    expected = references(rank_pool, tmp_path_factory)
    results = rank_pool(2).run(resume_case, "gpt-meta", {"dp": 2, "zero": 1}, str(tmp_path), GLOBAL_BATCH // 2,
                               timeout=300)
    for rank, got in enumerate(results):
        assert_frozen_and_equal(expected["gpt-meta"], got, f"resumed zero 1 rank {rank}")


def test_frozen_parameters_stay_frozen_in_3d(rank_pool, tmp_path, tmp_path_factory):
    """dp2 x tp2 x pp2 with ZeRO-1: stage 0 all frozen (its ranks step nothing), the frozen tied head on stage 1."""
    expected = references(rank_pool, tmp_path_factory)
    cases = [("gpt-tied-half-meta", {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "partition": "uniform"})]
    results = rank_pool(8).run(train_cases, cases, str(tmp_path), GLOBAL_BATCH // 4, timeout=600)
    for rank, per_case in enumerate(results):
        for (name, strategy), got in zip(cases, per_case):
            assert_frozen_and_equal(expected[name], got, f"{name} {strategy} rank {rank}")


def test_sparse_embeddings_never_shard_a_frozen_table():
    """EmbRace would replace a sparse table by a trainable shard: a frozen table stays dense and frozen."""
    from autopar.sparse.classify import classify_tables

    model = freeze_embedding_and_first_block(CausalLM(layers=1))
    tables = classify_tables(model, lambda: model(torch.zeros(1, SEQ, dtype=torch.long)), threshold=2.0, group=None)
    kinds = {t.param_name: t.sparse for t in tables}
    assert kinds == {"tok.weight": False, "pos.weight": True}, kinds  # a threshold above 1: all others sparse
    assert "frozen" in next(t.reason for t in tables if t.param_name == "tok.weight")


@pytest.mark.parametrize("world,strategy", [(1, {}), (2, {"pp": 2})], ids=["single", "pp2"])
def test_nothing_to_train_is_refused(rank_pool, tmp_path, world, strategy):
    results = rank_pool(world).run(refused, "all-frozen-meta", str(tmp_path), strategy,
                                   GLOBAL_BATCH // world, timeout=300)
    for rank, got in enumerate(results):
        assert got["autopar_error"], (rank, got["message"])
        assert "requires_grad" in got["message"] and "CausalLM" in got["message"], (rank, got["message"])
