"""Model-state bytes of one rank under a ZeRO level: what autopar's zero/ and FSDP2 engines hold.

A small separate function for the strategy search's memory model (search/memory.py), to replace its
`params`, `grads` and `optimizer` pieces with these when a plan carries a zero level. The counts
are those benchmarks/zero_memory.py measures (docs/benchmarks.md), per parameter Ψ of the
stage, with d the dp degree and K the optimizer's fp32 bytes (OPTIMIZER_STATE_BYTES: AdamW 8):

  fp32                     params   grads                       optimizer (master + K)
    zero 0                 4        4                           K
    zero 1                 4        4 + 4/d  (full + fp32 shard) (4 + K)/d
    zero 2                 4        8/d  (landing + fp32 shard)  (4 + K)/d
    zero 3 (FSDP2)         4/d      4/d                         K/d
  bf16 (fp32 masters)
    zero 0                 2        2 + 4    (bf16 + fp32 copy)  4 + K
    zero 1                 2        2 + 6/d  (full, bf16 landing, fp32 shard)  (4 + K)/d
    zero 2                 2        6/d                         (4 + K)/d       (DeepSpeed's 2 + 18/d)
    zero 3 (FSDP2)         4/d      4/d                         K/d             (the ZeRO paper's 16/d)

The level-2 figures hold between micro-batches; during a backward the full gradient fills bucket by
bucket and is released only when the micro-batch's (or, in the pipeline engine, the step's)
reductions land, so at the end of a backward it is all alive once more: search/memory.py counts
it as a transient. benchmarks/zero_memory.py prints these formulas beside the measured bytes (equal
for every level at dp 2 and 4 under --dtype bf16: docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelStateBytes:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def zero_model_state_bytes(param_elements: int, *, zero: int, dp: int, optimizer_bytes: float,
                           bf16: bool = False) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state (with fp32 masters) one rank holds."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero level must be 0, 1, 2 or 3, got {zero!r}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp!r}")
    psi, k = float(param_elements), float(optimizer_bytes)
    if zero == 3:
        return ModelStateBytes(params=4 * psi / dp, grads=4 * psi / dp, optimizer=k * psi / dp)
    if not bf16:
        grads = {0: 4.0, 1: 4 + 4 / dp, 2: 8 / dp}[zero]  # zero 2: the data-parallel engine's landing buffer
        optimizer = k if zero == 0 else (4 + k) / dp
        return ModelStateBytes(params=4 * psi, grads=grads * psi, optimizer=optimizer * psi)
    grads = {0: 6.0, 1: 2 + 6 / dp, 2: 6 / dp}[zero]
    optimizer = 4 + k if zero == 0 else (4 + k) / dp
    return ModelStateBytes(params=2 * psi, grads=grads * psi, optimizer=optimizer * psi)
