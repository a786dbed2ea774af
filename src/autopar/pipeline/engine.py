"""The pipeline engine: this rank's stage(s) of a traced and partitioned model, run by a schedule.

It exposes the same operations to the trainer as train/engine.py's DataParallelEngine.
Tensor parallelism runs through this engine (a single stage when pp=1), because it
rewrites the traced stage graphs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._torch_internals import parameter_table
from ..config import PARTITION_METHODS, Strategy
from ..context_parallel import ContextParallel
from ..data.datasets import IGNORE_INDEX
from ..distributed import backend_for, group_options
from ..mesh import ProcessMesh, stage_rank_table
from ..train.base import EngineBase
from ..partition.stages import _set_by_path
from ..running_stats import GraphBatchNorm, RunningStatsReplay, batch_norm_layers
from .actions import Action, stage_to_rank
from .build import build_local_pipeline
from .expert_stages import DenseAndExpertGradients, expert_groups_on_mesh, expert_load, expert_squares
from .hetero_boundary import HeteroBoundary
from .simulate import timeline_from_events
from ..train.loss import Batch, LossFn, token_loss_sum
from ..zero import ShardedGradients, gradient_sync, to_compute_dtype
from ..zero.fully_sharded import FullyShardedStages, local_tensor

SHARDED = (ShardedGradients, FullyShardedStages)  # gradients held as this replica's shards


class LocalStages(nn.Module):
    """This rank's stage modules seen as one module under the model's own parameter names.

    Stages of one rank that read the same parameter (a tied embedding on two chunks) share
    one Parameter object, so checkpoints and the optimizer see each name once.
    `adopt`: hold the stages' own Parameter objects instead (ZeRO-3: FSDP2 owns them, and swaps
    the stage's attribute between its sharded and gathered parameter; this view keeps the shard).
    """

    def __init__(self, stages: dict[int, nn.Module], adopt: bool = False):
        super().__init__()
        for stage in stages.values():
            for name, p in stage.named_parameters():
                try:
                    existing = self.get_parameter(name)
                except AttributeError:
                    _set_by_path(self, name, p.data, buffer=False, requires_grad=p.requires_grad)
                    if adopt:
                        _assign(self, name, p)
                    existing = self.get_parameter(name)
                if not adopt:
                    _assign(stage, name, existing)
            persistent = set(stage.state_dict().keys())
            for name, b in stage.named_buffers():
                try:
                    self.get_buffer(name)
                except AttributeError:
                    _set_by_path(self, name, b, buffer=True, persistent=name in persistent)


def _assign(module: nn.Module, fqn: str, param: nn.Parameter) -> None:
    owner_path, _, attr = fqn.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    parameter_table(owner)[attr] = param


class PipelineEngine(EngineBase):
    """This rank's pipeline stage(s), run by a schedule; gradients synchronised over dp and tied stages."""

    def __init__(self, model: nn.Module, mesh: ProcessMesh, *, device: torch.device, seed: int,
                 example_batch: Batch, num_microbatches: int, autocast: Callable, timeout_s: float,
                 strategy: Strategy, param_dtype: torch.dtype = torch.float32, boundary_link=None,
                 stage_speeds: tuple[float, ...] | None = None):
        """boundary_link: what --boundary auto costs its choice on (a search.cluster.Cluster; None: nominal).
        stage_speeds: each stage's device rate, which --partition time balances on (None: all alike)."""
        self.mesh, self.autocast, self.device = mesh, autocast, device
        self.stage_tp = strategy.stage_tps  # None: every stage has strategy.tp
        tp, boundary = strategy.tp, None
        if self.stage_tp is not None:  # stages of different tp degrees (mesh.StageMesh)
            tp = mesh.size("tp")
            boundary = HeteroBoundary(mesh.table, stage=mesh.stage, dp_index=mesh.dp_index, tp_index=mesh.tp_index,
                                      device=device, num_microbatches=num_microbatches, method=strategy.pipeline.boundary,
                                      timeout_s=timeout_s, link=boundary_link)
        elif strategy.pipeline.boundary != "direct":  # equal tp stages, boundaries planned (scatter-gather: 1/tp per link)
            table = stage_rank_table((strategy.tp,) * strategy.pp, strategy.dp)  # the (pp, dp, tp) mesh's numbering
            boundary = HeteroBoundary(table, stage=mesh.local_rank("pp"), dp_index=mesh.local_rank("dp"),
                                      tp_index=mesh.local_rank("tp"), device=device, num_microbatches=num_microbatches,
                                      method=strategy.pipeline.boundary, timeout_s=timeout_s, link=boundary_link)
        self.context_parallel = (ContextParallel(strategy.cp, mesh.local_rank("cp"), strategy.cp_mode, mesh.group("cp"),
                                                 tp=strategy.tp, sp=strategy.sp)
                                 if strategy.cp > 1 else None)  # the sequence split (context_parallel/)
        self.ep = strategy.ep  # experts sharded over ep dp ranks of each stage (pipeline/expert_stages.py)
        self.ep_group, replicas, ep_rank = (expert_groups_on_mesh(mesh, self.ep, device, timeout_s) if self.ep > 1
                                            else (None, None, 0))
        self.pipe = build_local_pipeline(
            model, pp=strategy.pp, pp_rank=mesh.local_rank("pp"),
            pp_group=None if self.stage_tp is not None else mesh.group("pp"),
            device=device, seed=seed,
            example_batch=example_batch, num_microbatches=num_microbatches, schedule=strategy.pipeline.schedule,
            chunks=strategy.pipeline.chunks, partition_method=strategy.pipeline.partition, recompute=strategy.pipeline.recompute,
            memory_budget_bytes=None if strategy.pipeline.memory_budget_mb is None else strategy.pipeline.memory_budget_mb * 2**20,
            tp=tp, tp_group=mesh.group("tp") if tp > 1 else None,
            tp_subbatches=strategy.pipeline.tp_subbatches, sp=strategy.sp, autocast=autocast, p2p=boundary,
            stage_tp=self.stage_tp, context_parallel=self.context_parallel, ep=self.ep, ep_group=self.ep_group,
            ep_rank=ep_rank, stage_speeds=stage_speeds)
        pipe = self.pipe
        self.pp, self.pp_rank, self.num_stages = pipe.pp, pipe.pp_rank, pipe.num_stages
        self.partition, self.stages, self.schedule, self.runtime = pipe.partition, pipe.stages, pipe.schedule, pipe.runtime
        self.actions, self.eval_actions = pipe.actions, pipe.eval_actions
        self.tensor_parallel, self.experts = pipe.tensor_parallel, pipe.experts
        self.waits = pipe.runtime.waits  # this rank's waits for its peers, per step (stats_slots reads them)
        self.tp_rank = mesh.local_rank("tp")
        self.recompute_plan, self.recompute_report = pipe.recompute_plan, pipe.recompute_report
        self._tied_names: dict[int, str] = {}  # --stage-tp: tied parameters summed as whole tensors
        if strategy.replicas.zero == 3:  # parameters sharded over this stage's dp group by FSDP2 (zero/fully_sharded.py)
            self.sync = FullyShardedStages(list(self.stages.values()), mesh.device_mesh["dp"], mesh.group("dp"),
                                           param_dtype=param_dtype, device=device)
            self.module = LocalStages(self.stages, adopt=True)
            self._shared = self._shared_groups(device, pipe.placement, timeout_s)
        else:
            self.module = LocalStages(self.stages)
            to_compute_dtype(self.module.parameters(), param_dtype)
            self._shared = self._shared_groups(device, pipe.placement, timeout_s)
            # zero 1/2: the dp group of this stage and tp shard; tied weights reduced over stages first
            names = set(self.experts.rows) if self.experts is not None else set()
            self.expert_params = [p for n, p in self.module.named_parameters() if n in names and p.requires_grad]
            expert_ids = {id(p) for p in self.expert_params}
            self.sync = gradient_sync([p for p in self.module.parameters() if id(p) not in expert_ids],
                                      mesh.gradient_group(), zero=strategy.replicas.zero,
                                      master_weights=param_dtype != torch.float32,
                                      deferred=[p for p, _, _ in self._shared], device=device)
            if self.experts is not None:
                self.sync = DenseAndExpertGradients(self.sync, self.expert_params, replicas)
        # BatchNorm buffers of this rank's stages: recorded per micro-batch by the stage graphs, replayed over
        # the stage's replicas in one process's order after each step (running_stats/)
        # (--batchnorm sync: normalised over the stage's replicas' micro-batches together; nothing to gather)
        momenta = {name: m.momentum for name, m in batch_norm_layers(model).items()}
        sync = strategy.replicas.batchnorm == "sync" and mesh.dp_size > 1
        self.running_stats = RunningStatsReplay(self.module, momenta, mesh.group("dp"), mesh.dp_rank, mesh.dp_size,
                                                gather=not sync)
        for stage in self.stages.values():
            for piece_module in stage.modules():
                if isinstance(piece_module, GraphBatchNorm) and sync:
                    piece_module.sync_group = mesh.group("dp")
        self.last_step = None  # the runtime's record of the last training step (timing read on demand)

    @property
    def sliced_state(self) -> Any:
        if self.experts is None:
            return self.tensor_parallel
        from ..experts.shard import ExpertsBeside
        return ExpertsBeside(self.experts, self.tensor_parallel)

    def token_loss_sum(self, output: Any, batch: Batch) -> torch.Tensor:
        if self.tensor_parallel is None:
            return token_loss_sum(output, batch)
        return self.tensor_parallel.loss_sum(output, batch, IGNORE_INDEX)

    def compile_regions(self) -> list[tuple[str, nn.Module]]:
        """--compile: each stage's pieces (one traced graph per block, tensor-parallel ones included)."""
        return [(f"stage {index} block {i}", piece) for index, stage in sorted(self.stages.items())
                for i, piece in enumerate(stage.pieces)]

    def banner_lines(self) -> list[str]:
        """What this engine chose that the run should say at its start: the layers cut, the TP split, the recomputation."""
        lines = [self.partition.layers_line()] if self.partition.num_stages > 1 else []
        if self.context_parallel is not None:
            lines.append(self.context_parallel.summary())
        if self.tensor_parallel is not None:
            lines.append(self.tensor_parallel.plan.summary() + " (tp_plan.txt)")
        if self.experts is not None:
            lines.append(self.experts.summary(self.mesh.dp_size))
        if self.recompute_report is not None:
            blocks = sorted(self.recompute_report.blocks.items())
            chosen = (", ".join(f"stage {s}: {k}" for s, k in blocks) if any(k for _, k in blocks)
                      else "none, it fits without")
            lines.append(f"memory budget {self.recompute_report.budget / 2**20:g} MiB per rank: blocks recomputed "
                         f"{chosen} (recompute_plan.txt)")
        return lines

    def recomputed_forward_fraction(self) -> float:
        """Traced forward FLOPs of the blocks recomputed in backward (whole stages the schedule recomputes, or the
        blocks a memory budget chose per stage) over the whole model's."""
        blocks = self.partition.graph.blocks
        budgeted = self.recompute_report.blocks if self.recompute_report is not None else {}
        again = 0
        for spec in self.partition.specs:
            first, last = spec.block_range
            count = last - first if spec.index in self.pipe.recompute else budgeted.get(spec.index, 0)
            again += sum(block.flops for block in blocks[first:first + count])
        return again / max(1, sum(block.flops for block in blocks))

    def run_files(self) -> dict[str, str]:
        """Files for the run folder (name -> text): the TP plan table and the recomputation plan."""
        files = {}
        if self.tensor_parallel is not None:
            files["tp_plan.txt"] = self.tensor_parallel.plan.table() + "\n"
        if self.experts is not None:
            files["expert_plan.txt"] = self.experts.plan.table(self.ep) + "\n"
        if self.recompute_report is not None:
            files["recompute_plan.txt"] = (self.recompute_report.describe().replace("; ", "\n  ").replace(": ", ":\n  ", 1)
                                           + "\n(budget per pipeline rank, from --memory-budget-mb)\n")
        return files

    def _trained_ties(self) -> list[tuple[str, list[int]]]:
        """(name, owning stages) of the parameters read by several stages whose gradients are summed between
        them: a frozen one (requires_grad False, as the model's single Parameter says on every rank) has none."""
        graph = self.partition.graph
        return [(fqn, stages) for fqn, stages in sorted(self.partition.shared.items())
                if graph.exported.state_dict[graph.export_name(fqn)].requires_grad]

    def _shared_groups(self, device: torch.device, placement: str,
                       timeout_s: float) -> list[tuple[nn.Parameter, Any, bool]]:
        """One group per tied parameter whose owning stages sit on different pp ranks."""
        if self.stage_tp is not None:
            return self._shared_groups_by_stage(device, timeout_s)
        coords = self.mesh.device_mesh.mesh.reshape(self.pp, -1)  # (pp, dp [x cp] x tp) -> global rank
        backend = backend_for(device.type)
        result = []
        for fqn, owner_stages in self._trained_ties():
            pp_ranks = sorted({stage_to_rank(s, self.pp, self.num_stages, placement) for s in owner_stages})
            if len(pp_ranks) < 2:
                continue
            mine = None
            for column in range(coords.shape[1]):
                ranks = [int(coords[p, column]) for p in pp_ranks]
                group = dist.new_group(ranks, backend=backend, pg_options=group_options(backend, timeout_s))
                if dist.get_rank() in ranks:
                    mine = group
            if mine is not None:
                first_owner = stage_to_rank(min(owner_stages), self.pp, self.num_stages, placement) == self.pp_rank
                result.append((self.module.get_parameter(fqn), mine, first_owner))
        return result

    def _shared_groups_by_stage(self, device: torch.device, timeout_s: float) -> list[tuple[nn.Parameter, Any, bool]]:
        """--stage-tp: per tied parameter, one group per replica joining every rank of its owning stages.

        The owners may hold slices of different widths (a vocabulary split 2 ways on stage 0 and 4 ways
        on the last), so `_reduce_tied` sums whole gradients: each stage gathers its slices, its tp
        rank 0 contributes the whole tensor (the others zeros, adding nothing), every rank keeps its slice.
        """
        table, backend = self.mesh.table, backend_for(device.type)
        result, self._tied_names = [], {}
        for fqn, owner_stages in self._trained_ties():
            owners = sorted(set(owner_stages))
            if len(owners) < 2:
                continue
            mine = None
            for d in range(self.mesh.dp_size):
                ranks = [r for s in owners for r in table[s][d]]
                group = dist.new_group(ranks, backend=backend, pg_options=group_options(backend, timeout_s))
                if dist.get_rank() in ranks:
                    mine = group
            if mine is not None:
                param = self.module.get_parameter(fqn)
                result.append((param, mine, min(owners) == self.pp_rank))
                self._tied_names[id(param)] = fqn
        return result

    def forward_backward(self, batches: list[Batch], loss_fn: LossFn) -> torch.Tensor:
        self.module.train()
        for dispatch in (self.experts.forwards.values() if self.experts is not None else ()):
            dispatch.reset_counts()
        batches = self._local_sequences(batches)
        for batch in batches:  # on every pp rank, not only the first stage's: an error, never a hang
            self.pipe.first_stage_inputs(batch)
        sync = lambda last: contextlib.nullcontext() if last else self.sync.no_sync()
        with self.running_stats.step(len(batches)):
            step = self.runtime.run(self.actions, batches, loss_fn=loss_fn, record=True, sync_context=sync)
        self.last_step = step
        if isinstance(self.sync, SHARDED):  # tied weights summed before (zero 1/2) or after (zero 3) dp
            with self.waits.timed("data_parallel"):  # (the tied sum inside it counts as data-parallel here)
                self.sync.finish(before_deferred=self._reduce_tied)
        else:
            with self.waits.timed("data_parallel"):
                self.sync.finish()
            self._reduce_tied()
        return step.loss if self.tp_rank == 0 else torch.zeros_like(step.loss)  # tp ranks share one loss

    def _local_sequences(self, batches: list[Batch]) -> list[Batch]:
        """With --cp: this rank's tokens of every micro-batch (labels and padding mask with them); the loss
        is still divided by the global target count, counted on whole batches before the split."""
        if self.context_parallel is None:
            return batches
        return [self.context_parallel.shard(batch) for batch in batches]

    def _reduce_tied(self) -> None:
        for param, group, _ in self._shared:  # tied weights: sum the stages' gradients (zero 3: equal shards)
            with self.waits.timed("pipeline"):  # the stages owning it wait for each other
                if id(param) in self._tied_names:  # --stage-tp: slices of different widths
                    param.grad.copy_(self._summed_whole_grad(self._tied_names[id(param)], param.grad, group))
                else:
                    dist.all_reduce(local_tensor(param.grad), group=group)

    def _summed_whole_grad(self, fqn: str, grad: torch.Tensor, group) -> torch.Tensor:
        """This rank's slice of the tied gradient summed over its stages (see _shared_groups_by_stage)."""
        tp = self.tensor_parallel
        whole = tp.gather(fqn, grad) if tp is not None else grad
        whole = whole.clone() if whole is grad else whole
        if self.tp_rank != 0:
            whole.zero_()
        dist.all_reduce(whole, group=group)
        return tp.shard(fqn, whole) if tp is not None else whole

    def clip_gradients(self, max_norm: float) -> float:
        """Global norm: tied copies counted once, tensor-parallel slices summed over the tp group
        (replicated parameters have equal gradients on every tp rank and are counted once)."""
        squares = self.local_squares()
        if self.stage_tp is None:
            with self.waits.timed("pipeline"):  # a flushing schedule's last wait: for the stage that ends last
                dist.all_reduce(squares, group=self.mesh.group("pp"))
        else:  # stages of different widths: each stage's total once (its tp rank 0), over the replica's ranks
            squares = squares if self.tp_rank == 0 else torch.zeros_like(squares)
            with self.waits.timed("pipeline"):
                dist.all_reduce(squares, group=self.mesh.group("replica"))
        norm = math.sqrt(float(squares))
        self.scale_to_norm(norm, max_norm)
        return norm

    def local_squares(self, params: list[nn.Parameter] | None = None) -> torch.Tensor:
        """This pipeline rank's share of the squared global gradient norm (float64 scalar): tied copies
        counted on their first owner only, tp slices summed over the tp group. `params`: only these."""
        shared_elsewhere = {id(p) for p, _, first in self._shared if not first}
        sharded = ({id(p) for name, p in self.module.named_parameters() if self.tensor_parallel.is_sharded(name)}
                   if self.tensor_parallel is not None else set())
        chosen = None if params is None else {id(p) for p in params}
        experts = {id(p) for p in self.expert_params} if self.experts is not None else set()
        if isinstance(self.sync, SHARDED):  # [replicated, sharded] over this rank's shard, summed over dp
            squares = self.sync.squared_norms(lambda p: None if id(p) in shared_elsewhere else int(id(p) in sharded), 2)
        else:
            squares = torch.zeros(2, dtype=torch.float64, device=self.device)  # [replicated, sharded]
            for p in self.sync.params:
                if p.grad is not None and id(p) not in shared_elsewhere and id(p) not in experts \
                        and (chosen is None or id(p) in chosen):
                    squares[int(id(p) in sharded)] += p.grad.double().square().sum()
        if self.tensor_parallel is not None:
            dist.all_reduce(squares[1:], group=self.mesh.group("tp"))
        if self.experts is not None:  # each expert once: the ep ranks' parts
            squares[0] += expert_squares([p for p in self.expert_params if chosen is None or id(p) in chosen],
                                         self.ep_group, self.device)
        return squares.sum()

    def scale_to_norm(self, norm: float, max_norm: float, params: list[nn.Parameter] | None = None) -> None:
        """Clip: scale the gradients (or just `params`') by max_norm / norm where norm exceeds max_norm."""
        if not (norm > max_norm and math.isfinite(max_norm)):
            return
        if isinstance(self.sync, SHARDED):
            if params is not None:
                raise RuntimeError("clipping a subset of the parameters is not supported with sharded gradients")
            self.sync.scale_gradients(max_norm / (norm + 1e-6))
            return
        scale = max_norm / (norm + 1e-6)
        for p in (self.sync.params if params is None else params):
            if p.grad is not None:
                p.grad.mul_(scale)

    @torch.no_grad()
    def eval_sums(self, batches: list[Batch], eval_loss: Callable) -> torch.Tensor:
        """Forward-only pass; the last stage's rank returns [loss sum, target count], the others zeros."""
        for stage in self.stages.values():  # LocalStages holds parameters, not the stages: set their mode
            stage.eval()  # dropout off
        batches = self._local_sequences(batches)
        for batch in batches:
            self.pipe.first_stage_inputs(batch)
        step = self.runtime.run(self.eval_actions, batches, loss_fn=eval_loss)
        for stage in self.stages.values():
            stage.train()
        if self.num_stages - 1 in self.stages and self.tp_rank == 0:
            return step.loss.double()
        return torch.zeros(2, dtype=torch.float64, device=batches[0]["labels"].device)

    def zero_grad(self) -> None:
        self.sync.zero_grad()

    @property
    def last_events(self) -> list:
        """(start, end, action) of the last training step, in seconds (on GPU: waits for its last event)."""
        return self.last_step.events if self.last_step is not None else []

    def step_stats(self, elapsed: float, peak_bytes: int) -> dict:
        """Measured bubble fraction and peak memory of every pipeline rank (averaged / max over replicas).

        One host read for both: each replica's (bubble, peak) in its own slot of one summed tensor.
        """
        slots = self.stats_slots(elapsed, peak_bytes).to(self.device)  # (a stage may hold no parameter)
        dist.all_reduce(slots)
        stats = self.stats_from_slots(slots.cpu())  # the host read (on steps that write metrics only)
        if self.experts is not None:
            stats.update(expert_load(self.experts, self.mesh.size("tp"), self.device))
        return stats

    def _degrees(self) -> tuple[int, ...]:
        return self.stage_tp or (dist.get_world_size() // (self.pp * self.mesh.size("dp")),) * self.pp

    STAT_ROWS = 6  # bubble, peak, busy, step, blocked, data-parallel wait

    def stats_slots(self, elapsed: float, peak_bytes: int) -> torch.Tensor:
        """This rank's [bubble, peak, busy s, step s, blocked s, data-parallel wait s] in its (pp rank, replica)
        slot of a zero tensor [STAT_ROWS, pp, replicas]; summed over all ranks it holds every rank's
        (`stats_from_slots` reads it). Blocked: the step's waits for pipeline peers (receives, sends completing,
        tied-weight sums, the closing norm/loss collectives, a deferred update's wait); the data-parallel
        gradient sync's waits apart. Call it where the step's time `elapsed` ends."""
        busy = sum(end - start for start, end, action in self.last_events if action.op.is_compute)
        degrees = self._degrees()
        replicas = self.mesh.size("dp") * max(degrees)  # slots per stage; stage s fills dp * degrees[s] of them
        slots = torch.zeros(self.STAT_ROWS, self.pp, replicas, dtype=torch.float64)
        within = self.tp_rank if self.context_parallel is None else \
            self.context_parallel.rank * self.mesh.size("tp") + self.tp_rank  # (cp, tp) within a replica
        replica = self.mesh.local_rank("dp") * max(degrees) + within  # (dp, cp, tp) slot
        slots[:, self.pp_rank, replica] = torch.tensor(
            [max(0.0, 1.0 - busy / elapsed) if elapsed > 0 else 0.0, peak_bytes, busy, elapsed,
             self.waits.seconds("pipeline"), self.waits.seconds("data_parallel")], dtype=torch.float64)
        return slots

    def stats_from_slots(self, slots: torch.Tensor) -> dict:
        bubble, peak, busy, elapsed, blocked, dp_wait = slots.reshape(self.STAT_ROWS, self.pp, -1).unbind(0)
        filled = [self.mesh.size("dp") * d for d in self._degrees()]
        mean = lambda values: [float(values[s].sum()) / filled[s] for s in range(self.pp)]  # noqa: E731
        per_rank = mean(bubble)
        return {"bubble_fraction": sum(per_rank) / self.pp, "bubble_per_stage": per_rank,
                "peak_mem_bytes_per_stage": [int(v) for v in peak.amax(1).tolist()],
                "busy_s_per_stage": mean(busy), "step_s_per_stage": mean(elapsed),
                "blocked_s_per_stage": mean(blocked), "dp_wait_s_per_stage": mean(dp_wait)}

    def gather_events(self) -> list | None:
        """Every rank's measured events of the last step, on rank 0 (None elsewhere)."""
        mine = [(dist.get_rank(), start, end, str(action)) for start, end, action in self.last_events]
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        return [e for part in gathered for e in part] if gathered is not None else None

    def finish_run(self, run_dir: Path, config, strategy) -> None:
        """With --trace: the last step's measured timeline, in the simulator's Chrome trace format."""
        if not config.trace:
            return
        events = self.gather_events()
        if events is not None:
            origin = min(start for _, start, _, _ in events)
            timeline = timeline_from_events([(rank, start - origin, end - origin, Action.parse(text))
                                             for rank, start, end, text in events])
            timeline.to_chrome_trace(run_dir / "timeline.json")
            try:
                timeline.to_png(run_dir / "timeline.png", title=f"measured step {config.steps}, "
                                f"schedule {strategy.pipeline.schedule}, pp={strategy.pp}")
            except ImportError:
                print("timeline.png skipped: install matplotlib (pip install 'autopar[plot]')", flush=True)

    def close(self) -> None:
        self.sync.remove()

