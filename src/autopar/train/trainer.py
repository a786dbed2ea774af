"""The training loop behind both `autopar train` and the Python API.

    trainer = autopar.Trainer(model, train_data, strategy=autopar.Strategy(dp=2),
                              config=autopar.TrainConfig(steps=100))
    result = trainer.train()

The model is the user's, unmodified: it may be built on the meta device and is then
materialised on each rank from the seed (identically everywhere), or built for real, in
which case replica 0's weights are broadcast to the others. Every parallel layout trains
on the same global batches (data/sampler.py) with losses normalised over the whole global
batch (train/loss.py), so its losses match a single process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import tomli_w
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, default_collate

from .. import __version__
from ..config import JobConfig, Strategy, TrainConfig, to_dict, to_toml
from ..data.sampler import GlobalBatchSampler
from ..data_parallel import GradientSynchronizer
from ..distributed import DistEnv, init_distributed
from ..errors import ConfigError, DataError
from ..mesh import ProcessMesh
from ..models.materialize import materialize
from . import checkpoint as ckpt
from .loss import (Batch, LossFn, as_batch, count_targets, default_forward, main_input, token_loss_sum,
                   tokens_in)
from .metrics import MetricsLog, Progress, peak_memory_bytes
from .optim import build_optimizer, build_scheduler


@dataclass
class TrainResult:
    """What a run produced; identical on every rank."""

    run_dir: Path
    losses: list[float] = field(default_factory=list)  # one per step trained in this call
    first_step: int = 1  # the step number of losses[0]
    eval_loss: float | None = None


class Trainer:
    def __init__(self, model: nn.Module, train_data: Dataset, *, strategy: Strategy | None = None,
                 config: TrainConfig | None = None, eval_data: Dataset | None = None,
                 loss_fn: LossFn | None = None, forward_fn: Callable[[nn.Module, Batch], Any] | None = None,
                 job_config: JobConfig | None = None, run_info: dict[str, Any] | None = None):
        """
        loss_fn(output, batch) -> scalar: a mean over the micro-batch's samples. Default: token
            cross-entropy against batch["labels"] (-100 ignored), averaged over the global batch.
        forward_fn(model, batch) -> output. Default: model(batch["input_ids"] or batch["inputs"], **other fields).
        job_config / run_info: written to the run folder (the CLI passes its full config).
        """
        if not isinstance(model, nn.Module):
            raise ConfigError(f"Trainer needs an nn.Module as the model, got {type(model).__name__}")
        self.model, self.train_data, self.eval_data = model, train_data, eval_data
        self.strategy = strategy or Strategy()
        self.config = config or TrainConfig()
        self.loss_fn, self.forward_fn = loss_fn, forward_fn or default_forward
        self.job_config, self.run_info = job_config, dict(run_info or {})

    # ------------------------------------------------------------------ set-up

    def _validate(self) -> tuple[Strategy, int]:
        """Every check that needs no communication, so each rank fails the same way, early."""
        cfg = self.config
        cfg.validate()
        world = dist.get_world_size() if dist.is_initialized() else DistEnv.from_environ().world_size
        strategy = self.strategy.resolved(world)
        accumulation = cfg.accumulation_steps(strategy.dp)
        for name, data in (("train_data", self.train_data), ("eval_data", self.eval_data)):
            if data is not None and len(data) == 0:
                raise DataError(f"{name} is empty; it needs at least one sample")
        return strategy, accumulation

    def _setup(self) -> None:
        cfg = self.config
        self.strategy, self.accumulation = self._validate()
        init_distributed(cfg.device, cfg.timeout_s)
        self.mesh = ProcessMesh.build(self.strategy, device=cfg.device, timeout_s=cfg.timeout_s)
        self.dp_group = self.mesh.group("dp")
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
        self.model = materialize(self.model, self.device, seed=cfg.seed)
        self._broadcast_from_first_replica()
        torch.manual_seed(cfg.seed + 1 + dist.get_rank())  # dropout etc.: per-rank streams
        self.sync = GradientSynchronizer(self.model.parameters(), self.dp_group)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.sampler = GlobalBatchSampler(len(self.train_data), cfg.global_batch_size, seed=cfg.seed)
        self.is_main = dist.get_rank() == 0
        self.run_dir = self._make_run_dir()
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if cfg.dtype == "bf16"
                         else contextlib.nullcontext())

    def _broadcast_from_first_replica(self) -> None:
        """Make every replica start from replica 0's weights (a no-op for seeded meta materialisation)."""
        if self.mesh.dp_size == 1:
            return
        src = dist.get_global_rank(self.dp_group, 0)
        tensors = [t for t in self.model.state_dict(keep_vars=True).values()]
        seen, unique = set(), []
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                unique.append(t)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in unique:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                dist.broadcast(flat, src=src, group=self.dp_group)
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _make_run_dir(self) -> Path:
        out = self.config.out or f"runs/{datetime.now():%Y%m%d-%H%M%S}"
        shared = [out]
        dist.broadcast_object_list(shared, src=0)  # every rank uses rank 0's folder (its clock)
        run_dir = Path(shared[0])
        if self.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.toml").write_text(self._config_toml())
            info = {"autopar": __version__, "torch": torch.__version__, "world_size": dist.get_world_size(),
                    "strategy": to_dict(self.strategy), "accumulation_steps": self.accumulation,
                    "model_class": type(self.model).__name__, **self.run_info}
            (run_dir / "run.json").write_text(json.dumps(info, indent=2) + "\n")
        return run_dir

    def _config_toml(self) -> str:
        if self.job_config is not None:
            return to_toml(dataclasses.replace(self.job_config, strategy=self.strategy))
        return tomli_w.dumps({"strategy": to_dict(self.strategy), "train": to_dict(self.config)})

    # ------------------------------------------------------------------ steps

    def _load(self, indices: list[int], data: Dataset) -> Batch:
        batch = default_collate([as_batch(data[i]) for i in indices])
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _loss(self, output: Any, batch: Batch, global_count: torch.Tensor | None) -> torch.Tensor:
        if self.loss_fn is None:
            return token_loss_sum(output, batch) / global_count
        samples = len(main_input(batch))
        return self.loss_fn(output, batch) * (samples / self.config.global_batch_size)

    def _global_target_count(self, batches: list[Batch]) -> torch.Tensor | None:
        if self.loss_fn is not None:
            return None
        count = torch.tensor(float(sum(count_targets(b) for b in batches)), device=self.device)
        dist.all_reduce(count, group=self.dp_group)
        return count.clamp_min(1.0)

    def train_step(self, step: int) -> tuple[float, float, int]:
        """One optimizer step (0-based `step`): returns (loss, grad_norm, tokens in the global batch)."""
        cfg = self.config
        micro = self.sampler.local_micro_batches(step, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size,
                                                 micro_batch_size=cfg.micro_batch_size)
        batches = [self._load(indices, self.train_data) for indices in micro]
        global_count = self._global_target_count(batches)
        self.model.train()
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with (contextlib.nullcontext() if last else self.sync.no_sync()):
                with self.autocast:
                    loss = self._loss(self.forward_fn(self.model, batch), batch, global_count)
                loss.backward()
            total += loss.detach().float()
        self.sync.finish()
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.sync.params, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.sync.zero_grad()
        dist.all_reduce(total, group=self.dp_group)
        tokens = sum(tokens_in(b) for b in batches) * self.mesh.dp_size
        return float(total), float(grad_norm), tokens

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over `eval_batches` fixed global batches of the held-out data."""
        if self.eval_data is None:
            return None
        cfg = self.config
        sampler = GlobalBatchSampler(len(self.eval_data), cfg.global_batch_size, seed=cfg.seed, shuffle=False)
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for k in range(cfg.eval_batches):
            for indices in sampler.local_micro_batches(k, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size,
                                                       micro_batch_size=cfg.micro_batch_size):
                batch = self._load(indices, self.eval_data)
                with self.autocast:
                    output = self.forward_fn(self.model, batch)
                if self.loss_fn is None:
                    sums += torch.stack([token_loss_sum(output, batch).double(),
                                         torch.tensor(count_targets(batch), dtype=torch.float64)])
                else:
                    n = len(indices)
                    sums += torch.stack([self.loss_fn(output, batch).double() * n,
                                         torch.tensor(n, dtype=torch.float64)])
        dist.all_reduce(sums, group=self.dp_group)
        self.model.train()
        return float(sums[0] / sums[1].clamp_min(1))

    def save(self, step: int) -> Path:
        return ckpt.save_checkpoint(self.run_dir, step, self.model, self.optimizer,
                                    {"scheduler": self.scheduler.state_dict()})

    def _resume(self) -> int:
        path = ckpt.find_checkpoint(self.config.resume)
        state = ckpt.load_checkpoint(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.sync.zero_grad()
        return int(state["step"])

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        self._setup()
        cfg = self.config
        start = self._resume() if cfg.resume else 0
        if start > cfg.steps:
            raise ConfigError(f"the checkpoint is at step {start}, beyond --steps {cfg.steps}; raise --steps")
        if self.is_main and start:
            _truncate_metrics(self.run_dir / "metrics.jsonl", start)
        metrics = MetricsLog(self.run_dir / "metrics.jsonl" if self.is_main else None)
        progress = Progress(total=cfg.steps, initial=start, enabled=self.is_main and cfg.progress)
        progress.write(self._banner(start))
        result = TrainResult(run_dir=self.run_dir, first_step=start + 1)
        world = dist.group.WORLD
        try:
            for step in range(start, cfg.steps):
                lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
                began = time.perf_counter()
                loss, grad_norm, tokens = self.train_step(step)
                elapsed = time.perf_counter() - began
                peak = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.float64, device=self.device)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=world)
                result.losses.append(loss)
                number = step + 1
                record = {"step": number, "loss": loss, "lr": lr,
                          "grad_norm": grad_norm, "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
                          "peak_mem_bytes": int(peak.item())}
                if cfg.eval_every and number % cfg.eval_every == 0 and number != cfg.steps:
                    record["eval_loss"] = self.evaluate()
                if number == cfg.steps:
                    result.eval_loss = record["eval_loss"] = self.evaluate()
                if number % cfg.log_every == 0 or number == cfg.steps or "eval_loss" in record:
                    metrics.write(record)
                progress.update(loss=loss, tokens_per_s=record["tokens_per_s"], lr=record["lr"])
                if cfg.checkpoint_every and number % cfg.checkpoint_every == 0 and number != cfg.steps:
                    self.save(number)
            if cfg.steps > start:
                self.save(cfg.steps)
        finally:
            progress.close()
            metrics.close()
            self.sync.remove()
        if self.is_main:
            summary = {"steps": cfg.steps, "final_loss": result.losses[-1] if result.losses else None,
                       "eval_loss": result.eval_loss, "run_dir": str(self.run_dir)}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(f"done: {cfg.steps} steps, final loss {summary['final_loss']}, eval loss "
                  f"{result.eval_loss if result.eval_loss is not None else 'n/a'}; run folder {self.run_dir}",
                  flush=True)
        dist.barrier()  # when train() returns, on any rank, the run folder is complete
        return result

    def _banner(self, start: int) -> str:
        params = sum(p.numel() for p in self.sync.params)
        lines = [f"autopar {__version__}: {dist.get_world_size()} process(es), strategy dp={self.strategy.dp} "
                 f"tp={self.strategy.tp} pp={self.strategy.pp}, {params:,} parameters, "
                 f"{self.accumulation} micro-batch(es) of {self.config.micro_batch_size} per replica per step",
                 f"run folder: {self.run_dir}"]
        lines += [f"{k}: {v}" for k, v in self.run_info.items() if k in ("corpus", "model")]
        if start:
            lines.append(f"resumed at step {start} from {self.config.resume}")
        return "\n".join(lines)


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop records of steps after the checkpoint (they will be redone)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))
