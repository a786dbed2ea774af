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
import hashlib
import json
import math
import os
import shutil
import time
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, default_collate

from .config import JobConfig, Strategy, TrainConfig, to_dict
from .data.sampler import GlobalBatchSampler
from .distributed import DistEnv, destroy_groups, init_distributed, process_groups
from .dropout import dropout_step
from .errors import ConfigError, DataError, Preempted, TrainingError
from .launch import ATTEMPT_ENV, restart_attempt
from .mesh import ProcessMesh
from .models.materialize import attach_init_fn
from .search.auto import Measured, Plan
from .strategies import Resolved, resolve
from .train import checkpoint as ckpt
from .train.base import Engine, EngineContext, TrainResult
from .train.deferred import DeferredSteps, Finished, StepResult
from .train.engine import eval_token_sums
from .train.faults import Fault
from .train.fields import example_call
from .train.interrupt import StopRequest
from .train.resume import agree_on_resume_checkpoint
from .train.shared_failure import failures_shared, run_set_up
from .train.loss import (Batch, LossFn, align_labels, as_batch, default_forward, label_shift, main_input, target_count,
                         tokens_in)
from .train.metrics import MetricsLog, Progress, peak_memory_bytes
from .train.optim import build_scheduler, check_trainable
from .train.run_folder import config_toml, log_restart, non_finite_message, truncate_metrics, write_run_folder
from .train.watchdog import Watchdog
from .timing import StepTimer
from .version import __version__


HOST_SYNCS_PER_STEP = ("clip_gradients", "_train_step")
"""Where a training step makes the host wait for the device, once each: the engine's gradient
norm (to clip and to log) and one read of the summed loss with the peak memory (to log).
Steps that write metrics add the engine's `step_stats` (one read on a pipeline); a pipeline's
first step reads the shapes of its transfers (p2p metadata). tests/test_host_syncs.py counts."""


class Trainer:
    def __init__(self, model: nn.Module, train_data: Dataset, *, strategy: Strategy | Plan | None = None,
                 config: TrainConfig | None = None, eval_data: Dataset | None = None,
                 loss_fn: LossFn | None = None, forward_fn: Callable[[nn.Module, Batch], Any] | None = None,
                 job_config: JobConfig | None = None, run_info: dict[str, Any] | None = None,
                 pretrained: Any = None, run_files: dict[str, str] | None = None,
                 label_convention: str | None = None, init_fn: Callable[[nn.Module], None] | None = None):
        """
        loss_fn(output, batch) -> scalar: a mean over the micro-batch's samples. Default: token
            cross-entropy against batch["labels"] (-100 ignored), averaged over the global batch.
        label_convention: how the default loss lines labels up with the output (train/loss.py). "model" follows
            the model: a Hugging Face causal LM's labels are its input ids (scored against the next position, as
            its own loss does), any other model's labels[i] is the target of output position i. "aligned":
            labels are token-aligned for every model; "causal": labels are the input ids for every model (scored
            against the next position). Default: the train data's `label_convention` attribute
            (autopar's built-in datasets say "aligned": their labels are the next tokens already), else "model".
        init_fn(model): initialises a model built on meta, instead of its reset_parameters / init_weights rules:
            for a constructor that does more than they can see (nanoGPT's re-initialisation by name). Run on the
            whole model under the seed on every rank, so every layout gets one process's values.
            `autopar.replay_init(lambda: MyModel(...))` reruns the constructor itself (models/materialize.py).
        forward_fn(model, batch) -> output. Default: model(batch["input_ids"] or batch["inputs"], **other fields).
        job_config / run_info: written to the run folder (the CLI passes its full config).
        strategy: a Strategy, `Strategy.auto(...)` (searched when training starts), or a Plan (`plan_auto`).
        pretrained: a models.pretrained.PretrainedWeights checked against `model` (on meta): each rank reads
            the values of just the tensors (and tensor-parallel slices) it holds, instead of the seeded init.
        run_files: extra {file name: text} written into the run folder (a Hugging Face config, a tokenizer).
        """
        if not isinstance(model, nn.Module):
            raise ConfigError(f"Trainer needs an nn.Module as the model, got {type(model).__name__}")
        if init_fn is not None:
            attach_init_fn(model, init_fn)
        self.model, self.train_data, self.eval_data = model, train_data, eval_data
        self.plan = strategy if isinstance(strategy, Plan) else None
        self.strategy = Strategy() if self.plan is not None or strategy is None else strategy
        self.config = config or TrainConfig()
        self.loss_fn, self.forward_fn = loss_fn, forward_fn or default_forward
        self.job_config, self.run_info = job_config, dict(run_info or {})
        self.pretrained, self.extra_run_files = pretrained, dict(run_files or {})
        self.pretrained_bytes_read = 0
        self.random_ops_checked = False  # the first step scans a model run whole for random draws (dropout/eager.py)
        self.step_times_s: list[float] = []
        convention = label_convention or getattr(train_data, "label_convention", "model")
        self.shift_labels = label_shift(model, convention) and loss_fn is None  # a custom loss sees labels as given

    # ------------------------------------------------------------------ set-up

    def _validate(self) -> Resolved:
        """Every check that needs no communication (strategies.resolve), so each rank fails the same way, early."""
        check_trainable(self.model)
        world = dist.get_world_size() if dist.is_initialized() else DistEnv.from_environ().world_size
        if self.strategy.confirm and self.plan is None and not self.strategy.plan:
            raise ConfigError(f"--confirm {self.strategy.confirm} runs the top plans as separate short jobs, which "
                              f"only `autopar train` can start; in Python, measure plans yourself or use confirm=0")
        resolved = resolve(self.strategy, self.config, world, custom_forward=self.forward_fn is not default_forward,
                           pretrained=self.pretrained is not None, model=self.model,
                           example=lambda: example_call(self.model, self.train_data), plan=self.plan)
        for name, data in (("train_data", self.train_data), ("eval_data", self.eval_data)):
            if data is not None and len(data) == 0:
                raise DataError(f"{name} is empty; it needs at least one sample")
        return resolved

    def _setup(self) -> None:
        self.fault = Fault.from_environ()  # test hook (train/faults.py); a malformed value fails every rank here
        self.attempt = restart_attempt()
        resolved = self._validate()
        self.strategy, self.config, self.accumulation = resolved.strategy, resolved.config, resolved.accumulation
        self.loop = resolved.entry.loop
        self.plan = resolved.plan
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
            batches_for_step=lambda step: self._local_batches(step, self.train_data),
            samples_for_step=lambda step: self.sampler.local_micro_positions(
                step, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size, micro_batch_size=cfg.micro_batch_size)))
        self.run_info.update(self.engine.run_info())
        self.model = self.engine.module
        if self.pretrained is not None and not cfg.resume:  # a resumed run takes every weight from its checkpoint
            self._load_pretrained()
        # other random ops: one stream per tp group (tp is innermost), so replicated regions agree; dropout
        # masks do not use it (autopar/dropout: a function of seed, step, sample and operation)
        torch.manual_seed(cfg.seed + 1 + self.mesh.tp_group_index)
        self.optimizer = self.engine.build_optimizer(cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.deferred = None  # engines whose update may wait for the next step (train/deferred.py)
        if getattr(self.engine, "deferred_rule", None) is not None:
            pp, dp = self.strategy.pp, self.mesh.dp_size
            slot = self.mesh.local_rank("pp") * dp + self.mesh.local_rank("dp")
            self.deferred = DeferredSteps(engine=self.engine, optimizer=self.optimizer, scheduler=self.scheduler,
                                          grad_clip=cfg.grad_clip, device=self.device, pp=pp, slot=slot, slots=pp * dp)
        self.is_main = dist.get_rank() == 0
        self.run_dir = self._make_run_dir()

    def _load_pretrained(self) -> None:
        """This rank's tensors (its stage, its tensor-parallel slices) read from the pretrained files."""
        tp = self.engine.tensor_parallel
        began = time.perf_counter()
        self.pretrained_bytes_read = self.pretrained.load_into(self.model, None if tp is None else tp.file_slices)
        self.pretrained_load_s = time.perf_counter() - began
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (self.pretrained_bytes_read, self.pretrained_load_s))
        self.run_info["pretrained"] = (f"{self.pretrained.folder} (MB read per rank: "
                                       f"{[round(b / 1e6, 2) for b, _ in per_rank]})")
        self.run_info["pretrained_bytes_read"] = [b for b, _ in per_rank]
        self.run_info["pretrained_load_s"] = [round(s, 3) for _, s in per_rank]

    def _make_run_dir(self) -> Path:
        out = self.config.out or f"runs/{datetime.now():%Y%m%d-%H%M%S}"
        shared = [out]
        dist.broadcast_object_list(shared, src=0)  # every rank uses rank 0's folder (its clock)
        run_dir = Path(shared[0])
        self._fresh_run_dir = self.is_main and not run_dir.exists()  # removed again if we fail before step 1
        if self.is_main:
            info = {"autopar": __version__, "torch": torch.__version__, "world_size": dist.get_world_size(),
                    "strategy": to_dict(self.strategy), "accumulation_steps": self.accumulation,
                    "model_class": type(self.model).__name__, **self.run_info}
            write_run_folder(run_dir, config=self._config_toml(), info=info,
                             files={**self.engine.run_files(), **self.extra_run_files})
            if self.plan is not None:  # --strategy auto / --plan: what was chosen and predicted
                self.plan.record.pop("measured", None)  # a rerun plan's old measurements belong to its old run
                self.plan.save(run_dir / "plan.json")
        return run_dir

    def _config_toml(self) -> str:
        return config_toml(self.strategy, self.config, self.job_config, planned=self.plan is not None)

    # ------------------------------------------------------------------ steps

    @property
    def token_loss(self) -> bool:
        """The default loss: token cross-entropy normalised by the global target count."""
        return self.loss_fn is None

    def load(self, indices: list[int], data: Dataset) -> Batch:
        batch = align_labels(default_collate([as_batch(data[i]) for i in indices]), self.shift_labels)
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
        # counted on the device: a host count would wait for the batch to land on the GPU
        count = torch.stack([target_count(b) for b in batches]).sum().float()
        with self.engine.waits.timed("data_parallel"):
            dist.all_reduce(count, group=self.dp_group)
        return count.clamp_min(1.0)

    def _local_batches(self, step: int, data: Dataset) -> list[Batch]:
        micro = self.sampler.local_micro_batches(step, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size,
                                                 micro_batch_size=self.config.micro_batch_size)
        return [self.load(indices, data) for indices in micro]

    def train_step(self, step: int, *, stop_requested: bool = False, poison_loss: bool = False) -> StepResult:
        """One optimizer step (0-based `step`). A step whose loss or gradient norm is not finite on any rank
        is skipped on every rank (no update). `stop_requested` (this rank got SIGTERM/SIGINT) travels in the
        same all-reduce as the loss, so every rank learns whether any rank asked to stop."""
        return self._train_step(step, stop_requested=stop_requested, poison_loss=poison_loss)

    def _step_inputs(self, step: int, poison_loss: bool) -> tuple[list[Batch], Any, Callable]:
        """This rank's micro-batches of `step`, their global sample positions (dropout masks) and the loss."""
        batches = self._local_batches(step, self.train_data)
        global_count = self._global_target_count(batches)
        samples = self.sampler.local_micro_positions(step, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size,
                                                     micro_batch_size=self.config.micro_batch_size)

        def loss_fn(output: Any, batch: Batch) -> torch.Tensor:
            loss = self.loss(output, batch, global_count)
            return loss * float("nan") if poison_loss else loss  # poison: fault injection (train/faults.py)

        return batches, samples, loss_fn

    def _train_step(self, step: int, *, stop_requested: bool = False, poison_loss: bool = False) -> StepResult:
        """`train_step`, with the peak memory over all ranks (bytes).

        Its host waits (HOST_SYNCS_PER_STEP): the engine's gradient norm, and one read of the
        summed loss, the skip and stop flags and the peak memory, before the update they decide.
        """
        cfg = self.config
        batches, samples, loss_fn = self._step_inputs(step, poison_loss)
        with dropout_step(cfg.seed, step, samples, scan_random_ops=self._first_scan()):  # masks as one process draws
            total = self.engine.forward_backward(batches, loss_fn)
        grad_norm = self.engine.clip_gradients(cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        # [loss share, bad gradient norm, stop requested], summed over every rank that holds a loss share
        # (replicas; the last pipeline stage), and the peak memory: read once, before the update they decide
        bad_norm = grad_norm is not None and not math.isfinite(grad_norm)  # None: the engine has no norm here
        flags = torch.tensor([0.0, float(bad_norm), float(stop_requested)], device=self.device)
        flags[0] = total.detach().float().reshape(())
        with self.engine.waits.timed("pipeline"):  # every rank meets here (a pipeline's flush ends here)
            dist.all_reduce(flags)
        peak = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.float64, device=self.device)
        with self.engine.waits.timed("pipeline"):
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        loss, bad_norm, stop, peak_bytes = torch.cat([flags.double(), peak]).tolist()  # one host read; exact
        skipped = not math.isfinite(loss) or bad_norm > 0
        if not skipped:
            self.optimizer.step()
        self.scheduler.step()  # the schedule follows the step number, skipped steps included
        self.engine.zero_grad()
        tokens = sum(tokens_in(b) for b in batches) * self.mesh.dp_size
        return StepResult(loss, grad_norm, tokens, skipped=skipped, stop=stop > 0, peak_bytes=int(peak_bytes))

    def _first_scan(self) -> bool:
        """True on this trainer's first step only: it checks every operation for random draws (~20% of a small
        model's step on the whole-model engines); later steps check only the torch calls the model makes."""
        first, self.random_ops_checked = not self.random_ops_checked, True
        return first

    def _run_step(self, step: int, *, stop_requested: bool = False, poison_loss: bool = False) -> list[Finished]:
        """Step `step`, and every step whose result is known now (in order): the step itself on a synchronous
        engine; on a deferred one (train/deferred.py) the steps settled during this one, possibly none."""
        self.engine.waits.start_step()  # where the step's time starts (StepTimer here, `began` below)
        if self.deferred is None:
            lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
            return [Finished(step + 1, self._train_step(step, stop_requested=stop_requested, poison_loss=poison_loss),
                             lr)]
        began = time.perf_counter()
        cfg = self.config
        batches, samples, loss_fn = self._step_inputs(step, poison_loss)

        def forward_backward() -> torch.Tensor:
            with dropout_step(cfg.seed, step, samples, scan_random_ops=self._first_scan()):
                return self.engine.forward_backward(batches, loss_fn)
        return self.deferred.step(step, forward_backward, tokens=sum(tokens_in(b) for b in batches) * self.mesh.dp_size,
                                  stop_requested=stop_requested, began=began)

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
        info = {"layout": to_dict(self.strategy),
                "config_sha256": hashlib.sha256(self._config_toml().encode()).hexdigest()}
        return ckpt.save_checkpoint(self.run_dir, step, self.model, self.optimizer,
                                    {"scheduler": self.scheduler.state_dict()}, self.engine.tensor_parallel,
                                    manifest_info=info, keep=self.config.keep_checkpoints)

    def _resume(self, path: Path) -> int:
        state = ckpt.load_checkpoint(path, self.model, self.optimizer, self.engine.tensor_parallel)
        self.scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr  # the rate the checkpointed step would use next
        self.engine.zero_grad()
        return int(state["step"])

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        before = process_groups()
        try:
            return self._train()
        finally:  # the mesh's and the engine's groups, for close()
            self._groups = process_groups() - before

    def close(self) -> None:
        """Destroy the process groups train() created (mesh, engine), once every rank is done with them (a
        barrier). The trained model's collectives (gathering whole tensors) no longer work afterwards; a process
        that trains again later does not carry this run's idle groups (each keeps gloo threads of its own)."""
        groups, self._groups = getattr(self, "_groups", set()), set()
        if groups:
            dist.barrier()
            destroy_groups(groups)

    def _train(self) -> TrainResult:
        run_set_up(self._setup, model=self.model, timeout_s=self.config.timeout_s, forget=self._forget_engine)
        if self.loop is not None:  # e.g. the parameter server: servers serve, workers run ahead
            return self.loop(self)
        cfg = self.config
        try:
            self.resumed_from = agree_on_resume_checkpoint(self.run_dir, self.config.resume,
                                                           restarted=self.attempt > 0)
            start = self._resume(self.resumed_from) if self.resumed_from is not None else 0
            if start > cfg.steps:
                raise ConfigError(f"the checkpoint is at step {start}, beyond --steps {cfg.steps}; raise --steps")
        except BaseException:
            self._discard_fresh_run_dir()
            raise
        if self.is_main and (start or self.attempt):
            truncate_metrics(self.run_dir / "metrics.jsonl", start)
        if self.is_main and self.attempt and ATTEMPT_ENV not in os.environ:  # torchrun restarted us
            log_restart(self.run_dir, {"restart": self.attempt, "by": "torchrun", "world_size": dist.get_world_size(),
                                        "cause": "torchrun restarted the workers (see its log)",
                                        "resumes_from": self.resumed_from and self.resumed_from.name})
        metrics = MetricsLog(self.run_dir / "metrics.jsonl" if self.is_main else None)
        progress = Progress(total=cfg.steps, initial=start, enabled=self.is_main and cfg.progress)
        progress.write(self._banner(start))
        result = TrainResult(run_dir=self.run_dir, first_step=start + 1)
        rank, every = dist.get_rank(), cfg.checkpoint_interval
        bad_in_a_row = bad_total = 0
        stop_request = StopRequest(rank)
        watchdog = Watchdog(cfg.hang_timeout_s, rank=rank, run_dir=self.run_dir)
        timer = StepTimer(self.device)  # CUDA events on GPU: timing adds no host wait
        try:
            with stop_request, watchdog, failures_shared(lambda: watchdog.phase, forget=self._forget_engine):
                seconds: dict[int, float] = {}  # step number -> this rank's time for it (its own call)
                for step in range(start, cfg.steps):
                    watchdog.progress(f"step {step + 1}")
                    if self.fault is not None:
                        self.fault.strike(rank, step + 1, self.attempt)
                    timer.start()
                    queue = deque(self._run_step(step, stop_requested=stop_request.requested,
                                                 poison_loss=self.fault is not None and
                                                 self.fault.poisons_loss(rank, step + 1, self.attempt)))
                    timer.stop()
                    seconds[step + 1] = timer.seconds()
                    stopping = None  # the number of the step a stop was requested in
                    while queue:  # in step order; a deferred engine reports a step or more late
                        finished = queue.popleft()
                        number, out, lr = finished.number, finished.result, finished.lr
                        loss, grad_norm, tokens = out.loss, out.grad_norm, out.tokens
                        bad_in_a_row = bad_in_a_row + 1 if out.skipped else 0
                        bad_total += out.skipped
                        if bad_in_a_row > cfg.max_bad_steps:  # the same sums on every rank: all stop together
                            raise TrainingError(non_finite_message(loss, number, lr, grad_norm, self.run_dir,
                                                                    bad_in_a_row, cfg.max_bad_steps))
                        elapsed = seconds.pop(number)
                        result.losses.append(loss)
                        self.step_times_s.append(elapsed)  # this rank's clock (plan.json's measured step time)
                        record = {"step": number, "loss": loss if math.isfinite(loss) else None, "lr": lr,
                                  "grad_norm": (grad_norm if grad_norm is not None and math.isfinite(grad_norm)
                                                else None),
                                  "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
                                  "peak_mem_bytes": out.peak_bytes}
                        if bad_total:
                            record.update(skipped=out.skipped, bad_steps=bad_total)
                        logged = number % cfg.log_every == 0 or number == cfg.steps or (
                            cfg.eval_every and number % cfg.eval_every == 0)
                        if logged:  # the engine's own statistics cost a collective and a host read: only when written
                            record.update(finished.stats if finished.stats is not None else
                                          self.engine.step_stats(elapsed, peak_memory_bytes(self.device)))
                        if cfg.eval_every and number % cfg.eval_every == 0 and number != cfg.steps:
                            watchdog.progress(f"evaluation after step {number}")
                            record["eval_loss"] = self.evaluate()
                        if number == cfg.steps:
                            watchdog.progress(f"evaluation after step {number}")
                            result.eval_loss = record["eval_loss"] = self.evaluate()
                        if number % cfg.log_every == 0 or number == cfg.steps or "eval_loss" in record:
                            metrics.write(record)
                        progress.update(loss=loss, tokens_per_s=record["tokens_per_s"], lr=record["lr"])
                        if out.stop and stopping is None and number != cfg.steps:  # a signal on some rank
                            stopping = number
                            if self.deferred is not None:  # later steps already ran: settle them, drop the rest
                                queue.extend(self.deferred.settle())
                                self.engine.abandon_in_flight()
                        if every and number % every == 0 and number != cfg.steps and stopping is None:
                            watchdog.progress(f"checkpoint of step {number}")
                            self.save(number)
                    if stopping is not None and number != cfg.steps:  # save the last step settled, leave together
                        watchdog.progress(f"checkpoint of step {number} (stopping on a signal)")
                        saved = self.save(number)
                        raise Preempted(f"stopped on a signal after step {number} of {cfg.steps}; checkpoint "
                                        f"{saved}; continue with: autopar train --resume {self.run_dir}")
                if cfg.steps > start:
                    watchdog.progress(f"checkpoint of step {cfg.steps}")
                    self.save(cfg.steps)
                if cfg.export_hf:
                    watchdog.progress(f"export to {cfg.export_hf}")
                    self.export_hf(cfg.export_hf)
                watchdog.progress("finishing the run")
                self.engine.finish_run(self.run_dir, cfg, self.strategy)  # e.g. the pipeline's --trace timeline
        finally:
            progress.close()
            metrics.close()
            if hasattr(self, "engine"):  # (gone after a failure: _forget_engine)
                self.engine.close()
        return self.close_run(result)

    def _forget_engine(self) -> None:
        """After a failure: drop what holds this run's process groups, so they can be torn down (shared_failure)."""
        with contextlib.suppress(Exception):  # (no engine yet; or closing it fails too: the failure is the report)
            self.__dict__.pop("engine").close()
        for name in ("mesh", "dp_group", "optimizer", "scheduler", "deferred"):
            self.__dict__.pop(name, None)

    def _discard_fresh_run_dir(self) -> None:
        """A run that fails before its first step leaves no run folder behind (unless it existed before)."""
        if getattr(self, "_fresh_run_dir", False):
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def export_hf(self, out: str) -> Path:
        """The latest checkpoint as a Hugging Face folder; every rank writes some of its shards (collective)."""
        from .train.hf_export import export_hf
        dist.barrier()
        path = export_hf(self.run_dir, out, rank=dist.get_rank(), world=dist.get_world_size())
        dist.barrier()
        if self.is_main:
            print(f"exported to {path} (Hugging Face format)", flush=True)
        return path

    def close_run(self, result: TrainResult) -> TrainResult:
        """summary.json and the "done:" line on rank 0; returns once the run folder is complete on every rank."""
        if self.plan is not None and self.step_times_s:
            self._record_measured()
        if self.is_main:
            summary = {"steps": self.config.steps, "final_loss": result.losses[-1] if result.losses else None,
                       "eval_loss": result.eval_loss, "run_dir": str(self.run_dir)}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(f"done: {self.config.steps} steps, final loss {summary['final_loss']}, eval loss "
                  f"{result.eval_loss if result.eval_loss is not None else 'n/a'}; run folder {self.run_dir}",
                  flush=True)
        dist.barrier()  # when train() returns, on any rank, the run folder is complete
        return result

    def _record_measured(self) -> None:
        """plan.json gets the measured step time and every rank's peak memory beside the prediction."""
        peak = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.float64, device=self.device)
        peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
        dist.all_gather(peaks, peak)
        if not self.is_main:
            return
        source = ("torch.cuda.max_memory_allocated (tensors only)" if self.device.type == "cuda" else
                  "resource.getrusage ru_maxrss (the whole process: Python, torch, data and tensors)")
        measured = Measured(step_times_s=self.step_times_s, peak_memory_bytes_per_rank=[int(p.item()) for p in peaks],
                            peak_memory_source=source, pp=self.strategy.pp,
                            ranks_per_stage=self.strategy.dp * self.strategy.tp)
        self.plan.record["measured"] = measured.to_dict()
        self.plan.save(self.run_dir / "plan.json")

    def _banner(self, start: int) -> str:
        params = self.engine.num_parameters()
        lines = [f"autopar {__version__}: {dist.get_world_size()} process(es), strategy dp={self.strategy.dp} "
                 f"tp={self.strategy.stage_tp or self.strategy.tp} pp={self.strategy.pp}, {params:,} parameters, "
                 f"{self.accumulation} micro-batch(es) of {self.config.micro_batch_size} per replica per step",
                 f"run folder: {self.run_dir}"]
        lines += [f"{k}: {v}" for k, v in self.run_info.items() if k in ("corpus", "model", "data", "tokenizer", "pretrained")]
        lines += self.engine.banner_lines()
        if self.plan is not None:
            lines.append(self.plan.describe())
        if start:
            lines.append(f"resumed at step {start} from {self.resumed_from}")
        if self.attempt:
            lines.append(f"restart {self.attempt} of this job")
        return "\n".join(lines)
