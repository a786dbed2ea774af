"""Checkpoints of a run, and when the loop takes them: every --checkpoint-every steps (the last step's
checkpoint is the run's end's, and a stop on a signal saves the last step settled).

The checkpoint files themselves (layout, checksums, resharding) are train/checkpoint.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..config import TrainConfig
from ..errors import ConfigError
from . import checkpoint as ckpt
from .resume import agree_on_resume_checkpoint
from .run_folder import log_torchrun_restart, truncate_metrics


class Checkpointer:
    """Saves and restores this run's model, optimizer and schedule; `due` says after which steps."""

    def __init__(self, *, run_dir: Path, engine: Any, model: nn.Module, optimizer: Any, scheduler: Any,
                 config: TrainConfig, manifest_info: dict[str, Any]):
        self.run_dir, self.engine, self.model, self.optimizer, self.scheduler = run_dir, engine, model, optimizer, scheduler
        self.config, self.manifest_info = config, manifest_info
        self.resumed_from: Path | None = None

    def due(self, number: int) -> bool:
        """After step `number` (1-based): every --checkpoint-every steps but the last (the run's end saves it)."""
        every = self.config.checkpoint_interval
        return bool(every and number % every == 0) and number != self.config.steps

    def save(self, step: int) -> Path:
        self.engine.before_checkpoint()  # e.g. gossip: the replicas' mean; sparse: deferred rows landed
        return ckpt.save_checkpoint(self.run_dir, step, self.model, self.optimizer,
                                    {"scheduler": self.scheduler.state_dict()}, self.engine.sliced_state,
                                    manifest_info=self.manifest_info, keep=self.config.keep_checkpoints)

    def restore(self, *, restarted: bool) -> int:
        """The step the run starts after: the agreed checkpoint's (a restart's newest, else --resume), loaded;
        0 for a fresh run. Collective: every rank calls it."""
        self.resumed_from = agree_on_resume_checkpoint(self.run_dir, self.config.resume, restarted=restarted)
        if self.resumed_from is None:
            return 0
        state = ckpt.load_checkpoint(self.resumed_from, self.model, self.optimizer, self.engine.sliced_state)
        self.scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr  # the rate the checkpointed step would use next
        self.engine.zero_grad()
        return int(state["step"])

    def start(self, *, attempt: int, main: bool, torchrun_restart: bool) -> int:
        """The step this run starts after (`restore`), checked against --steps and told to the run folder:
        metrics.jsonl cut back to it, a torchrun restart logged. Collective."""
        start = self.restore(restarted=attempt > 0)
        if start > self.config.steps:
            raise ConfigError(f"the checkpoint is at step {start}, beyond --steps {self.config.steps}; raise --steps")
        if main and (start or attempt):
            truncate_metrics(self.run_dir / "metrics.jsonl", start)
        if main and torchrun_restart:
            log_torchrun_restart(self.run_dir, attempt, self.resumed_from)
        return start
