"""Dropout keys inside a compiled region (torch.compile): read when the graph runs, never baked into it.

A mask needs the step and the micro-batch's global sample indices, which change every step and
every micro-batch. Traced as Python values, the compiler would bake them into the graph (a
recompilation per step) or turn the step into a symbolic integer whose 32-bit mixing it must
generate itself (inductor's C++ code generator types those bitwise expressions as floats and fails
to build: tried); reading the step scope (a ContextVar) breaks the graph. So the [B] per-sample keys
come from custom operators the compiler calls rather than traces, running the same eager code
(mask.sample_keys): the same bits, no recompilation, no graph break, while the per-element hash on
the activation, the expensive part, is still fused by the compiler.

- `compiled_sample_keys`: the whole-model path, whose dropout mode already holds the scope: the step
  arrives as a tensor made outside the region (scope.micro_batch);
- `scope_keys`: the traced stage pieces, whose dropout nodes would read the scope themselves: the
  operator reads it when the graph runs (a recomputation in backward runs under the restored scope).

The operation number reaches the graph at run time too (`OpAtRunTime`: a 0-d int64 CPU tensor, plus the
number of draws before it in the region): baked in as a constant, it would make each copy of a repeated
block a graph of its own (block k's dropouts are operations 3k, 3k+1, ...), so n blocks would compile n
times instead of once with inductor's cache serving the rest. `eager.compiled_region` wraps a compiled
region's forward so that a model run whole numbers its draws from such a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .mask import sample_keys
from .scope import active_scope


class OpAtRunTime(NamedTuple):
    """Operation number `int(base) + offset`, with `base` a 0-d int64 CPU tensor the compiled graph takes as an
    input: identical blocks trace identical graphs (same offsets), whatever their place in the model."""

    base: torch.Tensor
    offset: int


def op_number(op: int | OpAtRunTime) -> int:
    """The operation number as an int (outside a compiled graph)."""
    return int(op.base) + op.offset if isinstance(op, OpAtRunTime) else op


def _split(op: int | OpAtRunTime) -> tuple[Optional[torch.Tensor], int]:
    return (op.base, op.offset) if isinstance(op, OpAtRunTime) else (None, op)


def _number(base: Optional[torch.Tensor], op: int) -> int:
    return op if base is None else int(base) + op


@torch.library.custom_op("autopar::dropout_sample_keys", mutates_args=())
def _compiled_sample_keys(seed: int, step: torch.Tensor, op_base: Optional[torch.Tensor], op: int,
                          samples: torch.Tensor) -> torch.Tensor:
    """mask.sample_keys(seed, step, op_base + op, samples), as an operator the compiler calls rather than traces;
    `step`, `op_base`: 0-d int64 CPU tensors (host reads of CPU tensors: no device wait)."""
    return sample_keys(seed, int(step), _number(op_base, op), samples)


@_compiled_sample_keys.register_fake
def _(seed: int, step: torch.Tensor, op_base: Optional[torch.Tensor], op: int, samples: torch.Tensor) -> torch.Tensor:
    return torch.empty(samples.shape, dtype=torch.int64, device=samples.device)


def compiled_sample_keys(seed: int, step: torch.Tensor, op: int | OpAtRunTime, samples: torch.Tensor) -> torch.Tensor:
    """The per-sample keys of operation `op` inside a compiled region of a model run whole."""
    return _compiled_sample_keys(seed, step, *_split(op), samples)


@dataclass(frozen=True)
class ScopeAtRunTime:
    """Stands for the active step scope in a compiled stage piece: `batch` samples, sub-batch `subbatch` of the
    micro-batch (tensor-parallel sub-batches), read by `scope_keys` when the graph runs."""

    batch: int
    subbatch: int = 0


@torch.library.custom_op("autopar::dropout_scope_keys", mutates_args=())
def _scope_keys(op_base: Optional[torch.Tensor], op: int, batch: int, subbatch: int,
                device: torch.device) -> torch.Tensor:
    """The per-sample keys of operation `op` for the active scope's micro-batch (its sub-batch `subbatch` of
    `batch` samples). Outside a trainer step (a model called directly), random keys: a random mask, as torch's."""
    scope = active_scope()
    if scope is None or scope.samples is None:
        return torch.randint(0, 2**32, (batch,), dtype=torch.int64, device=device)
    samples = scope.samples
    if len(samples) != batch:
        if len(samples) < (subbatch + 1) * batch:
            raise RuntimeError(f"a dropout was compiled for {batch} samples, but the micro-batch has {len(samples)}")
        samples = samples[subbatch * batch:(subbatch + 1) * batch]
    return sample_keys(scope.seed, scope.step, _number(op_base, op), samples.to(device))


@_scope_keys.register_fake
def _(op_base: Optional[torch.Tensor], op: int, batch: int, subbatch: int, device: torch.device) -> torch.Tensor:
    return torch.empty((batch,), dtype=torch.int64, device=device)


def scope_keys(op: int | OpAtRunTime, batch: int, subbatch: int, device: torch.device) -> torch.Tensor:
    """The per-sample keys of operation `op` in a compiled stage piece, for the scope active when it runs."""
    return _scope_keys(*_split(op), batch, subbatch, device)
