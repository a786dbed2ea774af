"""What the trainer asks of an engine, what an engine is built from, and what a loop of its own needs.

An engine runs one replica's forward and backward and owns how gradients (or models)
travel between ranks: the data-parallel engine (train/engine.py), the pipeline engine
(pipeline/engine.py, which also runs tensor parallelism), gossip, the parameter server and
sparse embeddings. The trainer drives every one of them through `Engine` only; hooks that
only some engines need have do-nothing defaults in `EngineBase`, so the trainer never asks
what kind of engine it holds. strategies.py picks and builds the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils.data import Dataset

from ..config import Strategy, TrainConfig
from ..mesh import ProcessMesh
from ..timing import WaitTally
from .loss import Batch, LossFn, token_loss_sum
from ..zero import ShardedGradients, ShardedOptimizer
from .optim import build_optimizer

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .evaluator import Evaluator
    from .inputs import BatchLoader, Losses


class Engine(Protocol):
    """The operations the trainer calls on every engine."""

    module: nn.Module  # the parameters this rank trains, under the user's model's own names
    tensor_parallel: Any  # a TensorParallel when logits are sharded over the vocabulary, else None
    sliced_state: Any  # what checkpoints gather whole and cut again (EngineBase.sliced_state)
    waits: WaitTally  # this rank's time blocked on other ranks in the current step (the trainer starts each step)

    def forward_backward(self, batches: list[Batch], loss_fn: LossFn) -> torch.Tensor:
        """Every micro-batch of this replica, gradients exchanged; this rank's share of the loss."""

    def clip_gradients(self, max_norm: float) -> float | None:
        """The global gradient norm (before clipping); clips to max_norm. None where the engine cannot know
        it at this point (gradients still in flight) and so cannot clip."""

    def eval_sums(self, batches: list[Batch], eval_loss: Callable) -> torch.Tensor:
        """[loss sum, weight] this rank contributes, without gradients."""

    def zero_grad(self) -> None: ...

    def step_stats(self, elapsed: float, peak_bytes: int) -> dict: ...

    def close(self) -> None: ...

    def num_parameters(self) -> int: ...

    def token_loss_sum(self, output: Any, batch: Batch) -> torch.Tensor:
        """The default loss: token cross-entropy summed over the micro-batch's targets."""

    def build_optimizer(self, config: TrainConfig) -> torch.optim.Optimizer: ...

    def before_checkpoint(self) -> None: ...

    def banner_lines(self) -> list[str]: ...

    def run_info(self) -> dict[str, Any]: ...

    def run_files(self) -> dict[str, str]: ...

    def finish_run(self, run_dir: Path, config: TrainConfig, strategy: Strategy) -> None: ...


class EngineBase:
    """Defaults for the optional hooks; an engine overrides what it needs."""

    module: nn.Module
    tensor_parallel = None  # whole model per replica unless the engine shards layers
    waits = WaitTally()  # records nothing: engines that report their waits (the pipeline's) hold their own
    token_loss_sum = staticmethod(token_loss_sum)

    @property
    def sliced_state(self) -> Any:
        """What checkpoints and pretrained loads gather whole and cut again (is_sharded, gather, shard, full_shape,
        file_slices): the tensor-parallel layout, or sharded experts with or without it; None when all is whole."""
        return self.tensor_parallel

    def num_parameters(self) -> int:
        """Trainable parameters this rank holds (each shared tensor once)."""
        unique = {id(p): p for p in self.module.parameters() if p.requires_grad}
        return sum(p.numel() for p in unique.values())

    def build_optimizer(self, config: TrainConfig) -> torch.optim.Optimizer:
        """The configured optimizer; under ZeRO (or bf16 master weights) stepped on this replica's shard."""
        optimizer = build_optimizer(self.module, config)
        sync = getattr(self, "sync", None)
        if isinstance(sync, ShardedGradients):
            names = {id(p): name for name, p in self.module.named_parameters()}
            return ShardedOptimizer(optimizer, sync, names)
        return optimizer

    def compile_regions(self) -> list[tuple[str, nn.Module]]:
        """The modules --compile compiles (train/compile.py): the whole model's repeated blocks."""
        from .compile import repeated_blocks
        return repeated_blocks(self.module)

    def before_checkpoint(self) -> None:
        """Make the parameters the ones to save (gossip: the replicas' average; sparse: deferred rows landed)."""

    def banner_lines(self) -> list[str]:
        """Lines the run's start banner adds about this engine."""
        return []

    def run_info(self) -> dict[str, Any]:
        """Entries this engine adds to the run folder's run.json."""
        return {}

    def run_files(self) -> dict[str, str]:
        """Files (name -> text) this engine adds to the run folder: what it chose, readable (tp_plan.txt)."""
        return {}

    def finish_run(self, run_dir: Path, config: TrainConfig, strategy: Strategy) -> None:
        """Called on every rank after the last step (a collective where the engine needs one)."""

    def step_stats(self, elapsed: float, peak_bytes: int) -> dict:
        return {}

    def recomputed_forward_fraction(self) -> float:
        """Share of the model's forward FLOPs this engine runs again during backward (train/flops.py reports them
        apart from MFU); 0 for an engine that recomputes nothing."""
        return 0.0

    deferred_rule: str | None = None
    """None: the trainer's synchronous step (update decided by all ranks together, right away). "global" or
    "per-stage": the engine's update may wait for later steps (train/deferred.py, which says what else
    such an engine provides)."""

    def abandon_in_flight(self) -> None:
        """Stopping mid-run (a signal): drop work started for steps not run yet (a deferred engine's look-ahead)."""


@dataclass
class EngineContext:
    """Everything a strategy's engine is built from; each entry of strategies.py adds its own options."""

    model: nn.Module
    mesh: ProcessMesh
    strategy: Strategy  # resolved: dp filled in
    config: TrainConfig  # resolved: micro-batch size known
    device: torch.device
    autocast: Callable
    forward_fn: Callable[[nn.Module, Batch], Any]
    accumulation: int  # micro-batches per replica per step
    example_batch: Callable[[], Batch]  # the first micro-batch of replica 0, loaded on demand
    batches_for_step: Callable[[int], list[Batch]]  # this replica's micro-batches of a step
    # their global sample indices (what dropout masks are drawn from), for an engine that runs
    # micro-batches of a step before the trainer opens it (pipedream-2bw's look-ahead)
    samples_for_step: Callable[[int], list[list[int]]] | None = None
    log: Callable[[str], None] = field(default=lambda text: print(text, flush=True))

    @property
    def seed(self) -> int:
        return self.config.seed

    def common(self) -> dict[str, Any]:
        """The arguments every engine takes, so a builder spells only its engine's own."""
        return dict(model=self.model, mesh=self.mesh, device=self.device, seed=self.seed, autocast=self.autocast)

    @property
    def timeout_s(self) -> float:
        return self.config.timeout_s

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype parameters are stored and communicated in (bf16: fp32 masters in the optimizer)."""
        return torch.bfloat16 if self.config.dtype == "bf16" else torch.float32


@dataclass
class TrainResult:
    """What a run produced; identical on every rank."""

    run_dir: Path
    losses: list[float] = field(default_factory=list)  # one per step trained in this call
    first_step: int = 1  # the step number of losses[0]
    eval_loss: float | None = None


@dataclass(frozen=True)
class LoopServices:
    """What a strategy's own training loop (the parameter server's) is given: the parts of the trainer it
    uses, built and set up, not the trainer itself."""

    config: TrainConfig
    engine: Engine
    sampler: Any  # data.sampler.GlobalBatchSampler
    train_data: Dataset
    device: torch.device
    is_main: bool
    run_dir: Path
    accumulation: int  # micro-batches per worker per step
    scheduler: Any
    loader: BatchLoader  # samples to batches on the device
    losses: Losses  # the loss share of a micro-batch (normalised by the global target count, or the user's)
    evaluator: Evaluator
    checkpointer: Checkpointer
    close_run: Callable[[TrainResult], TrainResult]  # summary.json and the "done:" line, then a barrier
