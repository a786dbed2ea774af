"""Training the model zoo's cases (tests/zoo_models.py) through autopar.Trainer, as tests/test_model_zoo.py does
on every rank of a pool: losses, whole parameters and gradient norms, or the refusal a case must get.

Module level (no test code) so the rank pool's spawned workers can import it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import autopar
from zoo_models import CASES, REFUSED_CASES, construct

STEPS = 2
GLOBAL_BATCH = 8


def train_case(name: str, build: str, out: str, *, strategy: dict | None = None,
               micro_batch_size: int = GLOBAL_BATCH, refused: bool = False) -> dict:
    """Train zoo case `name`, built `build`, for STEPS steps through autopar.Trainer (runs on every
    rank of a pool). Returns the per-step losses and this rank's parameters by name (tp slices gathered)."""
    from helpers import whole_parameters

    case = (REFUSED_CASES if refused else CASES)[name]
    # adam_eps 1e-6, not 1e-8: a gradient that is zero up to rounding (a key bias, whose gradient softmax's
    # shift invariance makes exactly zero; a pad row) is ~1e-9 here, and Adam divides it by its own root, so
    # with eps 1e-8 rounding noise moves such a weight by a good part of lr (1e-4 seen on an AMD EPYC in
    # vit tp2); 1e-6 leaves every real gradient (>= 1e-5 here) normalised as before.
    config = autopar.TrainConfig(steps=STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch_size,
                                 lr=1e-3, warmup_steps=0, adam_eps=1e-6, out=out, progress=False, timeout_s=60)
    trainer = autopar.Trainer(construct(case, build), case.data(),
                              strategy=autopar.Strategy(**(strategy or {})), config=config, loss_fn=case.loss_fn,
                              init_fn=case.meta_init if build == "meta" else None)
    sharded = any(degree > 1 for key, degree in (strategy or {}).items() if key in ("tp", "pp", "zero"))
    try:
        with without_flop_count(), contextlib.nullcontext() if sharded else without_final_checkpoint():
            result = trainer.train()
        norms = step_grad_norms(result.run_dir) if trainer.is_main else None
        return {"losses": result.losses, "params": whole_parameters(trainer), "grad_norms": norms}
    finally:
        trainer.close()


def step_grad_norms(run_dir) -> list:
    """The gradient norm of every step (before clipping), from the run's metrics.jsonl: a gradient scaled wrongly
    alike on every parameter barely moves Adam's update, so losses and weights after a few steps can miss it."""
    import json
    from pathlib import Path
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r.get("grad_norm") for r in records if "step" in r and "loss" in r]  # (a step's eval_loss shares its line)


def without_flop_count():
    """The run's FLOP count (for MFU) left out: it is a forward of a fake copy of the model on rank 0 alone, which
    here costs more than the 2 steps themselves (the zoo's 4 trainings of each of its 84 jobs spent about a minute
    of a 2-core run on it), and nothing of it reaches the losses and weights compared here: it runs on a copy,
    with the random state forked. The count itself is tested in tests/test_run_logs.py."""
    from unittest import mock
    return mock.patch("autopar.train.run_account.forward_flops_per_sample", lambda *args, **kwargs: None)


def without_final_checkpoint():
    """No checkpoint at the end of a run whose state is whole on every rank (one process, dp): there the save is the
    same code for every model (tests/test_checkpoint.py), and it cost about half of such a run here. The sharded
    layouts (tp, pp, ZeRO) still save, so each zoo model's state is still saved split as those layouts split it."""
    from unittest import mock
    return mock.patch("autopar.train.checkpointer.Checkpointer.save", lambda *args, **kwargs: None)


def train_cases(jobs: list[tuple[str, str]], out: str, **kwargs: Any) -> dict[tuple[str, str], dict]:
    """Train every (case, build) of `jobs` in one pool task (starting a task costs more than a tiny
    model's 2 steps). A case that raises gives {"error": traceback} and the next case still runs."""
    import traceback

    results = {}
    for index, (name, build) in enumerate(jobs):
        try:
            results[name, build] = train_case(name, build, str(Path(out) / str(index)), **kwargs)
        except Exception as exc:  # the test of that case reports it
            results[name, build] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    return results


def refusal(name: str, out: str, *, strategy: dict | None = None, micro_batch_size: int = GLOBAL_BATCH) -> dict:
    """Train a case of REFUSED_CASES that must be refused: the error (type and message) and whether any step ran."""
    try:
        train_case(name, REFUSED_CASES[name].builds[0], out, strategy=strategy, micro_batch_size=micro_batch_size,
                   refused=True)
    except Exception as exc:  # the test judges the type
        metrics = Path(out) / "metrics.jsonl"
        return {"error": type(exc).__name__, "autopar_error": isinstance(exc, autopar.AutoparError),
                "message": str(exc), "stepped": metrics.exists() and bool(metrics.read_text().strip())}
    return {"error": None, "stepped": True}
