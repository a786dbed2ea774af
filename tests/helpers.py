"""Functions the rank pool runs (module level, so spawned ranks can import them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import autopar
from autopar.data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
from autopar.models import build_model

_DATA_CACHE: dict = {}


def small_data(task: str, seq_len: int = 32, seed: int = 0):
    """Train/eval windows of the embedded corpus (cached per process: the corpus is read once)."""
    key = (task, seq_len, seed)
    if key not in _DATA_CACHE:
        tokenizer = build_tokenizer("byte")
        _DATA_CACHE[key] = build_datasets(load_corpus("stdlib"), tokenizer, seq_len=seq_len, task=task, seed=seed)
    return _DATA_CACHE[key]


def train_builtin(model_name: str, out: str, *, model_args: dict | None = None, seq_len: int = 32,
                  strategy: dict | None = None, strategies: tuple | None = None, **train_kwargs) -> dict:
    """Train a built-in model with the Trainer API; returns losses, grad norms and final parameters.
    `strategies`: a strategy table of the test's own for this Trainer (Trainer(strategies=...))."""
    model, info = build_model(model_name, model_args or {}, vocab_size=padded_vocab_size(258), device="meta")
    train_data, eval_data = small_data(info.task, seq_len)
    defaults = dict(steps=20, global_batch_size=8, micro_batch_size=2, lr=1e-3, warmup_steps=3, eval_batches=1,
                    out=out, progress=False, timeout_s=60)
    config = autopar.TrainConfig(**{**defaults, **train_kwargs})
    trainer = autopar.Trainer(model, train_data, strategy=autopar.Strategy(**(strategy or {})), config=config,
                              eval_data=eval_data, strategies=strategies)
    result = trainer.train()
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    planned = getattr(getattr(getattr(trainer.engine, "runtime", None), "p2p", None), "planned", None)
    got = {"losses": result.losses, "eval_loss": result.eval_loss, "first_step": result.first_step,
           "boundary_plans": [] if planned is None else  # --boundary: what this rank's channels moved
           [(plan.method, plan.max_link_bytes(), plan.nbytes, plan.src.tp, plan.dst.tp) for plan in planned.plans()],
           "grad_norms": [r["grad_norm"] for r in records if r["step"] >= result.first_step],
           "params": whole_parameters(trainer), "local_numel": sum(p.numel() for p in trainer.model.parameters()),
           "local_micro_batches": len(trainer.loader.local_positions(0))}
    trainer.close()  # (whole_parameters gathers over the run's groups: close after it)
    return got


def trained_and_closed(trainer) -> dict:
    """Train, then what the equivalence checks compare: losses, eval loss, whole parameters, this rank's share."""
    import math
    result = trainer.train()
    got = {"losses": result.losses, "eval_loss": result.eval_loss, "params": whole_parameters(trainer),
           "finite": all(math.isfinite(v) for v in result.losses),
           "local_numel": sum(p.numel() for p in trainer.model.parameters())}
    trainer.close()
    return got


def whole_parameters(trainer) -> dict:
    """This rank's parameters by name; tensor-parallel slices, expert rows and ZeRO-3 shards gathered whole."""
    tp = trainer.engine.sliced_state
    whole = lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v  # noqa: E731 (ZeRO-3 with tp: dp shards)
    return {k: (tp.gather(k, whole(v)) if tp is not None else whole(v)).detach().clone()
            for k, v in trainer.model.state_dict().items()}


def max_relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def max_param_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def world_size() -> int:
    return torch.distributed.get_world_size()
