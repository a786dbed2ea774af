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
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import tomli_w
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, default_collate

from .config import JobConfig, Strategy, TrainConfig, to_dict, to_toml
from .data.sampler import GlobalBatchSampler
from .distributed import DistEnv, init_distributed
from .dropout import dropout_step
from .errors import ConfigError, DataError, TrainingError
from .mesh import ProcessMesh
from .strategies import Resolved, resolve
from .train import checkpoint as ckpt
from .train.base import Engine, EngineContext, TrainResult
from .train.engine import eval_token_sums
from .train.loss import Batch, LossFn, as_batch, count_targets, default_forward, main_input, tokens_in
from .train.metrics import MetricsLog, Progress, peak_memory_bytes
from .train.optim import build_scheduler
from .version import __version__


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

    def _validate(self) -> Resolved:
        """Every check that needs no communication (strategies.resolve), so each rank fails the same way, early."""
        world = dist.get_world_size() if dist.is_initialized() else DistEnv.from_environ().world_size
        resolved = resolve(self.strategy, self.config, world, custom_forward=self.forward_fn is not default_forward)
        for name, data in (("train_data", self.train_data), ("eval_data", self.eval_data)):
            if data is not None and len(data) == 0:
                raise DataError(f"{name} is empty; it needs at least one sample")
        return resolved

    def _setup(self) -> None:
        resolved = self._validate()
        self.strategy, self.config, self.accumulation = resolved.strategy, resolved.config, resolved.accumulation
        self.loop = resolved.entry.loop
        cfg = self.config
        init_distributed(cfg.device, cfg.timeout_s)
        self.mesh = ProcessMesh.build(self.strategy, device=cfg.device, timeout_s=cfg.timeout_s)
        self.dp_group = self.mesh.group("dp")
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
        self.autocast = ((lambda: torch.autocast(self.device.type, dtype=torch.bfloat16))
                         if cfg.dtype == "bf16-autocast"
                         else contextlib.nullcontext)
        self.sampler = GlobalBatchSampler(len(self.train_data), cfg.global_batch_size, seed=cfg.seed)
        first = lambda: self.sampler.local_micro_batches(0, dp_rank=0, dp_size=self.strategy.dp,  # noqa: E731
                                                         micro_batch_size=cfg.micro_batch_size)[0]
        self.engine: Engine = resolved.entry.build(EngineContext(
            model=self.model, mesh=self.mesh, strategy=self.strategy, config=cfg, device=self.device,
            autocast=self.autocast, forward_fn=self.forward_fn, accumulation=self.accumulation,
            example_batch=lambda: self.load(first(), self.train_data),
            batches_for_step=lambda step: self._local_batches(step, self.train_data)))
        self.run_info.update(self.engine.run_info())
        self.model = self.engine.module
        # other random ops: one stream per tp group (tp is innermost), so replicated regions agree; dropout
        # masks do not use it (autopar/dropout: a function of seed, step, sample and operation)
        torch.manual_seed(cfg.seed + 1 + dist.get_rank() // self.strategy.tp)
        self.optimizer = self.engine.build_optimizer(cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.is_main = dist.get_rank() == 0
        self.run_dir = self._make_run_dir()

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
            for name, text in self.engine.run_files().items():  # what the engine chose (tp_plan.txt)
                (run_dir / name).write_text(text)
        return run_dir

    def _config_toml(self) -> str:
        if self.job_config is not None:
            return to_toml(dataclasses.replace(self.job_config, strategy=self.strategy))
        return tomli_w.dumps({"strategy": to_dict(self.strategy), "train": to_dict(self.config)})

    # ------------------------------------------------------------------ steps

    @property
    def token_loss(self) -> bool:
        """The default loss: token cross-entropy normalised by the global target count."""
        return self.loss_fn is None

    def load(self, indices: list[int], data: Dataset) -> Batch:
        batch = default_collate([as_batch(data[i]) for i in indices])
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def loss(self, output: Any, batch: Batch, global_count: torch.Tensor | None) -> torch.Tensor:
        if self.loss_fn is None:
            return self.engine.token_loss_sum(output, batch) / global_count
        if self.engine.tensor_parallel is not None:  # a custom loss sees whole logits
            output = self.engine.tensor_parallel.full_output(output)
        samples = len(main_input(batch))
        return self.loss_fn(output, batch) * (samples / self.config.global_batch_size)

    def _global_target_count(self, batches: list[Batch]) -> torch.Tensor | None:
        if self.loss_fn is not None:
            return None
        count = torch.tensor(float(sum(count_targets(b) for b in batches)), device=self.device)
        dist.all_reduce(count, group=self.dp_group)
        return count.clamp_min(1.0)

    def _local_batches(self, step: int, data: Dataset) -> list[Batch]:
        micro = self.sampler.local_micro_batches(step, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size,
                                                 micro_batch_size=self.config.micro_batch_size)
        return [self.load(indices, data) for indices in micro]

    def train_step(self, step: int) -> tuple[float, float, int]:
        """One optimizer step (0-based `step`): returns (loss, grad_norm, tokens in the global batch)."""
        cfg = self.config
        batches = self._local_batches(step, self.train_data)
        global_count = self._global_target_count(batches)
        samples = self.sampler.local_micro_positions(step, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size,
                                                     micro_batch_size=cfg.micro_batch_size)
        with dropout_step(cfg.seed, step, samples):  # masks as one process draws them (autopar/dropout)
            total = self.engine.forward_backward(batches, lambda out, batch: self.loss(out, batch, global_count))
        grad_norm = self.engine.clip_gradients(cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.engine.zero_grad()
        total = total.detach().float().reshape(())
        dist.all_reduce(total)  # every rank that holds a loss share (replicas; the last pipeline stage)
        tokens = sum(tokens_in(b) for b in batches) * self.mesh.dp_size
        return float(total), grad_norm, tokens

    def _eval_pair(self, output: Any, batch: Batch) -> torch.Tensor:
        """[loss sum, weight] of one eval micro-batch."""
        if self.loss_fn is None:
            return eval_token_sums(output, batch, self.engine.token_loss_sum)
        if self.engine.tensor_parallel is not None:
            output = self.engine.tensor_parallel.full_output(output)
        n = len(main_input(batch))
        return torch.stack([self.loss_fn(output, batch).double() * n,
                            torch.tensor(float(n), dtype=torch.float64, device=self.device)])

    def evaluate(self, replica: tuple[int, int] | None = None) -> float | None:
        """Mean loss over `eval_batches` fixed global batches of the held-out data.

        `replica` is (index, count) of this rank among the ranks that split the eval batches, exactly as the
        training batches are split (default: its dp coordinates); (0, 0) takes part in the sum only. The split
        must be the training split: a parameter server's lone worker then evaluates the whole batch in one
        micro-batch as one process does, the same reduction in the same precision.
        """
        if self.eval_data is None:
            return None
        cfg = self.config
        index, count = replica if replica is not None else (self.mesh.dp_rank, self.mesh.dp_size)
        sampler = GlobalBatchSampler(len(self.eval_data), cfg.global_batch_size, seed=cfg.seed, shuffle=False)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for k in range(cfg.eval_batches if count else 0):
            micro = sampler.local_micro_batches(k, dp_rank=index, dp_size=count, micro_batch_size=cfg.micro_batch_size)
            sums += self.engine.eval_sums([self.load(indices, self.eval_data) for indices in micro], self._eval_pair)
        dist.all_reduce(sums)
        return float(sums[0] / sums[1].clamp_min(1))

    def save(self, step: int) -> Path:
        self.engine.before_checkpoint()  # e.g. gossip: the replicas' mean; sparse: deferred rows landed
        return ckpt.save_checkpoint(self.run_dir, step, self.model, self.optimizer,
                                    {"scheduler": self.scheduler.state_dict()}, self.engine.tensor_parallel)

    def _resume(self) -> int:
        path = ckpt.find_checkpoint(self.config.resume)
        state = ckpt.load_checkpoint(path, self.model, self.optimizer, self.engine.tensor_parallel)
        self.scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr  # the rate the checkpointed step would use next
        self.engine.zero_grad()
        return int(state["step"])

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        self._setup()
        if self.loop is not None:  # e.g. the parameter server: servers serve, workers run ahead
            return self.loop(self)
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
                if not math.isfinite(loss):  # the same summed loss on every rank: all stop together
                    raise TrainingError(_non_finite_message(loss, step + 1, lr, grad_norm, self.run_dir))
                elapsed = time.perf_counter() - began
                peak = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.float64, device=self.device)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=world)
                result.losses.append(loss)
                number = step + 1
                record = {"step": number, "loss": loss, "lr": lr,
                          "grad_norm": grad_norm, "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
                          "peak_mem_bytes": int(peak.item())}
                record.update(self.engine.step_stats(elapsed, peak_memory_bytes(self.device)))
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
            self.engine.finish_run(self.run_dir, cfg, self.strategy)  # e.g. the pipeline's --trace timeline
        finally:
            progress.close()
            metrics.close()
            self.engine.close()
        return self.close_run(result)

    def close_run(self, result: TrainResult) -> TrainResult:
        """summary.json and the "done:" line on rank 0; returns once the run folder is complete on every rank."""
        if self.is_main:
            summary = {"steps": self.config.steps, "final_loss": result.losses[-1] if result.losses else None,
                       "eval_loss": result.eval_loss, "run_dir": str(self.run_dir)}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(f"done: {self.config.steps} steps, final loss {summary['final_loss']}, eval loss "
                  f"{result.eval_loss if result.eval_loss is not None else 'n/a'}; run folder {self.run_dir}",
                  flush=True)
        dist.barrier()  # when train() returns, on any rank, the run folder is complete
        return result

    def _banner(self, start: int) -> str:
        params = self.engine.num_parameters()
        lines = [f"autopar {__version__}: {dist.get_world_size()} process(es), strategy dp={self.strategy.dp} "
                 f"tp={self.strategy.tp} pp={self.strategy.pp}, {params:,} parameters, "
                 f"{self.accumulation} micro-batch(es) of {self.config.micro_batch_size} per replica per step",
                 f"run folder: {self.run_dir}"]
        lines += [f"{k}: {v}" for k, v in self.run_info.items() if k in ("corpus", "model")]
        lines += self.engine.banner_lines()
        if start:
            lines.append(f"resumed at step {start} from {self.config.resume}")
        return "\n".join(lines)


def _non_finite_message(loss: float, step: int, lr: float, grad_norm: float, run_dir: Path) -> str:
    return (f"the loss is {loss} at step {step} (lr {lr:g}, gradient norm {grad_norm:g}); training stopped rather "
            f"than go on with non-finite weights. Lower the learning rate (--lr) or clip gradients (--grad-clip), "
            f"or look in the model and loss for a log, division or square root of a value that can reach zero "
            f"or below; {run_dir}/metrics.jsonl has the steps before")


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop records of steps after the checkpoint (they will be redone)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))
