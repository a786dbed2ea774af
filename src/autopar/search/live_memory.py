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
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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


class LiveTensorPeak(TorchDispatchMode):
    """Counts bytes of storages created inside the `with` block; `peak` is the most alive at once."""

    def __init__(self, resident: set[int] | None = None):
        super().__init__()
        self.resident = set(resident or ())
        self.live = 0
        self.peak = 0
        self._counted: dict[int, int] = {}

    def _freed(self, key: int) -> None:
        self.live -= self._counted.pop(key, 0)

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
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key)
        return out


def step_peak_bytes(trainer, step: int) -> int:
    """Run one training step of a set-up Trainer (after at least one step: optimizer states exist) and
    return this rank's peak live tensor bytes: resident parameters, gradient buffers, module buffers and
    optimizer states, plus the most bytes the step itself had alive at once."""
    params = list(trainer.model.parameters())
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    resident, keys = storage_bytes([*params, *(p.grad for p in params if p.grad is not None),
                                    *trainer.model.buffers(), *state])
    with LiveTensorPeak(keys) as counter:
        trainer.train_step(step)
    return resident + counter.peak
