"""The per-sample keys of a mask as one opaque operation when the model is compiled (torch.compile).

Inside a compiled region the step is a Python int that changes every step. Traced as it is, the
compiler would either bake it into the graph (a recompilation per step) or turn it into a symbolic
integer whose 32-bit mixing it must generate itself (inductor's C++ code generator types those
bitwise expressions as floats and fails to build: tried). So the step arrives as a tensor made
outside the compiled region (scope.micro_batch), and the [B] keys are computed by a custom operator
that runs the same eager code (mask.sample_keys): the same bits, no recompilation, while the
per-element hash on the activation, the expensive part, is still fused by the compiler.
"""

from __future__ import annotations

import torch

from .mask import sample_keys


@torch.library.custom_op("autopar::dropout_sample_keys", mutates_args=())
def compiled_sample_keys(seed: int, step: torch.Tensor, op: int, samples: torch.Tensor) -> torch.Tensor:
    """mask.sample_keys(seed, step, op, samples), as an operator the compiler calls rather than traces;
    `step`: a 0-d int64 CPU tensor (one host read, of a CPU tensor: no device wait)."""
    return sample_keys(seed, int(step), op, samples)


@compiled_sample_keys.register_fake
def _(seed: int, step: torch.Tensor, op: int, samples: torch.Tensor) -> torch.Tensor:
    return torch.empty(samples.shape, dtype=torch.int64, device=samples.device)
