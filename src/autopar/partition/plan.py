"""Choose where to cut a traced model into pipeline stages, and explain the choice.

Methods:
- `uniform`: equal numbers of repeated layers per stage (embedding with the first stage,
  head with the last);
- `parameters`: balanced parameter counts (what Merak does);
- `time`: the PipeDream dynamic program on estimated (or measured) forward+backward time,
  with the transfer of each cut's crossing tensors charged to the sending stage and an
  optional per-stage memory cap.

When blocks were not timed, time comes from FLOPs and bytes through `CostModel`, whose
rates are rough defaults stated here rather than hidden: only ratios between stages matter
for where the cuts fall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import copy

import torch
from torch import nn
from torch.export.graph_signature import InputKind

from ..config import PARTITION_METHODS
from ..errors import ConfigError, ModelError, choices
from ..models.materialize import materialize_partial
from ..trace import ModelGraph
from . import algorithms
from .stages import StageModule, StageSpec, lifted_constant_values, materialize_stage, plan_stages

METHODS = PARTITION_METHODS  # named once, in config.py


@dataclass(frozen=True)
class CostModel:
    """Rates that turn FLOPs and bytes into seconds when blocks were not measured."""

    flops_per_s: float = 2e10  # sustained forward+backward compute of one rank
    bytes_per_s: float = 1e9  # point-to-point bandwidth between neighbouring stages
    backward_factor: float = 2.0  # backward FLOPs per forward FLOP
    state_bytes_per_param_byte: float = 4.0  # weight + gradient + two AdamW moments


@dataclass
class CrossingValue:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    needs_grad: bool  # floating point: its gradient travels back


@dataclass
class StageReport:
    index: int
    blocks: list[str]
    num_params: int
    est_time_s: float
    activation_bytes: int
    memory_bytes: int  # activations of one micro-batch + parameter state


@dataclass
class Partition:
    """A cut of the model into stages, with what each stage holds and what crosses each cut."""

    method: str
    bounds: list[int]
    specs: list[StageSpec]
    stages: list[StageReport]
    boundaries: list[list[CrossingValue]]  # boundaries[s]: sent from stage s to s + 1
    shared: dict[str, list[int]]  # parameter read by several stages -> those stages (gradients summed)
    graph: ModelGraph = field(repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.specs)

    def build_stage(self, index: int) -> StageModule:
        """Stage `index` as a module on the meta device (see stages.materialize_stage)."""
        return StageModule(self.graph, self.specs[index], self.num_stages)

    def materialize_stage(self, index: int, model: nn.Module, device: str | torch.device = "cpu", *,
                          seed: int) -> StageModule:
        """Stage `index` with real weights, initialised exactly as `materialize(model, seed=seed)` would.

        `model` is the meta-device model that was traced; only this stage's parameters (plus
        one scratch buffer) are allocated, so a rank never holds the whole model.
        """
        source = materialize_partial(copy.deepcopy(model), set(self.specs[index].params), device, seed=seed)
        stage = self.build_stage(index)
        unknown = [fqn for fqn, value in stage.constants.items() if value is None]
        if unknown:  # only those: the re-trace's copy holds no init, so its buffers are garbage
            values = lifted_constant_values(model, self.graph, torch.device(device))
            stage.constants.update({fqn: values[fqn] for fqn in unknown if fqn in values})
        return materialize_stage(stage, source, device)

    def layers_per_stage(self) -> list[int]:
        """How many repeated layers each stage holds (the prelude and postlude are not layers)."""
        layers = {path for stack in self.graph.stacks for path in stack.member_paths}
        return [sum(name in layers for name in spec.blocks) for spec in self.specs]

    def layers_line(self) -> str:
        """Which stack was cut and how its layers fell: a badly balanced cut shows here, not only in the speed."""
        if not self.graph.stacks:
            return "layers cut: none (no repeated layers found: the model is one block)"
        per_stage = ", ".join(str(n) for n in self.layers_per_stage())
        return (f"layers cut: {'; '.join(stack.describe() for stack in self.graph.stacks)}; "
                f"layers per stage {per_stage}")

    def to_dict(self) -> dict:
        return {"method": self.method, "bounds": self.bounds, "shared_parameters": self.shared,
                "stacks": [stack.to_dict() for stack in self.graph.stacks], "layers_per_stage": self.layers_per_stage(),
                "stages": [vars(s) for s in self.stages],
                "boundaries": [[{**vars(v), "shape": list(v.shape)} for v in b] for b in self.boundaries]}

    def table(self) -> str:
        slowest = max(s.est_time_s for s in self.stages) or 1.0
        lines = [f"partition: {self.num_stages} stages, method {self.method}", self.layers_line(),
                 f"{'stage':>5}  {'blocks':<34} {'params':>11} {'est time':>10} {'load':>5} {'act/mb':>10} "
                 f"{'memory':>10}"]
        for s in self.stages:
            span = s.blocks[0] if len(s.blocks) == 1 else f"{s.blocks[0]} .. {s.blocks[-1]} ({len(s.blocks)})"
            lines.append(f"{s.index:>5}  {span:<34} {s.num_params:>11,} {s.est_time_s * 1e3:>8.2f}ms "
                         f"{s.est_time_s / slowest:>5.2f} {_mb(s.activation_bytes):>10} {_mb(s.memory_bytes):>10}")
        for s, values in enumerate(self.boundaries):
            sent = ", ".join(f"{v.name}{list(v.shape)}{'' if v.needs_grad else ' (no grad)'}" for v in values)
            lines.append(f"  cut {s}->{s + 1}: {_mb(sum(v.bytes for v in values))} in {len(values)} tensor(s): {sent}")
        for fqn, stages in self.shared.items():
            lines.append(f"  shared parameter {fqn} on stages {stages}: gradients summed every step")
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**18 else f"{n / 2**10:.1f} KiB"


def _value_table(graph: ModelGraph) -> tuple[dict[str, int], dict[str, int], dict[str, CrossingValue]]:
    """For each tensor value: block that defines it (-1: model input), last block that reads it."""
    last_block = len(graph.blocks) - 1
    defined: dict[str, int] = {}
    last_use: dict[str, int] = {}
    info: dict[str, CrossingValue] = {}
    users = {spec.arg.name for spec in graph.exported.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT}
    for node in graph.graph.nodes:
        if node.op == "placeholder" and node.name in users:
            defined[node.name] = -1
        elif node.op == "call_function":
            defined[node.name] = graph.nodes[node.name].block
        if node.op in ("call_function", "output"):
            here = last_block if node.op == "output" else graph.nodes[node.name].block
            for arg in node.all_input_nodes:
                if arg.name in defined:
                    last_use[arg.name] = max(last_use.get(arg.name, -1), here)
        value = node.meta.get("val")
        if node.name in defined and isinstance(value, torch.Tensor):
            info[node.name] = CrossingValue(node.name, tuple(value.shape), str(value.dtype).replace("torch.", ""),
                                            value.numel() * value.element_size(), value.is_floating_point())
    return defined, last_use, info


def crossings(graph: ModelGraph) -> list[list[CrossingValue]]:
    """crossings(graph)[c]: the tensors that cross a cut between block c and block c + 1."""
    defined, last_use, info = _value_table(graph)
    result = []
    for c in range(len(graph.blocks) - 1):
        result.append([info[v] for v in defined if defined[v] <= c < last_use.get(v, -1) and v in info])
    return result


def stage_units(graph: ModelGraph) -> list[int]:
    """The first block of each unit a cut may fall between: one block with parameters, with the
    parameter-free blocks after it (an activation, a log_softmax, an empty prelude or postlude).

    A stage of parameter-free blocks alone would give a rank nothing to train and only pass
    activations on (a cost model that prices transfers above elementwise work even prefers it
    for small models), so no method cuts there. A model made only of such blocks is one unit.
    """
    starts = [i for i, block in enumerate(graph.blocks) if block.params]
    return [0, *starts[1:]] if starts else [0]


def check_units(graph: ModelGraph, num_stages: int, asked: str) -> None:
    """Refuse more stages than units (stage_units), naming the blocks that hold parameters.

    `asked`: how the stage count was requested ("pp=3 stages", "pp=2 x chunks=2 = 4 stages")."""
    units = stage_units(graph)
    if num_stages <= len(units) or len(units) == len(graph.blocks):  # (all parameterised: algorithms says so)
        return
    named = [b.name for b in graph.blocks if b.params]
    free = [b.name for b in graph.blocks if not b.params]
    raise ConfigError(f"{asked}, but the model has only {len(named)} parameterised blocks ({', '.join(named)}): every "
                      f"stage needs one, and the parameter-free ones ({', '.join(free)}) join a neighbouring stage; "
                      f"use at most {len(units)} stages (pp <= {len(units)})")


def partition(graph: ModelGraph, num_stages: int, *, method: str = "time", memory_cap_bytes: float | None = None,
              cost_model: CostModel = CostModel(), stage_speeds: Sequence[float] | None = None) -> Partition:
    """Cut `graph` into `num_stages` stages with the given method; cuts fall only between units
    (stage_units), so every stage holds at least one block with parameters. `stage_speeds`: the relative
    rate of each stage's device ('time' balances compute / rate; the other methods ignore it)."""
    if method not in METHODS:
        raise ConfigError(f"unknown partition method {method!r}; use one of {choices(METHODS)}")
    if graph.layers_path is None and num_stages > 1:
        raise ModelError(f"{num_stages} pipeline stages need a stack of blocks to cut between, and the traced model "
                         f"has none: hold the repeated layers in an nn.ModuleList or an nn.Sequential of at least 2 "
                         f"modules, an nn.ModuleDict or attributes of one module (two or more blocks of one class and "
                         f"shape), or use pp=1 (tensor and data parallelism need no stack)")
    check_units(graph, num_stages, f"pp={num_stages} stages")
    blocks = graph.blocks
    cut_values = crossings(graph)
    elem = _param_bytes(graph)
    compute = [b.time_s if b.time_s is not None else
               b.flops * (1 + cost_model.backward_factor) / cost_model.flops_per_s for b in blocks]
    transfer = [2 * sum(v.bytes for v in values) / cost_model.bytes_per_s for values in cut_values] + [0.0]
    memory = [b.activation_bytes + sum(elem[p] for p in b.params) * cost_model.state_bytes_per_param_byte
              for b in blocks]
    starts = stage_units(graph)
    spans = list(zip(starts, [*starts[1:], len(blocks)]))  # each unit's blocks [a, b)
    per_unit = lambda values: [sum(values[a:b]) for a, b in spans]  # noqa: E731
    if method == "uniform":
        repeated = [any(0 < i < len(blocks) - 1 for i in range(a, b)) for a, b in spans]
        if sum(repeated) >= num_stages:
            cuts = algorithms.uniform(len(spans), num_stages, weights=repeated)
        else:  # fewer layers than stages: embedding and head become stages of their own
            cuts = algorithms.uniform(len(spans), num_stages)
    elif method == "parameters":
        cuts = algorithms.balanced(per_unit([b.num_params for b in blocks]), num_stages)
    else:
        if memory_cap_bytes is not None:
            fits = max(algorithms.stage_costs(per_unit(memory), algorithms.balanced(per_unit(memory), num_stages)))
            if fits > memory_cap_bytes:
                raise ConfigError(f"no {num_stages}-stage partition fits a per-stage memory cap of "
                                  f"{memory_cap_bytes / 2**20:.3g} MiB; the smallest cap that fits is "
                                  f"{fits / 2**20:.2f} MiB (or use more stages, or a smaller micro-batch)")
        cuts = algorithms.min_max_time(per_unit(compute), num_stages, transfer=[transfer[b - 1] for _, b in spans],
                                       memory=per_unit(memory), memory_cap=memory_cap_bytes, speeds=stage_speeds)
    bounds = [*(starts[u] for u in cuts[:-1]), len(blocks)]
    specs = plan_stages(graph, bounds)
    stages = []
    for spec in specs:
        a, b = bounds[spec.index], bounds[spec.index + 1]
        send = transfer[b - 1] if b < len(blocks) else 0.0
        stages.append(StageReport(index=spec.index, blocks=spec.blocks,
                                  num_params=sum(graph.param_numel[p] for p in spec.params),
                                  est_time_s=sum(compute[a:b]) / (stage_speeds[spec.index] if stage_speeds and
                                                                  method == "time" else 1.0) + send,
                                  activation_bytes=sum(blk.activation_bytes for blk in blocks[a:b]),
                                  memory_bytes=int(sum(blk.activation_bytes for blk in blocks[a:b]) +
                                                   sum(elem[p] for p in spec.params) *
                                                   cost_model.state_bytes_per_param_byte)))
    users: dict[str, list[int]] = {}
    for spec in specs:
        for p in spec.params:
            users.setdefault(p, []).append(spec.index)
    shared = {p: s for p, s in users.items() if len(s) > 1}
    boundaries = [cut_values[bounds[s + 1] - 1] for s in range(num_stages - 1)]
    return Partition(method=method, bounds=bounds, specs=specs, stages=stages, boundaries=boundaries,
                     shared=shared, graph=graph)


def _param_bytes(graph: ModelGraph) -> dict[str, int]:
    state = graph.exported.state_dict
    return {fqn: state[graph.export_name(fqn)].numel() * state[graph.export_name(fqn)].element_size()
            for fqn in graph.param_numel}
