"""Stage-aware recomputation: how many blocks of each stage recompute, chosen to fit a memory budget.

Merak leaves the recomputation ratio to the user; we choose it. A stage holding k
recomputed blocks keeps only those blocks' inputs and recomputes the rest during backward
(StageModule.recompute_blocks). Per micro-batch, the bytes autograd keeps are *measured*
for every k with saved-tensor hooks (exact on CPU, recomputation's own saved inputs
included), then:

    memory(stage, k) = state_bytes + in_flight * saved(k) + transient(k)

where in_flight is the most micro-batches whose activations the schedule keeps alive on
that stage at once (from the simulator: p - s for 1F1B, m for GPipe), and transient(k) the
largest block recomputed at a time during backward. Each rank picks, for its stages, the
fewest recomputed blocks that fit its budget, taking from the stage that saves the most per
block first and from the last stage (one micro-batch in flight, nothing to gain) last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError


def measure_saved_bytes(stage: nn.Module, inputs: tuple[torch.Tensor, ...]) -> list[int]:
    """saved[k]: bytes autograd keeps after one forward with k recomputed blocks, k = 0..num_blocks."""
    weights = ({p.untyped_storage().data_ptr() for p in stage.parameters()}
               | {b.untyped_storage().data_ptr() for b in stage.buffers()})
    original = stage.recompute_blocks
    result = []
    try:
        for k in range(stage.num_blocks + 1):
            stage.recompute_blocks = k
            total = 0
            seen: set[int] = set()

            def pack(t: torch.Tensor) -> torch.Tensor:
                nonlocal total
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in weights and key not in seen:  # one storage saved by several ops counts once
                    seen.add(key)
                    total += storage.nbytes()
                return t

            x = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in inputs)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                stage(*x)
            result.append(total)
    finally:
        stage.recompute_blocks = original
    return result


@dataclass
class RecomputePlan:
    blocks: dict[int, int]  # stage -> recomputed blocks
    memory: dict[int, int]  # stage -> predicted peak bytes with that choice
    budget: float

    def describe(self) -> str:
        parts = [f"stage {s}: {k} block(s) recomputed, {self.memory[s] / 2**20:.1f} MiB" for s, k in sorted(self.blocks.items())]
        return f"recomputation for a budget of {self.budget / 2**20:.1f} MiB: " + "; ".join(parts)


def _memory(saved: list[int], k: int, in_flight: int, state: int) -> int:
    transient = max((saved[i] - saved[i + 1] for i in range(k)), default=0)
    return state + in_flight * saved[k] + max(0, transient)


def plan_recompute(saved: dict[int, list[int]], *, in_flight: dict[int, int], state_bytes: dict[int, int],
                   budget: float, last_stage: int) -> RecomputePlan:
    """Fewest recomputed blocks on these stages (one rank's) so that their memory sums to <= budget."""
    blocks = {s: 0 for s in saved}

    def total() -> int:
        return sum(_memory(saved[s], blocks[s], in_flight[s], state_bytes[s]) for s in saved)

    while total() > budget:
        options = []  # (last stage?, -saving per block, stage, new k): the next k that lowers memory
        for s in saved:
            k, now = blocks[s], _memory(saved[s], blocks[s], in_flight[s], state_bytes[s])
            for later in range(k + 1, len(saved[s])):
                after = _memory(saved[s], later, in_flight[s], state_bytes[s])
                if after < now:  # memory is not monotonic in k: skip steps that do not help yet
                    options.append((s == last_stage, -(now - after) / (later - k), s, later))
                    break
        if not options:
            best = sum(min(_memory(saved[s], k, in_flight[s], state_bytes[s]) for k in range(len(saved[s])))
                       for s in saved)
            raise ConfigError(f"no recomputation plan fits a memory budget of {budget / 2**20:.2f} MiB on stage(s) "
                              f"{sorted(saved)}; the least any plan needs is {best / 2**20:.2f} MiB. Raise "
                              f"--memory-budget-mb to at least that, use more pipeline stages, or smaller micro-batches")
        _, _, chosen, k = min(options)
        blocks[chosen] = k
    return RecomputePlan(blocks=blocks, budget=budget,
                         memory={s: _memory(saved[s], blocks[s], in_flight[s], state_bytes[s]) for s in saved})
