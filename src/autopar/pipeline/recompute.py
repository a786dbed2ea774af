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
from .actions import Schedule
from .simulate import simulate


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


def stage_memory(saved: list[int], k: int, in_flight: int, state: int) -> int:
    """memory(stage, k) of the module docstring: predicted peak bytes of one stage with k recomputed blocks."""
    transient = max((saved[i] - saved[i + 1] for i in range(k)), default=0)
    return state + in_flight * saved[k] + max(0, transient)


def plan_recompute(saved: dict[int, list[int]], *, in_flight: dict[int, int], state_bytes: dict[int, int],
                   budget: float, last_stage: int) -> RecomputePlan:
    """Fewest recomputed blocks on these stages (one rank's) so that their memory sums to <= budget."""
    blocks = {s: 0 for s in saved}

    def total() -> int:
        return sum(stage_memory(saved[s], blocks[s], in_flight[s], state_bytes[s]) for s in saved)

    while total() > budget:
        options = []  # (last stage?, -saving per block, stage, new k): the next k that lowers memory
        for s in saved:
            k, now = blocks[s], stage_memory(saved[s], blocks[s], in_flight[s], state_bytes[s])
            for later in range(k + 1, len(saved[s])):
                after = stage_memory(saved[s], later, in_flight[s], state_bytes[s])
                if after < now:  # memory is not monotonic in k: skip steps that do not help yet
                    options.append((s == last_stage, -(now - after) / (later - k), s, later))
                    break
        if not options:
            best = sum(min(stage_memory(saved[s], k, in_flight[s], state_bytes[s]) for k in range(len(saved[s])))
                       for s in saved)
            raise ConfigError(f"no recomputation plan fits a memory budget of {budget / 2**20:.2f} MiB on stage(s) "
                              f"{sorted(saved)}; the least any plan needs is {best / 2**20:.2f} MiB. Raise "
                              f"--memory-budget-mb to at least that, use more pipeline stages, or smaller micro-batches")
        _, _, chosen, k = min(options)
        blocks[chosen] = k
    return RecomputePlan(blocks=blocks, budget=budget,
                         memory={s: stage_memory(saved[s], blocks[s], in_flight[s], state_bytes[s]) for s in saved})


@dataclass
class StageMemoryModel:
    """What the planner knows of one rank's stages: inputs to stage_memory() per stage."""

    saved: dict[int, list[int]]  # stage -> bytes kept per micro-batch with k = 0.. recomputed blocks
    in_flight: dict[int, int]  # stage -> micro-batches whose activations live at once
    state: dict[int, int]  # stage -> parameter, gradient and optimizer-state bytes (4 x parameters)

    def memory(self, stage: int, k: int) -> int:
        return stage_memory(self.saved[stage], k, self.in_flight[stage], self.state[stage])

    def least(self) -> int:
        """The least memory any choice of recomputed blocks needs on these stages together."""
        return sum(min(self.memory(s, k) for k in range(len(self.saved[s]))) for s in self.saved)


def stage_example_inputs(graph, stages: dict[int, nn.Module], device: torch.device) -> dict[int, tuple]:
    """Inputs shaped like each stage's real ones (from the traced values): ids and masks zeros, floats random."""
    nodes = {n.name: n for n in graph.graph.nodes}
    result = {}
    for s, stage in stages.items():
        values = graph.example_inputs if s == 0 else [nodes[name].meta["val"] for name in stage.spec.inputs]
        result[s] = tuple(torch.randn(v.shape, dtype=v.dtype, device=device) if v.is_floating_point()
                          else torch.zeros(v.shape, dtype=v.dtype, device=device) for v in values)
    return result


def stage_memory_model(stages: dict[int, nn.Module], schedule: Schedule, example_inputs: dict[int, tuple], *,
                       pp: int, num_microbatches: int, recomputed: frozenset[int]) -> StageMemoryModel:
    """Measure one rank's stages under `schedule` (num_stages = len(schedule's stages)).

    A stage the schedule recomputes whole (`recomputed`, its R) keeps only its stashed inputs
    plus one live micro-batch, so it has no block choice: saved = [live + stashed inputs].
    """
    num_stages = 1 + max(a.stage for actions in schedule.values() for a in actions)
    timeline = simulate(schedule, pp=pp, num_stages=num_stages, num_microbatches=num_microbatches)
    saved, state, in_flight = {}, {}, {}
    for s, stage in stages.items():
        inputs = example_inputs[s]
        saved[s] = measure_saved_bytes(stage, inputs)
        state[s] = 4 * sum(p.numel() * p.element_size() for p in stage.parameters())
        if s in recomputed:
            stash = sum(v.numel() * v.element_size() for v in inputs) * max(1, timeline.stashed_inputs.get(s, 1))
            saved[s] = [saved[s][0] + stash]
            in_flight[s] = 1
        else:
            in_flight[s] = max(1, timeline.peak_activations.get(s, 1))
    return StageMemoryModel(saved=saved, in_flight=in_flight, state=state)


def plan_pipeline_recompute(stages: dict[int, nn.Module], schedule: Schedule, example_inputs: dict[int, tuple],
                            budget: float, *, pp: int, num_microbatches: int,
                            recomputed: frozenset[int] = frozenset()) -> RecomputePlan:
    """Recomputed blocks for one rank's `stages` so that they fit `budget` bytes together (ConfigError if
    none does). Local to this rank: PipelineEngine makes the ranks agree. Does not set the stages' blocks."""
    model = stage_memory_model(stages, schedule, example_inputs, pp=pp, num_microbatches=num_microbatches,
                               recomputed=recomputed)
    num_stages = 1 + max(a.stage for actions in schedule.values() for a in actions)
    return plan_recompute(model.saved, in_flight=model.in_flight, state_bytes=model.state, budget=budget,
                          last_stage=num_stages - 1)
