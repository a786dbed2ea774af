"""Peak bytes of live tensors during a stretch of code: the CPU quantity the memory model predicts.

On CPU there is no allocator peak to read (torch's CPU allocator keeps no statistics and
the process's peak resident set also holds the Python, torch and gloo runtime, hundreds of
MiB the model cannot know). So the peak is counted from the tensors themselves:

    peak = resident bytes (the storages alive when counting starts: parameters, gradient
           buffers, optimizer states, module buffers, given by the caller)
         + the most bytes of storages created while counting that were alive at one time

A TorchDispatchMode sees every op's outputs (autograd's backward ops and the collectives'
buffers included); each new storage is counted once and uncounted when it is freed (a weak
reference's finaliser). Views and in-place ops add nothing. The mode slows each op by a few
microseconds, so it counts one separate step, never a timed one. Not seen: storages made before
counting began and not named resident (the dataset, the runtime's own persistent buffers).

FSDP2 (ZeRO-3) makes each unsharded parameter's storage once, at its first all-gather, and later
frees and refills it by resizing the storage (to 0 bytes and back), which no op reports: those
storages are passed as `resizable` and their current sizes are added at every op, so a counted
step sees its gathered parameters while they are whole.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .._torch_internals import dispatch_mode_base, fsdp_unsharded_tensors, tree_leaves

TorchDispatchMode = dispatch_mode_base()


def local_storage(t: torch.Tensor):
    """The storage holding a tensor's bytes on this rank, or None for a meta tensor. A DTensor (FSDP2's
    parameters, tensor-parallel weights, their gradients and optimizer states) is a wrapper without a
    storage of its own (asking for its pointer raises 'invalid python storage'): its local shard's counts."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return None if t.device.type == "meta" else t.untyped_storage()


def storage_key(t: torch.Tensor) -> int:
    """The address of a tensor's storage on this rank, 0 for one with nothing to count."""
    storage = local_storage(t)
    return 0 if storage is None else storage.data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, set[int]]:
    """Bytes of the distinct storages behind `tensors`, and their addresses."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        key = storage_key(t) if isinstance(t, torch.Tensor) else 0
        if key and key not in seen:
            seen.add(key)
            total += local_storage(t).nbytes()
    return total, seen


def fsdp_resizable_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors whose storages FSDP2 resizes in place (its gathered parameters), for every FSDP2
    unit inside `module`; none without FSDP2 (FSDP2's per-parameter state is private)."""
    return [t for m in module.modules() if isinstance(m, FSDPModule) for t in fsdp_unsharded_tensors(m)]


class LiveTensorPeak(TorchDispatchMode):
    """Counts bytes of storages created inside the `with` block; `peak` is the most alive at once.

    `resizable`: tensors made before counting whose storages are resized in place (FSDP2's gathered
    parameters); their current bytes count as live. With `breakdown`, `at_peak` maps the name of the op
    that made each counted storage (or 'resized') to its bytes alive at the peak: a diagnostic, slower."""

    def __init__(self, resident: set[int] | None = None, resizable: Iterable[torch.Tensor] = (),
                 breakdown: bool = False):
        super().__init__()
        self.resident = set(resident or ())
        self.resizable = list(resizable)
        self.live = 0
        self.peak = 0
        self.breakdown = breakdown
        self.at_peak: dict[str, int] = {}
        self._counted: dict[int, int] = {}
        self._made_by: dict[int, str] = {}

    def _freed(self, key: int) -> None:
        self.live -= self._counted.pop(key, 0)
        self._made_by.pop(key, None)

    def _resized_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.resizable)

    def _note(self) -> None:
        resized = self._resized_bytes() if self.resizable else 0
        if self.live + resized > self.peak:
            self.peak = self.live + resized
            if self.breakdown:
                names: dict[str, int] = {"resized": resized} if resized else {}
                for key, nbytes in self._counted.items():
                    name = self._made_by.get(key, "?")
                    names[name] = names.get(name, 0) + nbytes
                self.at_peak = names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view (or an in-place op) returns an input's storage: nothing new, even if that storage was made
        # before counting began and is not in `resident` (a slice of the dataset's token tensor, say)
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            key = storage_key(t) if isinstance(t, torch.Tensor) else 0
            if not key or key in inputs or key in self.resident or key in self._counted:
                continue
            storage = local_storage(t)
            nbytes = storage.nbytes()
            self._counted[key] = nbytes
            if self.breakdown:
                self._made_by[key] = str(func.overloadpacket.__name__)
            self.live += nbytes
            weakref.finalize(storage, self._freed, key)
        self._note()
        return out


def step_peak_bytes(trainer, step: int, breakdown: dict | None = None) -> int:
    """Run one training step of a set-up Trainer (after at least one step: optimizer states exist) and
    return this rank's peak live tensor bytes: resident parameters, gradient buffers, module buffers and
    optimizer states (with the parameters the optimizer steps: ZeRO's fp32 master shards and their gradients), plus the most bytes the step itself had alive at once (FSDP2's gathered parameters
    included). A `breakdown` dict, when given, receives the resident bytes and LiveTensorPeak.at_peak."""
    resident, counter = step_counter(trainer, breakdown=breakdown is not None)
    with counter:
        trainer.train_step(step)
    if breakdown is not None:
        breakdown.update(resident=resident, **counter.at_peak)
    return resident + counter.peak


def step_counter(trainer, *, breakdown: bool = False) -> tuple[int, LiveTensorPeak]:
    """A set-up Trainer's resident tensor bytes now (as step_peak_bytes counts them) and the LiveTensorPeak to
    run one of its steps under: resident + counter.peak is the step's peak live tensor bytes on this rank (the
    Trainer counts one step of an auto run this way, for the end-of-run line)."""
    # the optimizer's own parameters too: a ZeRO-1/2 optimizer steps fp32 master shards, whose gradients are views
    # into the reduce-scattered shard gradient; neither is a model parameter nor an optimizer state
    params = [*trainer.model.parameters(), *(p for g in trainer.optimizer.param_groups for p in g["params"])]
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    resident, keys = storage_bytes([*params, *(p.grad for p in params if p.grad is not None),
                                    *trainer.model.buffers(), *state])
    # the pipeline engine's stages are FSDP2's units but not submodules of trainer.model (LocalStages only views them)
    stages = getattr(trainer.engine, "stages", None) or {}
    resizable = [t for m in (trainer.model, *stages.values()) for t in fsdp_resizable_tensors(m)]
    resizable = list({id(t): t for t in resizable}.values())
    return resident, LiveTensorPeak(keys, resizable, breakdown=breakdown)


class CountedStep:
    """One step of a training run counted for its peak live tensor bytes on this rank, the quantity the memory
    model predicts: an auto run's end-of-run line sets it beside the prediction (on CPU the process's peak
    resident set also holds the Python, torch and gloo runtime, hundreds of MiB no prediction covers). The run's
    second step: after a step the optimizer states exist, as in every later step. The counted step is slower
    (every op passes the dispatch mode), so the run leaves its time out of the median (`index`: its place among
    the run's step times); a run of fewer than 3 steps counts its first, whose time is left out anyway (its
    optimizer states are made during it, so its forward and backward run without them)."""

    def __init__(self, trainer, *, start: int, steps: int, enabled: bool = True):
        self.trainer = trainer
        self.step = (start + 1 if steps - start >= 3 else start) if enabled and steps > start else None
        self.index = None if self.step is None else self.step - start
        self.peak_bytes: int | None = None

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        """Around the run's call that trains `step` (0-based): counted when it is this object's step."""
        if step != self.step:
            yield
            return
        resident, counter = step_counter(self.trainer)
        with counter:
            yield
        self.peak_bytes = resident + counter.peak
