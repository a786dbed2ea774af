"""What a run computed and how fast: its parameters, FLOPs, tokens, step times and what --compile did.

The trainer's loop hands every finished step to `RunAccount.step`, which adds the step's FLOP rates
and compile counters to its metrics record; the banner and summary.json read their lines and facts
from here. Kept apart from the loop so the loop reads as steps, and so each figure is computed in
one place (MFU in the record, the summary and the banner are the same formula: train/flops.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig
from .banner import batch_line
from .base import Engine
from .compile import CompileAccount, compile_regions, use_inductor_cache
from .flops import StepFlops, forward_flops_per_sample
from .loss import as_batch


@dataclass
class RunAccount:
    """One call of `Trainer.train()`'s account. Rank 0 counts the model (`total_parameters`, `forward_flops`);
    every rank keeps its own step times (plan.json's measured step time is this rank's clock)."""

    total_parameters: int | None = None
    forward_flops: float | None = None  # one sample's forward pass, counted on a fake copy of the model
    step_flops: StepFlops | None = None  # rank 0, once the engine exists: a step's FLOPs against the device peak
    compiled: CompileAccount | None = None  # --compile: regions, compile time, recompilations, graph breaks
    step_times_s: list[float] = field(default_factory=list)
    tokens_trained: int = 0  # in the steps of this call
    began: float = field(default_factory=time.monotonic)

    @classmethod
    def of_model(cls, model: nn.Module, forward_fn: Callable, sample: Any, *, main: bool,
                 began: float | None = None) -> RunAccount:
        """Before the engine: the whole model as the user gave it, counted on rank 0 (`main`) only. `began`:
        when the call started (time.monotonic()), for the summary's duration."""
        began = time.monotonic() if began is None else began
        if not main:
            return cls(began=began)
        unique = {id(p): p for p in model.parameters() if p.requires_grad}
        return cls(total_parameters=sum(p.numel() for p in unique.values()),
                   forward_flops=forward_flops_per_sample(model, forward_fn, sample), began=began)

    def compile(self, engine: Engine, config: TrainConfig) -> None:
        """--compile: the engine's regions compiled (train/compile.py), before the first step, on every rank."""
        cache = use_inductor_cache()
        self.compiled = CompileAccount(compile_regions(engine.compile_regions(), config.compile_backend), cache)

    def note_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Whether the update runs as torch's fused kernel (train/optim.py), for the compile banner and summary."""
        if self.compiled is not None:
            fused = all(group.get("fused") for group in optimizer.param_groups)  # (ZeRO's: per group, not defaults)
            self.compiled.optimizer_kernel = "fused" if fused else "foreach"

    def price_steps(self, engine: Engine, config: TrainConfig, *, world: int,
                    peak: Callable[[], tuple[float | None, str]]) -> None:
        """What a step computes against the device's peak (`peak`: FLOP/s and where the figure comes from,
        search/device_peak.py); left None when the model's FLOPs could not be counted."""
        if not self.forward_flops:
            return
        peak, source = peak()
        self.step_flops = StepFlops.of(self.forward_flops, config.global_batch_size, devices=world,
                                       recomputed_fraction=engine.recomputed_forward_fraction(),
                                       peak_flops_per_device=peak, peak_source=source)

    def step(self, record: dict[str, Any], elapsed: float, tokens: int) -> str | None:
        """A finished step: counted, its record given FLOP rates and compile counters; returns a graph-break
        report the first time one is seen (to print once)."""
        self.step_times_s.append(elapsed)
        self.tokens_trained += tokens
        if self.step_flops is not None:
            record.update(self.step_flops.rates(elapsed))
        if self.compiled is None:
            return None
        record.update(self.compiled.step_fields())  # recompilations and graph breaks so far (cheap to read)
        return self.compiled.graph_break_report()

    def facts(self) -> dict[str, Any]:
        """summary.json's account of this call: wall time, tokens, mean throughput and MFU, what compiling did."""
        facts: dict[str, Any] = {"duration_s": round(time.monotonic() - self.began, 3)}
        stepping = sum(self.step_times_s)
        if self.tokens_trained and stepping > 0:
            facts.update(tokens=self.tokens_trained, tokens_per_s=self.tokens_trained / stepping)
            if self.step_flops is not None:
                facts.update(self.step_flops.times(len(self.step_times_s)).rates(stepping),
                             mfu_peak_source=self.step_flops.peak_source)
        if self.compiled is not None:
            facts["compile"] = self.compiled.summary()
        return facts

    def banner_lines(self, engine: Engine) -> list[str]:
        """The engine's own banner lines, and what --compile did."""
        return engine.banner_lines() + ([self.compiled.banner_line()] if self.compiled is not None else [])

    def banner_facts(self, *, config: TrainConfig, train_data: Any, eval_data: Any, engine: Engine) -> list[str]:
        """The banner's lines about the batch and data, the FLOPs a step computes, and what --trace will do."""
        first = as_batch(train_data[0])
        per_sample = first["input_ids"].numel() if isinstance(first.get("input_ids"), torch.Tensor) else None
        lines = [batch_line(global_batch_size=config.global_batch_size, tokens_per_sample=per_sample,
                            train_samples=len(train_data), steps=config.steps,
                            eval_samples=None if eval_data is None else len(eval_data))]
        if self.step_flops is not None:
            lines.append(self.step_flops.describe())
        if config.trace and not hasattr(engine, "gather_events"):
            lines.append("--trace records the pipeline's measured step timeline (timeline.json); this run has no "
                         "pipeline engine (pp=1, tp=1), so it writes none")
        return lines
