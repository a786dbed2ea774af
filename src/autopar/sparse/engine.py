"""The data-parallel engine with sparse-embedding communication (EmbRace and its baselines).

The Engine of train/base.py, like train/engine.py's data-parallel engine. At set-up it measures which embedding tables
are sparse (sparse/classify.py, logged on rank 0), then per `Strategy.sparse.mode`:
- `dense`: today's path (every gradient in the bucketed all-reduce); only chosen so that
  `sparse-adam` can apply SparseAdam to the sparse tables (their reduced gradient's
  nonzero rows);
- `allgather`: sparse tables stay replicated; their sparse gradients (unique ids + rows) are
  all-gathered and every replica applies the same sparse update (Horovod's way);
- `embrace`: sparse tables are sharded over the ranks (sparse/sharded_embedding.py),
  looked up with AlltoAll, updated locally; optionally with 2D scheduling (schedule.py).
Dense parameters always use the bucketed GradientSynchronizer, which never sees a sparse
table. Data parallelism only (the rule table, config/rules.py, refuses pp/tp > 1); gloo/CPU only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .._torch_internals import foreach_norm
from ..config import SparseOptions, TrainConfig
from ..data_parallel import GradientSynchronizer
from ..distributed import group_options
from ..mesh import ProcessMesh
from ..models.materialize import materialize
from ..train.engine import (
    accumulate_gradients,
    broadcast_from_first_replica,
    whole_model_eval_sums,
)
from ..train.base import EngineBase
from ..train.loss import Batch, main_input
from .classify import TableInfo, check_sparse_tables, classify_tables, describe
from .exchange import CommLedger, all_gather_varlen
from .optim import HybridOptimizer, dense_optimizer, table_optimizer
from .schedule import RowPriorityQueue
from .sharded_embedding import ShardedEmbedding, TableExchange


class SparseEmbeddingEngine(EngineBase):
    """Data parallelism with embedding tables exchanged sparsely (dense | allgather | embrace; module doc)."""

    def __init__(self, model: nn.Module, mesh: ProcessMesh, *, device: torch.device, seed: int, forward_fn: Callable,
                 autocast: Callable, config: TrainConfig, batches_for_step: Callable[[int], list[Batch]],
                 options: SparseOptions, log: Callable[[str], None] | None = None):
        self.mode, self.config = options.mode, config
        self.forward_fn, self.autocast = forward_fn, autocast
        self.mesh, self.group = mesh, mesh.group("dp")
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.batches_for_step = batches_for_step
        self.scheduled = options.schedule and self.mode == "embrace"
        self.module = materialize(model, device, seed=seed)
        broadcast_from_first_replica(self.module, mesh)
        self.ledger = CommLedger()
        self.step = 0
        first = batches_for_step(0)
        reads: dict[str, list[torch.Tensor]] = {}
        self.tables: list[TableInfo] = classify_tables(
            self.module, lambda: [forward_fn(self.module, b) for b in first],
            threshold=options.threshold, group=self.group, reads=reads)
        # 2D scheduling needs each table's next reads; known for tables read once per micro-batch with its
        # token ids (a word table), not for e.g. a position table: those exchange unscheduled
        token_ids = [_token_ids(b) for b in first]
        keyed = {name for name, seen in reads.items()
                 if len(seen) == len(token_ids) and all(torch.equal(a, b) for a, b in zip(seen, token_ids))}
        if self.mode != "dense":
            check_sparse_tables(self.tables, mode=self.mode, world=self.world, sharding=options.sharding)
        self.description = describe(self.tables, self.mode if self.mode != "embrace"
                                    else f"embrace, {options.sharding}-wise"
                                         f"{', 2D scheduled' if self.scheduled else ''}")
        if any(t.sparse for t in self.tables) and config.weight_decay > 0:
            self.description += (f"\n  sparse tables get weight_decay 0 (decay moves every row every step: not "
                                 f"row-separable); dense parameters keep {config.weight_decay:g}")
        sparse = [t for t in self.tables if t.sparse]
        self.exchanges: list[TableExchange] = []
        self.replicated_tables: list[nn.Parameter] = []  # allgather / dense: full tables with sparse updates
        if self.mode == "embrace" and sparse:
            ranks = dist.get_process_group_ranks(self.group)
            # a group of its own, so lookups/gradients can overlap the dense all-reduce
            exchange_group = dist.new_group(ranks, backend="gloo", pg_options=group_options("gloo", config.timeout_s))
            for t in sparse:
                parent_path, _, attr = t.module_path.rpartition(".")
                parent = self.module.get_submodule(parent_path) if parent_path else self.module
                table = ShardedEmbedding(getattr(parent, attr).weight, name=t.param_name, mode=options.sharding,
                                         group=exchange_group, ledger=self.ledger)
                table.exchange.scheduled = self.scheduled and t.param_name in keyed
                if self.scheduled and not table.exchange.scheduled:
                    self.description += (f"\n  {t.param_name} is not read with the batch's token ids, so its next "
                                         f"reads are unknown: exchanged unscheduled")
                setattr(parent, attr, table)
                self.exchanges.append(table.exchange)
        elif sparse:
            for t in sparse:
                module = self.module.get_submodule(t.module_path)
                if self.mode == "allgather":
                    module.sparse = True  # autograd then gives a COO gradient of the rows read
                self.replicated_tables.append(module.weight)
        table_ids = {id(ex.weight) for ex in self.exchanges}
        if self.mode == "allgather":
            table_ids |= {id(p) for p in self.replicated_tables}
        if self.rank == 0 and log is not None:
            log(self.description)
        self.dense_params = [p for p in self.module.parameters() if p.requires_grad and id(p) not in table_ids]
        self.sync = GradientSynchronizer(self.dense_params, self.group)
        self.dense_elements = sum(p.numel() for p in self.dense_params)
        self.table_optimizers: dict[int, torch.optim.Optimizer] = {}

    # ------------------------------------------------------------------ optimizer

    def build_optimizer(self, config: TrainConfig) -> torch.optim.Optimizer:
        """Dense params: the configured optimizer; sparse tables: their row-separable rule (weight decay 0)."""
        tables = [ex.weight for ex in self.exchanges] + self.replicated_tables
        table_ids = {id(p) for p in tables}
        dense = [p for p in self.module.parameters() if p.requires_grad and id(p) not in table_ids]
        parts = [opt for opt in [dense_optimizer(dense, config)] if opt is not None]
        for p in tables:
            self.table_optimizers[id(p)] = table_optimizer(p, config)
            parts.append(self.table_optimizers[id(p)])
        return HybridOptimizer(parts)

    # ------------------------------------------------------------------ step

    def forward_backward(self, batches: list[Batch], loss_fn: Callable) -> torch.Tensor:
        self.ledger.reset()
        total = accumulate_gradients(self.module, self.forward_fn, self.autocast, batches, loss_fn, self.sync.no_sync)
        if self.scheduled:
            self._scheduled_update()
        for ex in self.exchanges:
            if not ex.scheduled:
                ex.finish_unscheduled()
        if self.mode == "allgather":
            self._allgather_table_grads()
        self.sync.finish()
        if self.world > 1:  # ring all-reduce model: 2 (N-1)/N of the buffer received per worker
            self.ledger.add("allreduce", round(2 * (self.world - 1) / self.world * self.dense_elements), 4)
        if self.mode == "dense":
            for p in self.replicated_tables:  # sparse-adam: the reduced gradient's nonzero rows
                p.grad = _nonzero_rows(p.grad)
        self.step += 1
        return total

    def _allgather_table_grads(self) -> None:
        """Every rank's (unique ids, summed rows) of each table, concatenated and summed: the global sparse grad."""
        for p in self.replicated_tables:
            grad = p.grad.coalesce() if p.grad is not None else torch.sparse_coo_tensor(
                torch.empty(1, 0, dtype=torch.long), torch.empty(0, p.shape[1]), size=p.shape,
                check_invariants=False).coalesce()
            ids = all_gather_varlen(grad.indices()[0].to(torch.int32), self.group, ledger=self.ledger, category="ids")
            ids = [i.long() for i in ids]
            rows = all_gather_varlen(grad.values(), self.group, ledger=self.ledger, category="rows")
            p.grad = torch.sparse_coo_tensor(torch.cat(ids).view(1, -1), torch.cat(rows), size=p.shape,
                                             check_invariants=False).coalesce()

    def _table_lr(self, ex: TableExchange) -> float:
        return self.table_optimizers[id(ex.weight)].param_groups[0]["lr"]

    def _apply(self, ex: TableExchange, parts: list, *, lr: float, step: int, replay: bool) -> None:
        """Apply one chunk of a step's row gradients with that step's lr; `replay`: a later chunk of the same step."""
        opt = self.table_optimizers[id(ex.weight)]
        group = opt.param_groups[0]
        current, group["lr"] = group["lr"], lr
        state = opt.state.get(ex.weight, {})
        if replay and "step" in state:
            state["step"] -= 1  # the step counter (bias correction) is the one of the step this chunk belongs to
        grad = ex.sparse_grad(parts)
        ex.weight.grad = grad
        opt.step()
        ex.weight.grad = None
        group["lr"] = current
        ex.versions.mark_applied(grad.indices()[0], step)

    def _land_deferred(self, ex: TableExchange) -> None:
        for step, lr, pendings, rows in ex.deferred:
            width = ex.layout.shard_shape[1]
            parts = [(r, torch.cat([c.view(-1, width) for c in p.wait()])) for p, r in zip(pendings, rows)]
            self._apply(ex, parts, lr=lr, step=step, replay=True)
        ex.deferred = []

    def _scheduled_update(self) -> None:
        """2D scheduling (schedule.py): land last step's deferred rows, exchange+apply the rows the next step
        reads, stream the rest, and prefetch the next step's lookups while the dense all-reduce is in flight."""
        step = self.step
        has_next = step + 1 < self.config.steps
        next_flat = [_token_ids(b) for b in self.batches_for_step(step + 1)] if has_next else []
        for ex in (ex for ex in self.exchanges if ex.scheduled):
            self._land_deferred(ex)
            gathered: list[list[torch.Tensor]] = []
            if has_next and ex.layout.mode == "column":
                gathered = [ex.gather_ids(flat) for flat in next_flat]
                next_read = torch.unique(torch.cat([i for g in gathered for i in g]))
            elif has_next:
                mine = torch.unique(torch.cat(next_flat))
                next_read = torch.unique(torch.cat(all_gather_varlen(mine.to(torch.int32), ex.group,
                                                                     ledger=self.ledger, category="ids"))).long()
            else:
                next_read = torch.arange(ex.layout.num_rows)  # last step: nothing to overlap with, all urgent
            if not ex.priority:
                next_read = next_read[:0]  # tests only: a schedule that ignores the priority (must be caught)
            queue = RowPriorityQueue(next_read, num_rows=ex.layout.num_rows, step=step)
            touched = torch.cat([ex.landing(record, None)[1] for record, _ in ex.stashed]) if ex.stashed \
                else torch.empty(0, dtype=torch.long)
            ex.versions.mark_produced(touched, step)
            urgent = queue.pop()
            parts = []
            for record, grad in ex.stashed:
                pending, rows = ex.exchange_grad(record, grad, chunk=urgent)
                parts.append((rows, torch.cat([c.view(-1, ex.layout.shard_shape[1]) for c in pending.wait()])))
            lr = self._table_lr(ex)
            self._apply(ex, parts, lr=lr, step=step, replay=False)
            while len(queue):
                chunk = queue.pop()
                sent = [ex.exchange_grad(record, grad, chunk=chunk, async_op=True) for record, grad in ex.stashed]
                ex.deferred.append((step, lr, [p for p, _ in sent], [r for _, r in sent]))
                ex.rows_deferred += sum(int(r.numel()) for _, r in sent)
            ex.stashed = []
            ex.step = step + 1
            for mb, flat in enumerate(next_flat):  # the next forward's lookups, overlapping the dense all-reduce
                values, record = ex.lookup_values(flat, gathered[mb] if gathered else None)
                ex.prefetched.append((flat, values, record))

    def flush(self) -> None:
        """Land every deferred row update (before evaluation, a checkpoint, or the end)."""
        for ex in self.exchanges:
            self._land_deferred(ex)

    def before_checkpoint(self) -> None:
        self.flush()  # 2D-scheduled tables: land deferred row updates first

    def clip_gradients(self, max_norm: float) -> float | None:
        if any(ex.scheduled for ex in self.exchanges):
            return None  # part of the table gradient is still in flight (grad_clip must be 0): no norm
        # per-tensor norms in the gradient's dtype (as clip_grad_norm_ does), combined in float64
        grads = [_values(p.grad) for p in self.dense_params + self.replicated_tables * (self.mode == "allgather")
                 if p.grad is not None]
        squares = sum(float(n) ** 2 for n in foreach_norm(grads)) if grads else 0.0
        shards = torch.tensor([sum(float(torch.linalg.vector_norm(_values(ex.weight.grad))) ** 2
                                   for ex in self.exchanges)], dtype=torch.float64)
        if self.exchanges and self.world > 1:
            dist.all_reduce(shards, group=self.group)
        norm = math.sqrt(squares + float(shards))
        if math.isfinite(max_norm) and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            everything = self.dense_params + self.replicated_tables + [ex.weight for ex in self.exchanges]
            unique = {id(p): p for p in everything}
            for p in unique.values():
                if p.grad is not None:
                    if p.grad.is_sparse:
                        p.grad = p.grad * scale
                    else:
                        p.grad.mul_(scale)
        return norm

    @torch.no_grad()
    def eval_sums(self, batches: list[Batch], eval_loss: Callable) -> torch.Tensor:
        self.flush()
        return whole_model_eval_sums(self.module, self.forward_fn, self.autocast, batches, eval_loss)

    def zero_grad(self) -> None:
        self.sync.zero_grad()
        for p in [ex.weight for ex in self.exchanges] + self.replicated_tables * (self.mode == "allgather"):
            p.grad = None

    def step_stats(self, elapsed: float, peak_bytes: int) -> dict:
        """Bytes this rank received in the last step, per kind (the all-reduce by the ring model)."""
        return {"comm_bytes": self.ledger.total_bytes(), **{f"comm_{k}": v for k, v in self.ledger.snapshot().items()}}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters under the user's names, sharded tables gathered whole (a collective)."""
        self.flush()
        state = {}
        sharded = {id(ex.weight): ex for ex in self.exchanges}
        for name, p in self.module.named_parameters():
            if id(p) in sharded:
                state[sharded[id(p)].name] = sharded[id(p)].gather_full()
            else:
                state[name] = p.detach().clone()
        return state

    def close(self) -> None:
        self.flush()
        self.sync.remove()


def _token_ids(batch: Batch) -> torch.Tensor:
    return main_input(batch).reshape(-1).to(torch.long)


def _values(grad: torch.Tensor | None) -> torch.Tensor:
    if grad is None:
        return torch.zeros(0)
    return grad.coalesce().values() if grad.is_sparse else grad


def _nonzero_rows(grad: torch.Tensor) -> torch.Tensor:
    rows = grad.abs().sum(dim=1).nonzero().view(-1)
    return torch.sparse_coo_tensor(rows.view(1, -1), grad[rows], size=grad.shape, check_invariants=False).coalesce()
