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
import os
import shutil
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from .config import JobConfig, Strategy, TrainConfig, to_dict
from .data.sampler import GlobalBatchSampler
from .distributed import DistEnv, destroy_groups, init_distributed, process_groups
from .errors import ConfigError, DataError, Preempted, TrainingError
from .launch import ATTEMPT_ENV, restart_attempt
from .memory_gate import check_trainer
from .mesh import ProcessMesh
from .models.materialize import attach_init_fn, tied_groups
from .models.output import router_aux_loss_coef
from .search.auto import Measured, Plan
from .search.device_peak import device_peak
from .search.device_speeds import replica_shares
from .search.live_memory import CountedStep
from .strategies import Resolved, StrategyEntry, resolve
from .train.bad_steps import BadSteps
from .train.base import Engine, EngineContext, LoopServices, TrainResult
from .train.checkpointer import Checkpointer
from .train.deferred import StepResult
from .train.evaluator import Evaluator
from .train.faults import Fault, FaultySteps
from .train.fields import example_call
from .train.inputs import BatchLoader, Losses
from .train.interrupt import StopRequest
from .train.shared_failure import failures_shared, run_set_up
from .train.loss import Batch, LossFn, default_forward, label_shift
from .train.banner import start_banner
from .train.loggers import run_loggers
from .train.metrics import (MetricsLog, Progress, every_rank, peak_memory_bytes, peak_memory_per_rank,
                            peak_memory_source, shows_bar, step_record)
from .train.optim import build_scheduler, check_trainable
from .train.pretrained_load import load_pretrained
from .train.run_account import RunAccount
from .train.run_folder import config_toml, open_run_dir, write_summary
from .train.steps import HOST_SYNCS_PER_STEP, Steps, SynchronousSteps, steps_for
from .train.watchdog import Watchdog
from .timing import StepTimer
from .version import __version__

__all__ = ["HOST_SYNCS_PER_STEP", "Trainer"]  # HOST_SYNCS_PER_STEP: where a step waits for the device (train/steps.py)


class Trainer:
    def __init__(self, model: nn.Module, train_data: Dataset, *, strategy: Strategy | Plan | None = None,
                 config: TrainConfig | None = None, eval_data: Dataset | None = None,
                 loss_fn: LossFn | None = None, forward_fn: Callable[[nn.Module, Batch], Any] | None = None,
                 job_config: JobConfig | None = None, run_info: dict[str, Any] | None = None,
                 pretrained: Any = None, run_files: dict[str, str] | None = None,
                 label_convention: str | None = None, init_fn: Callable[[nn.Module], None] | None = None,
                 strategies: Sequence[StrategyEntry] | None = None, force: bool = False):
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
        strategies: strategy-table entries (strategies.StrategyEntry) that replace the built-in table for this
            Trainer: the first whose `applies` holds runs (e.g. a test's reference engine).
        force: train a strategy set by hand even when the memory model predicts it cannot fit (memory_gate.py:
            refused otherwise, before anything is allocated, as `autopar train` refuses it without --force).
        """
        if not isinstance(model, nn.Module):
            raise ConfigError(f"Trainer needs an nn.Module as the model, got {type(model).__name__}")
        if init_fn is not None:
            attach_init_fn(model, init_fn)
        self.model, self.train_data, self.eval_data = model, train_data, eval_data
        self.tied_weights = tied_groups(model)[0]  # names of one tensor; run.json keeps them for `export --to torch`
        self.plan = strategy if isinstance(strategy, Plan) else None
        self.strategy = Strategy() if self.plan is not None or strategy is None else strategy
        self.config = config or TrainConfig()
        self.loss_fn, self.forward_fn = loss_fn, forward_fn or default_forward
        self.job_config, self.run_info = job_config, dict(run_info or {})
        self.pretrained, self.extra_run_files = pretrained, dict(run_files or {})
        self.pretrained_bytes_read = 0
        self.strategy_table = None if strategies is None else tuple(strategies)
        self.force = force
        if self.strategy_table is not None and not all(isinstance(e, StrategyEntry) for e in self.strategy_table):
            raise ConfigError(f"Trainer(strategies=...) takes strategies.StrategyEntry items, got "
                              f"{[type(e).__name__ for e in self.strategy_table]}")
        convention = label_convention or getattr(train_data, "label_convention", "model")
        self.shift_labels = label_shift(model, convention) and loss_fn is None  # a custom loss sees labels as given

    # ------------------------------------------------------------------ set-up

    def _validate(self) -> Resolved:
        """Every check that needs no communication (strategies.resolve), so each rank fails the same way, early."""
        check_trainable(self.model)
        world = dist.get_world_size() if dist.is_initialized() else DistEnv.from_environ().world_size
        if self.strategy.planning.confirm and self.plan is None and not self.strategy.planning.plan:
            raise ConfigError(f"--confirm {self.strategy.planning.confirm} runs the top plans as separate short jobs, which "
                              f"only `autopar train` can start; in Python, measure plans yourself or use confirm=0")
        resolved = resolve(self.strategy, self.config, world, custom_forward=self.forward_fn is not default_forward,
                           custom_loss=self.loss_fn is not None,
                           pretrained=self.pretrained is not None, model=self.model,
                           example=lambda: example_call(self.model, self.train_data), plan=self.plan,
                           strategies=self.strategy_table)
        for name, data in (("train_data", self.train_data), ("eval_data", self.eval_data)):
            if data is not None and len(data) == 0:
                raise DataError(f"{name} is empty; it needs at least one sample")
        if resolved.plan is None and self.job_config is None and self.forward_fn is default_forward:
            # a strategy set by hand in Python (the command line gates its own runs before launching the ranks)
            check_trainer(self.model, self.train_data, resolved, world, force=self.force)
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
        self.sampler = GlobalBatchSampler(len(self.train_data), cfg.global_batch_size, seed=cfg.seed,
                                          shares=replica_shares(self.strategy, cfg))
        self.loader = BatchLoader(config=cfg, sampler=self.sampler, device=self.device, shift_labels=self.shift_labels,
                                  dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size)
        self.account = RunAccount.of_model(self.model, self.forward_fn, self.train_data[0],  # as the user gave it
                                           main=dist.get_rank() == 0, began=getattr(self, "began", None))
        first = lambda: self.sampler.local_micro_batches(0, dp_rank=0, dp_size=self.strategy.dp,  # noqa: E731
                                                         micro_batch_size=cfg.micro_batch_size)[0]
        self.engine: Engine = resolved.entry.build(EngineContext(
            model=self.model, mesh=self.mesh, strategy=self.strategy, config=cfg, device=self.device,
            autocast=self.autocast, forward_fn=self.forward_fn,
            accumulation=self.accumulation if self.sampler.shares is None else  # uneven: this replica's count
            len(self.loader.local_positions(0)),
            example_batch=lambda: self.loader.load(first(), self.train_data),
            batches_for_step=lambda step: self.loader.local_batches(step, self.train_data),
            samples_for_step=self.loader.local_positions))
        self.run_info.update(self.engine.run_info())
        aux_coef = router_aux_loss_coef(self.model)  # the user's model's config, before the engine's module replaces it
        self.model = self.engine.module
        if cfg.compile:
            self.account.compile(self.engine, cfg)
        if self.pretrained is not None and not cfg.resume:  # a resumed run takes every weight from its checkpoint
            self.pretrained_bytes_read, info = load_pretrained(self.pretrained, self.model, self.engine.sliced_state)
            self.run_info.update(info)
        # other random ops: one stream per tp group (tp is innermost), so replicated regions agree; dropout
        # masks do not use it (autopar/dropout: a function of seed, step, sample and operation)
        torch.manual_seed(cfg.seed + 1 + self.mesh.tp_group_index)
        self.optimizer = self.engine.build_optimizer(cfg)
        self.account.note_optimizer(self.optimizer)  # --compile: fused update or not, for the banner and summary
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.losses = Losses(engine=self.engine, loss_fn=self.loss_fn, config=cfg, device=self.device,
                             dp_group=self.dp_group, aux_coef=aux_coef)
        self.evaluator = Evaluator(engine=self.engine, loader=self.loader, losses=self.losses, eval_data=self.eval_data,
                                   config=cfg, device=self.device, replica=(self.mesh.dp_rank, self.mesh.dp_size))
        self.steps = self._build_steps()
        self.is_main = dist.get_rank() == 0
        if self.is_main:
            self.account.price_steps(self.engine, cfg, world=dist.get_world_size(), peak=lambda: device_peak(
                self.device, cfg.dtype, world=dist.get_world_size(), cluster=self.strategy.planning.cluster))
        self.run_dir = self._make_run_dir()
        layout = {"layout": to_dict(self.strategy),
                  "config_sha256": hashlib.sha256(self._config_toml().encode()).hexdigest()}
        self.checkpointer = Checkpointer(run_dir=self.run_dir, engine=self.engine, model=self.model,
                                         optimizer=self.optimizer, scheduler=self.scheduler, config=cfg,
                                         manifest_info=layout)

    def _build_steps(self) -> Steps:
        """The engine's kind of steps (synchronous or deferred), wrapped with the injected fault when one is set."""
        steps = steps_for(self.engine, mesh=self.mesh, pp=self.strategy.pp, optimizer=self.optimizer,
                          scheduler=self.scheduler, grad_clip=self.config.grad_clip, device=self.device,
                          loader=self.loader, losses=self.losses, train_data=self.train_data, seed=self.config.seed,
                          dp_size=self.mesh.dp_size)
        if self.fault is None:
            return steps
        return FaultySteps(steps, self.fault, rank=dist.get_rank(), attempt=self.attempt)

    def _make_run_dir(self) -> Path:
        info = {"autopar": __version__, "torch": torch.__version__, "world_size": dist.get_world_size(),
                "strategy": to_dict(self.strategy), "accumulation_steps": self.accumulation,
                "model_class": type(self.model).__name__, **self.run_info,
                **({"tied_weights": self.tied_weights} if self.tied_weights else {})}
        run_dir, self._fresh_run_dir = open_run_dir(self.config.out, main=self.is_main, config=self._config_toml(),
                                                    info=info, files={**self.engine.run_files(),
                                                                      **self.extra_run_files}, plan=self.plan)
        return run_dir

    def _config_toml(self) -> str:
        return config_toml(self.strategy, self.config, self.job_config, planned=self.plan is not None)

    # ------------------------------------------------------------------ steps

    def train_step(self, step: int, *, stop_requested: bool = False) -> StepResult:
        """One synchronous optimizer step (0-based `step`) outside train(), e.g. to measure one
        (search/live_memory.py); see SynchronousSteps.train_step."""
        if not isinstance(self.steps, SynchronousSteps):
            raise TrainingError(f"Trainer.train_step runs one synchronous step; this run's steps are "
                                f"{type(self.steps).__name__} (an engine that defers its updates, or an injected "
                                f"fault); run them with train()")
        return self.steps.train_step(step, stop_requested=stop_requested)

    def evaluate(self, replica: tuple[int, int] | None = None) -> float | None:
        """Mean loss over `eval_batches` fixed global batches of the held-out data (train/evaluator.py)."""
        return self.evaluator.evaluate(replica)

    def save(self, step: int) -> Path:
        return self.checkpointer.save(step)

    def _loop_services(self) -> LoopServices:
        return LoopServices(config=self.config, engine=self.engine, sampler=self.sampler, train_data=self.train_data,
                            device=self.device, is_main=self.is_main, run_dir=self.run_dir,
                            accumulation=self.accumulation, scheduler=self.scheduler, loader=self.loader,
                            losses=self.losses, evaluator=self.evaluator, checkpointer=self.checkpointer,
                            close_run=self.close_run)

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        before = process_groups()
        self.began = time.monotonic()
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
            return self.loop(self._loop_services())
        start = self._start()
        cfg, rank = self.config, dist.get_rank()
        metrics = MetricsLog(run_loggers(cfg, self.run_dir, start=start, run_config={  # rank 0's loggers
            "strategy": to_dict(self.strategy), "train": to_dict(cfg)}) if self.is_main else None,
            every=cfg.log_every, last=cfg.steps)
        progress = Progress(total=cfg.steps, initial=start, enabled=self.is_main and shows_bar(cfg.progress),
                            main=self.is_main)
        progress.write(self._banner(start))
        result = TrainResult(run_dir=self.run_dir, first_step=start + 1)
        # a plan's end-of-run line sets live tensor bytes beside its prediction; the CUDA allocator's peak is that already
        self.counted = CountedStep(self, start=start, steps=cfg.steps,
                                   enabled=self.plan is not None and self.device.type == "cpu")
        stop_request = StopRequest(rank)
        watchdog = Watchdog(cfg.hang_timeout_s, rank=rank, run_dir=self.run_dir)
        try:
            with stop_request, watchdog, failures_shared(lambda: watchdog.phase, forget=self._forget_engine):
                self._run_steps(start, result, stop_request, watchdog, metrics, progress)
                self._end_run(start, watchdog)
        finally:
            progress.close()
            metrics.close()
            if hasattr(self, "engine"):  # (gone after a failure: _forget_engine)
                self.engine.close()
        return self.close_run(result)

    def _start(self) -> int:
        """The step this run starts after: a checkpoint's on --resume or a restart (else 0)."""
        try:
            start = self.checkpointer.start(attempt=self.attempt, main=self.is_main,
                                            torchrun_restart=bool(self.attempt) and ATTEMPT_ENV not in os.environ)
        except BaseException:
            self._discard_fresh_run_dir()
            raise
        self.resumed_from = self.checkpointer.resumed_from
        return start

    def _run_steps(self, start: int, result: TrainResult, stop_request: StopRequest, watchdog: Watchdog,
                   metrics: MetricsLog, progress: Progress) -> None:
        """Steps start+1 .. --steps. Each result is reported in step order as it arrives (a deferred engine's
        late): bad steps counted, its record written, an evaluation and a checkpoint when theirs are due. A stop
        requested on any rank saves the last step settled and raises Preempted on every rank."""
        cfg = self.config
        timer = StepTimer(self.device)  # CUDA events on GPU: timing adds no host wait
        bad = BadSteps(cfg.max_bad_steps, self.run_dir)  # the same sums on every rank: all stop together
        seconds: dict[int, float] = {}  # step number -> this rank's time for it (its own call)
        for step in range(start, cfg.steps):
            watchdog.progress(f"step {step + 1}")
            timer.start()
            with self.counted.around(step):
                queue = deque(self.steps.run(step, stop_request))
            timer.stop()
            seconds[step + 1] = timer.seconds()
            stopping = None  # the number of the step a stop was requested in
            while queue:  # in step order; a deferred engine reports a step or more late
                finished = queue.popleft()
                number, out = finished.number, finished.result
                bad.count(finished)
                elapsed = seconds.pop(number)
                result.losses.append(out.loss)
                record = step_record(number, out.loss, finished.lr, out.grad_norm, out.tokens, elapsed, out.peak_bytes)
                report = self.account.step(record, elapsed, out.tokens)  # FLOP rates, compile counters
                if report and self.is_main:
                    progress.write(report)
                if bad.total:
                    record.update(skipped=out.skipped, bad_steps=bad.total)
                if metrics.due(number) or self.evaluator.due(number):  # a record with an eval loss is written
                    # the engine's own statistics cost a collective and a host read: only for records written
                    record.update(finished.stats if finished.stats is not None else
                                  self.engine.step_stats(elapsed, peak_memory_bytes(self.device)))
                    if self.evaluator.due(number):
                        watchdog.progress(f"evaluation after step {number}")
                        result.eval_loss = record["eval_loss"] = self.evaluator.evaluate()
                    metrics.write(record)
                progress.update(loss=out.loss, tokens_per_s=record["tokens_per_s"], lr=finished.lr)
                if out.stop and stopping is None and number != cfg.steps:  # a signal on some rank
                    stopping = number
                    queue.extend(self.steps.settle_for_stop())
                if self.checkpointer.due(number) and stopping is None:
                    watchdog.progress(f"checkpoint of step {number}")
                    self.checkpointer.save(number)
            if stopping is not None and number != cfg.steps:  # save the last step settled, leave together
                watchdog.progress(f"checkpoint of step {number} (stopping on a signal)")
                saved = self.checkpointer.save(number)
                raise Preempted(f"stopped on a signal after step {number} of {cfg.steps}; checkpoint "
                                f"{saved}; continue with: autopar train --resume {self.run_dir}")

    def _end_run(self, start: int, watchdog: Watchdog) -> None:
        """After the last step: its checkpoint (if this call trained), the export, the engine's own ending."""
        cfg = self.config
        if cfg.steps > start:
            watchdog.progress(f"checkpoint of step {cfg.steps}")
            self.checkpointer.save(cfg.steps)
        if cfg.export_hf:
            watchdog.progress(f"export to {cfg.export_hf}")
            self.export_hf(cfg.export_hf)
        watchdog.progress("finishing the run")
        self.engine.finish_run(self.run_dir, cfg, self.strategy)  # e.g. the pipeline's --trace timeline

    def _forget_engine(self) -> None:
        """After a failure: drop what holds this run's process groups, so they can be torn down (shared_failure)."""
        with contextlib.suppress(Exception):  # (no engine yet; or closing it fails too: the failure is the report)
            self.__dict__.pop("engine").close()
        for name in ("mesh", "dp_group", "optimizer", "scheduler", "losses", "evaluator", "steps", "checkpointer"):
            self.__dict__.pop(name, None)

    def _discard_fresh_run_dir(self) -> None:
        """A run that fails before its first step leaves no run folder behind (unless it existed before)."""
        if getattr(self, "_fresh_run_dir", False):
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def export_hf(self, out: str) -> Path:
        """The latest checkpoint as a Hugging Face folder; every rank writes some of its shards (collective)."""
        from .train.hf_export import export_hf_together
        return export_hf_together(self.run_dir, out)

    def close_run(self, result: TrainResult) -> TrainResult:
        """summary.json and the "done:" line on rank 0; returns once the run folder is complete on every rank."""
        if self.plan is not None and self.account.step_times_s:  # plan.json: measured beside the prediction
            peaks = peak_memory_per_rank(self.device)  # every rank's peak memory (a collective)
            counted = getattr(self, "counted", None)  # (none in a loop of its own: the parameter server's)
            tensors = None if counted is None or counted.step is None else \
                every_rank(counted.peak_bytes or 0, self.device)  # (the same step counted on every rank)
            if self.is_main:
                self.plan.record_measured(Measured(
                    step_times_s=self.account.step_times_s, peak_memory_bytes_per_rank=peaks,
                    peak_memory_source=peak_memory_source(self.device), pp=self.strategy.pp,
                    ranks_per_stage=self.strategy.dp * self.strategy.tp, peak_tensor_bytes_per_rank=tensors,
                    tensor_step=None if tensors is None else counted.index), self.run_dir)
        if self.is_main:
            write_summary(self.run_dir, self.config.steps, result.losses, result.eval_loss, self.account.facts())
        dist.barrier()  # when train() returns, on any rank, the run folder is complete
        return result

    def _banner(self, start: int) -> str:
        return start_banner(world=dist.get_world_size(), strategy=self.strategy,
                            parameters=self.engine.num_parameters(), accumulation=self.accumulation,
                            micro_batch_size=self.config.micro_batch_size, run_dir=self.run_dir,
                            run_info=self.run_info, engine_lines=self.account.banner_lines(self.engine),
                            plan=None if self.plan is None else self.plan.describe(), start=start,
                            resumed_from=getattr(self, "resumed_from", None), attempt=self.attempt,
                            total_parameters=self.account.total_parameters,
                            facts=self.account.banner_facts(config=self.config, train_data=self.train_data,
                                                            eval_data=self.eval_data, engine=self.engine))
