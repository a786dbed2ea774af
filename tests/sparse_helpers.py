"""Rank functions for the sparse-embedding tests (module level, so spawned ranks can import them).

The single-process references here are written from scratch with plain torch (nn.Embedding,
torch.optim), independent of autopar.sparse, so a shared bug cannot hide.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.mesh import ProcessMesh
from autopar.sparse import ShardedEmbedding, SparseEmbeddingEngine
from autopar.sparse.exchange import CommLedger

VOCAB, DIM = 97, 6  # 6 is not divisible by 4: column shards of unequal width


def zipf_ids(generator: torch.Generator, shape: tuple[int, ...], vocab: int = VOCAB) -> torch.Tensor:
    """Skewed ids with many duplicates, like words."""
    count = int(torch.tensor(shape).prod())
    if count == 0:
        return torch.zeros(shape, dtype=torch.long)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, count, replacement=True, generator=generator).view(shape)


def lookup_matches_embedding(mode: str, rows_per_rank: list[int]) -> dict:
    """Sharded lookup and its gradient vs nn.Embedding on the same table (every rank checks its own)."""
    rank = dist.get_rank()
    full = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    ids = [zipf_ids(gen, (n, 3)) for n in rows_per_rank]  # every rank draws all ranks' ids (same seed)
    weights = [torch.randn(n, 3, DIM, generator=gen) for n in rows_per_rank]
    table = ShardedEmbedding(full, name="t.weight", mode=mode, group=dist.group.WORLD, ledger=CommLedger())
    out = table(ids[rank])
    lookup_error = float((out - F.embedding(ids[rank], full)).abs().max()) if out.numel() else 0.0
    (out * weights[rank]).sum().backward()
    table.exchange.finish_unscheduled()
    reference = nn.Embedding.from_pretrained(full.clone(), freeze=False)
    sum((reference(i) * w).sum() for i, w in zip(ids, weights)).backward()
    layout = table.exchange.layout
    expected = layout.shard_of(reference.weight.grad)
    grad_error = float((table.shard.grad.to_dense() - expected).abs().max())
    gathered = table.exchange.gather_full()
    return {"shape": tuple(out.shape), "expected_shape": (rows_per_rank[rank], 3, DIM), "lookup_error": lookup_error,
            "grad_error": grad_error, "gather_error": float((gathered - full).abs().max()),
            "grad_nonzero": int(expected.abs().sum() > 0)}


class TinyLM(nn.Module):
    """Input table (sparse), a dense position table and a linear head, untied."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, seq: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.head(torch.tanh(self.mix(x)))


def global_batch(step: int, size: int = 8, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = zipf_ids(gen, (size, seq + 1))
    return tokens[:, :-1], tokens[:, 1:]


def train_sparse(mode: str, optimizer: str, *, sharding: str = "column", scheduled: bool = False, steps: int = 4,
                 micro: int = 1, lr: float = 0.05, threshold: float = 0.9, grad_clip: float = 0.0,
                 break_priority: bool = False) -> dict:
    """k steps of SparseEmbeddingEngine on TinyLM; returns full parameters, losses and per-step ledger."""
    world, rank = dist.get_world_size(), dist.get_rank()
    strategy = autopar.Strategy(dp=world, sparse_embeddings=mode, sparse_sharding=sharding,
                                sparse_schedule=scheduled, sparse_threshold=threshold)
    config = autopar.TrainConfig(steps=steps, optimizer=optimizer, lr=lr, weight_decay=0.0, grad_clip=grad_clip,
                                 timeout_s=60)
    mesh = ProcessMesh.build(strategy.resolved(world), timeout_s=60)
    torch.manual_seed(0)
    model = TinyLM()
    per_rank = 8 // world

    def local(step: int) -> list[dict]:
        inputs, labels = global_batch(step)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        chunks = zip(inputs[mine].split(per_rank // micro), labels[mine].split(per_rank // micro))
        return [{"input_ids": i, "labels": l} for i, l in chunks]

    engine = SparseEmbeddingEngine(model, mesh, device=torch.device("cpu"), seed=0,
                                   forward_fn=lambda m, b: m(b["input_ids"]), autocast=contextlib.nullcontext,
                                   config=config, batches_for_step=local, options=strategy.sparse)
    for ex in engine.exchanges:
        ex.priority = not break_priority
    opt = engine.build_optimizer(config)
    losses, ledgers = [], []
    tokens = 8 * 8
    for step in range(steps):
        batches = local(step)
        loss_fn = lambda out, b: F.cross_entropy(out.reshape(-1, VOCAB), b["labels"].reshape(-1),  # noqa: E731
                                                 reduction="sum") / tokens
        total = engine.forward_backward(batches, loss_fn)
        engine.clip_gradients(grad_clip if grad_clip > 0 else float("inf"))
        opt.step()
        engine.zero_grad()
        dist.all_reduce(total)
        losses.append(float(total))
        ledgers.append(dict(engine.ledger.elements))
    params = engine.full_state_dict()
    checked = sum(ex.versions.reads_checked for ex in engine.exchanges)
    deferred = sum(ex.rows_deferred for ex in engine.exchanges)
    widths = [ex.layout.shard_shape[1] for ex in engine.exchanges]
    engine.close()
    return {"params": params, "losses": losses, "ledgers": ledgers, "sparse": [t.sparse for t in engine.tables],
            "description": engine.description, "reads_checked": checked, "rows_deferred": deferred,
            "shard_width": widths[0] if widths else None, "dense_elements": engine.dense_elements,
            "local_unique": [int(torch.unique(torch.cat([b["input_ids"].reshape(-1) for b in local(s)])).numel())
                             for s in range(steps)]}


def reference_training(optimizer: str, *, steps: int = 4, lr: float = 0.05, sparse_tables: tuple[str, ...] = ("embed",),
                       grad_clip: float = 0.0) -> dict:
    """One process, the whole global batch, plain torch: the rule every mode must reproduce."""
    torch.manual_seed(0)
    model = TinyLM()
    from autopar.models import materialize
    model = materialize(model, torch.device("cpu"), seed=0)
    tables = [getattr(model, name) for name in sparse_tables]
    table_params = {id(t.weight) for t in tables}
    dense = [p for p in model.parameters() if id(p) not in table_params]
    if optimizer == "sgd":
        opts = [torch.optim.SGD(model.parameters(), lr=lr)]
    elif optimizer == "adagrad":
        opts = [torch.optim.Adagrad(model.parameters(), lr=lr)]
    else:  # sparse-adam: SparseAdam on the sparse tables (sparse gradients), Adam on the rest
        for t in tables:
            t.sparse = True
        opts = [torch.optim.Adam(dense, lr=lr, betas=(0.9, 0.95)),
                torch.optim.SparseAdam([t.weight for t in tables], lr=lr, betas=(0.9, 0.95))]
    losses = []
    for step in range(steps):
        inputs, labels = global_batch(step)
        loss = F.cross_entropy(model(inputs).reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


_WORD_DATA: dict = {}


def word_data(vocab_size: int, seq_len: int):
    """Word-tokenized train/eval windows of the embedded corpus (cached per process)."""
    key = (vocab_size, seq_len)
    if key not in _WORD_DATA:
        from autopar.data import build_datasets, build_tokenizer, load_corpus
        corpus = load_corpus("stdlib")
        tokenizer = build_tokenizer("word", corpus=corpus, vocab_size=vocab_size)
        _WORD_DATA[key] = (tokenizer, *build_datasets(corpus, tokenizer, seq_len=seq_len, task="causal-lm", seed=0))
    return _WORD_DATA[key]


def train_word_lm(out: str, *, strategy: dict, vocab_size: int = 1024, seq_len: int = 16, model: str = "word-lstm",
                  **train_kwargs) -> dict:
    """The Trainer on a word LM; returns losses, grad norms, metrics and the full (gathered) parameters."""
    import json
    from pathlib import Path

    from autopar.models import build_model
    tokenizer, train_data, eval_data = word_data(vocab_size, seq_len)
    # (no biases in word-gpt: the key bias has an exactly-zero true gradient, and Adam-like rules turn its
    # rounding noise into steps of lr size, which no two summation orders share)
    args = {"d_embed": 8, "d_hidden": 16} if model == "word-lstm" else {"d_model": 16, "bias": False}
    net, _ = build_model(model, args, vocab_size=tokenizer.vocab_size, device="meta")
    defaults = dict(steps=6, global_batch_size=8, micro_batch_size=2, lr=0.1, warmup_steps=2, eval_batches=1,
                    out=out, progress=False, timeout_s=60, optimizer="sgd", weight_decay=0.0)
    trainer = autopar.Trainer(net, train_data, strategy=autopar.Strategy(**strategy),
                              config=autopar.TrainConfig(**{**defaults, **train_kwargs}), eval_data=eval_data)
    result = trainer.train()
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    params = (trainer.engine.full_state_dict() if hasattr(trainer.engine, "full_state_dict")
              else {k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    trainer.close()
    return {"losses": result.losses, "eval_loss": result.eval_loss, "records": records, "params": params,
            "description": getattr(trainer.engine, "description", "")}


def config_error_of(fn, *args, **kwargs) -> str:
    """Run fn on this rank; return the ConfigError's message (every rank must raise it), or '' if none."""
    from autopar.errors import ConfigError
    try:
        fn(*args, **kwargs)
    except ConfigError as exc:
        return str(exc)
    return ""


class NoTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return self.layer(x)


def embrace_without_table() -> str:
    world = dist.get_world_size()
    strategy = autopar.Strategy(dp=world, sparse_embeddings="embrace")
    mesh = ProcessMesh.build(strategy.resolved(world), timeout_s=60)
    config = autopar.TrainConfig(optimizer="sgd", timeout_s=60)
    batch = {"inputs": torch.randn(2, 4), "labels": torch.zeros(2, 4)}
    return config_error_of(SparseEmbeddingEngine, NoTable(), mesh, device=torch.device("cpu"), seed=0,
                           forward_fn=lambda m, b: m(b["inputs"]), autocast=contextlib.nullcontext, config=config,
                           batches_for_step=lambda step: [batch], options=strategy.sparse)


def embrace_small_table(vocab: int, dim: int, sharding: str = "column", optimizer: str = "sgd",
                        scheduled: bool = False, grad_clip: float = 0.0) -> str:
    world = dist.get_world_size()
    strategy = autopar.Strategy(dp=world, sparse_embeddings="embrace", sparse_threshold=1.0,
                                sparse_sharding=sharding, sparse_schedule=scheduled)
    mesh = ProcessMesh.build(strategy.resolved(world), timeout_s=60)
    config = autopar.TrainConfig(optimizer=optimizer, timeout_s=60, grad_clip=grad_clip)
    model = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, 2))
    batch = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "labels": torch.zeros(1, 1, dtype=torch.long)}

    def build():
        engine = SparseEmbeddingEngine(model, mesh, device=torch.device("cpu"), seed=0,
                                       forward_fn=lambda m, b: m(b["input_ids"]), autocast=contextlib.nullcontext,
                                       config=config, batches_for_step=lambda step: [batch],
                                       options=strategy.sparse)
        engine.build_optimizer(config)
    return config_error_of(build)
