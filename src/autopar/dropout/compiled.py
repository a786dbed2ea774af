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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mask import sample_keys
from .scope import active_scope


@torch.library.custom_op("autopar::dropout_sample_keys", mutates_args=())
def compiled_sample_keys(seed: int, step: torch.Tensor, op: int, samples: torch.Tensor) -> torch.Tensor:
    """mask.sample_keys(seed, step, op, samples), as an operator the compiler calls rather than traces;
    `step`: a 0-d int64 CPU tensor (one host read, of a CPU tensor: no device wait)."""
    return sample_keys(seed, int(step), op, samples)


@compiled_sample_keys.register_fake
def _(seed: int, step: torch.Tensor, op: int, samples: torch.Tensor) -> torch.Tensor:
    return torch.empty(samples.shape, dtype=torch.int64, device=samples.device)


@dataclass(frozen=True)
class ScopeAtRunTime:
    """Stands for the active step scope in a compiled stage piece: `batch` samples, sub-batch `subbatch` of the
    micro-batch (tensor-parallel sub-batches), read by `scope_keys` when the graph runs."""

    batch: int
    subbatch: int = 0


@torch.library.custom_op("autopar::dropout_scope_keys", mutates_args=())
def scope_keys(op: int, batch: int, subbatch: int, device: torch.device) -> torch.Tensor:
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
    return sample_keys(scope.seed, scope.step, op, samples.to(device))


@scope_keys.register_fake
def _(op: int, batch: int, subbatch: int, device: torch.device) -> torch.Tensor:
    return torch.empty((batch,), dtype=torch.int64, device=device)
