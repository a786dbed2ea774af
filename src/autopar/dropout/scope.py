"""Which step and which samples the dropout being computed belongs to.

A mask needs (seed, step, global sample indices of the micro-batch); the operations that
draw masks (eager F.dropout calls, rewritten graph nodes) sit deep inside the model and
cannot be handed them as arguments without changing the model. So the trainer opens a
step scope, and whoever runs micro-batch i (the whole-model accumulation loop, the
pipeline runtime) opens `micro_batch(i)` inside it, like `torch.no_grad()` sets a flag
that operations read. The state lives in a ContextVar (per thread and task, restored on
exit), never in a mutable module global.

Recomputation re-enters the same micro-batch: the pipeline's R action calls
`micro_batch(i)` again, and block checkpointing captures the active scope at forward time
(`checkpoint_context_fn`) and restores it for the recomputation in backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DropoutScope:
    """The step and its micro-batches' global sample indices; `samples` set inside micro_batch(i)."""

    seed: int
    step: int
    micro_batches: tuple[tuple[int, ...], ...]
    samples: torch.Tensor | None = None  # int64 [B]: the current micro-batch's global sample indices
    scan_random_ops: bool = False  # check every aten operation of a model run whole for draws (eager.py)
    index: int | None = None  # which of the step's micro-batches (its position in `micro_batches`)
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)
    # per-element hashes by layout, shared by the step's micro-batches (they depend on shapes only)
    element_keys: dict = field(default_factory=dict, compare=False, repr=False)
    # the step as a tensor made outside any compiled region, so a compiled model reads it at run time
    # (compiled.py) instead of specialising, and recompiling, on each step's number
    step_tensor: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def samples_on(self, device: torch.device) -> torch.Tensor:
        if self.samples is None:
            raise RuntimeError("a dropout mask was requested inside a step scope but outside micro_batch(i)")
        if device not in self._on_device:
            self._on_device[device] = self.samples.to(device)
        return self._on_device[device]


_ACTIVE: ContextVar[DropoutScope | None] = ContextVar("autopar_dropout_scope", default=None)


def active_scope() -> DropoutScope | None:
    return _ACTIVE.get()


@contextlib.contextmanager
def _activate(scope: DropoutScope | None) -> Iterator[DropoutScope | None]:
    token = _ACTIVE.set(scope)
    try:
        yield scope
    finally:
        _ACTIVE.reset(token)


def dropout_step(seed: int, step: int, micro_batches: Sequence[Sequence[int]], *, scan_random_ops: bool = False):
    """Scope of one optimizer step: micro_batches[i] are the global sample indices of micro-batch i.

    scan_random_ops: a model run whole has every aten operation checked for random draws
    the layout-free set does not cover (eager.py); the trainer asks for it on a run's first step."""
    return _activate(DropoutScope(seed, step, tuple(tuple(int(g) for g in mb) for mb in micro_batches),
                                  scan_random_ops=scan_random_ops))


def micro_batch(index: int):
    """Scope of micro-batch `index` of the active step (a no-op outside a step: torch's own dropout runs)."""
    scope = _ACTIVE.get()
    if scope is None:
        return contextlib.nullcontext(None)
    if not 0 <= index < len(scope.micro_batches):
        raise RuntimeError(f"micro-batch {index} is outside the step's {len(scope.micro_batches)} micro-batches")
    samples = torch.tensor(scope.micro_batches[index], dtype=torch.int64)
    return _activate(DropoutScope(scope.seed, scope.step, scope.micro_batches, samples, scope.scan_random_ops,
                                  index, element_keys=scope.element_keys,
                                  step_tensor=torch.tensor(scope.step, dtype=torch.int64)))


def checkpoint_context_fn():
    """For torch.utils.checkpoint(context_fn=...): the recomputation runs in the scope its forward ran in."""
    scope = _ACTIVE.get()
    return contextlib.nullcontext(), _activate(scope)
