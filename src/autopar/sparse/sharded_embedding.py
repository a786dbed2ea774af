"""An embedding table sharded over the data-parallel ranks, looked up with AlltoAll.

Column-wise (default): rank k holds columns [c_k, c_{k+1}) of every row (the remainder of
d / N goes to the last ranks). Forward: all ranks' ids are all-gathered (cheap integers);
rank k looks up its columns for everybody's ids and sends block j to rank j; each rank
concatenates the blocks it receives into its b x d lookup. Backward mirrors it: the
gradient of the lookup is cut by column ranges and sent to the owners, who then hold, for
every token of every rank, the gradient of their columns, and scatter it into a sparse row
gradient of their shard. Every rank does the same lookup work whatever the token skew.

Row-wise (`sparse_sharding=row`): rank k owns a contiguous range of rows. Each rank
de-duplicates its ids, asks each owner for its rows, and receives full rows back;
backward sends each unique row's summed gradient to its owner. Less traffic when ids
repeat, but skewed (Zipfian) ids load some owners more.

Each shard is a Parameter named `shard<rank>of<N>` (unique per rank, so a checkpoint keeps
every rank's shard) and is updated only by its own rank's optimizer, from a sparse COO
gradient (rows touched), so its optimizer state is sharded too. The exchange of gradients
happens either inside autograd's backward (unscheduled) or after backward in the order of
the 2D schedule (sparse/schedule.py): `TableExchange` holds that state, the module is
only the nn.Module face the model calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .exchange import CommLedger, PendingExchange, all_gather_varlen, exchange, exchange_counts
from .schedule import Chunk, RowVersions


def even_splits(total: int, parts: int) -> list[int]:
    """`total` split in `parts`; the remainder goes to the last parts."""
    base, extra = divmod(total, parts)
    return [base + (1 if k >= parts - extra else 0) for k in range(parts)]


def _starts(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


@dataclass(frozen=True)
class ShardLayout:
    """Where each part of a num_rows x dim table lives on `world` ranks."""

    num_rows: int
    dim: int
    world: int
    rank: int
    mode: str  # column | row

    @property
    def col_sizes(self) -> list[int]:
        return even_splits(self.dim, self.world) if self.mode == "column" else [self.dim] * self.world

    @property
    def row_sizes(self) -> list[int]:
        return even_splits(self.num_rows, self.world) if self.mode == "row" else [self.num_rows] * self.world

    @property
    def col_range(self) -> tuple[int, int]:
        if self.mode != "column":
            return 0, self.dim
        starts = _starts(self.col_sizes)
        return starts[self.rank], starts[self.rank + 1]

    @property
    def row_range(self) -> tuple[int, int]:
        if self.mode != "row":
            return 0, self.num_rows
        starts = _starts(self.row_sizes)
        return starts[self.rank], starts[self.rank + 1]

    @property
    def shard_shape(self) -> tuple[int, int]:
        (r0, r1), (c0, c1) = self.row_range, self.col_range
        return r1 - r0, c1 - c0

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        (r0, r1), (c0, c1) = self.row_range, self.col_range
        return full[r0:r1, c0:c1]

    def owners(self, ids: torch.Tensor) -> torch.Tensor:
        """Row mode: the rank owning each (global) row id."""
        boundaries = torch.tensor(_starts(self.row_sizes)[1:-1], dtype=ids.dtype)
        return torch.bucketize(ids, boundaries, right=True)

    def assemble(self, shards: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(shards, dim=1 if self.mode == "column" else 0)


@dataclass
class LookupRecord:
    """What one lookup exchanged, so its backward can send gradients the same way back.

    column: ids[j] = rank j's flat ids (every rank knows all of them);
    row: uniq = my unique ids (sorted, so grouped by owner), inverse = position -> uniq index,
    sent[k] = how many of uniq rank k owns, requested[j] = ids rank j asked me for.
    """

    step: int
    ids: list[torch.Tensor] = field(default_factory=list)
    uniq: torch.Tensor | None = None
    inverse: torch.Tensor | None = None
    sent: list[int] = field(default_factory=list)
    requested: list[torch.Tensor] = field(default_factory=list)
    shape: tuple[int, ...] = ()


class TableExchange:
    """One sharded table's communication state: lookups, gradient exchange, pending updates."""

    def __init__(self, name: str, weight: nn.Parameter, layout: ShardLayout, group: dist.ProcessGroup,
                 ledger: CommLedger):
        self.name, self.weight, self.layout, self.group, self.ledger = name, weight, layout, group, ledger
        self.versions = RowVersions(layout.shard_shape[0])
        self.step = 0
        self.scheduled = False
        self.priority = True  # False only to show that the version check catches a bad schedule (tests)
        self.grad_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.stashed: list[tuple[LookupRecord, torch.Tensor]] = []
        self.prefetched: list[tuple[torch.Tensor, torch.Tensor, LookupRecord]] = []
        self.deferred: list[tuple[int, float, list[PendingExchange], list[torch.Tensor]]] = []
        self.rows_deferred = 0  # row-gradient pieces this rank received in deferred chunks (scheduling at work)

    @property
    def me(self) -> int:
        return self.layout.rank

    # ------------------------------------------------------------------ forward

    def gather_ids(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ids, sent as int32 (half the bytes of int64; tables have < 2^31 rows)."""
        gathered = all_gather_varlen(flat.to(torch.int32), self.group, ledger=self.ledger, category="ids")
        return [ids.long() for ids in gathered]

    @torch.no_grad()
    def lookup_values(self, flat: torch.Tensor, gathered: list[torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, LookupRecord]:
        """(b x d lookup of my flat ids, the record of the exchange); a collective."""
        layout, shard = self.layout, self.weight.detach()
        record = LookupRecord(step=self.step)
        if layout.mode == "column":
            record.ids = gathered if gathered is not None else self.gather_ids(flat)
            self.versions.check_read(torch.cat(record.ids), table=self.name, step=self.step)
            chunks = [shard[ids] for ids in record.ids]
            sizes = [flat.numel() * w for w in layout.col_sizes]
            received = exchange(chunks, sizes, self.group, ledger=self.ledger, category="lookup")
            blocks = [r.view(flat.numel(), w) for r, w in zip(received, layout.col_sizes)]
            return torch.cat(blocks, dim=1), record
        uniq, inverse = torch.unique(flat, return_inverse=True)
        record.uniq, record.inverse = uniq, inverse
        record.sent = torch.bincount(layout.owners(uniq), minlength=layout.world).tolist()
        expected = exchange_counts(record.sent, self.group)
        self.ledger.add("ids", layout.world - 1, 8)  # the counts themselves
        requested = exchange(list(torch.split(uniq.to(torch.int32), record.sent)), expected, self.group,
                             ledger=self.ledger, category="ids", dtype=torch.int32)
        record.requested = [ids.long() for ids in requested]
        start = layout.row_range[0]
        local = torch.cat(record.requested) - start
        if self.scheduled:  # only owners see their rows' versions: agree on the verdict, so no rank hangs
            stale = torch.tensor([int(self.versions.is_stale(local))])
            dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=self.group)
            self.ledger.add("check", layout.world - 1, 8)
            if int(stale):
                self.versions.check_read(local, table=self.name, step=self.step, peer_found=True)
        else:
            self.versions.check_read(local, table=self.name, step=self.step)
        chunks = [shard[ids - start] for ids in record.requested]
        received = exchange(chunks, [n * layout.dim for n in record.sent], self.group, ledger=self.ledger,
                            category="lookup")
        rows = torch.cat(received).view(uniq.numel(), layout.dim)
        return rows[inverse], record

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding of `ids` (any shape), differentiable; uses the prefetched lookup if there is one."""
        flat = ids.reshape(-1).to(torch.long)
        if self.prefetched and torch.is_grad_enabled():  # a training forward (evaluation looks up afresh)
            cached_ids, values, record = self.prefetched.pop(0)
            if not torch.equal(cached_ids, flat):
                raise RuntimeError(f"{self.name}: the prefetched lookup was for other ids than this forward's; "
                                   f"the engine was given the wrong next batch")
        else:
            values, record = self.lookup_values(flat)
        record.shape = tuple(ids.shape)
        out = _ShardedLookup.apply(self.weight, self, record, values)
        return out.view(*ids.shape, self.layout.dim)

    # ------------------------------------------------------------------ backward

    def on_backward(self, record: LookupRecord, grad: torch.Tensor) -> None:
        grad = grad.reshape(-1, self.layout.dim).detach()
        if self.scheduled:
            self.stashed.append((record, grad.clone()))
            return
        pending, rows = self.exchange_grad(record, grad, chunk=None)
        self.grad_parts.append((rows, torch.cat([p.view(-1, self.layout.shard_shape[1]) for p in pending.wait()])))

    def landing(self, record: LookupRecord, chunk: Chunk | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per source rank, the mask of its rows that this chunk carries, and their local row numbers."""
        sources = record.ids if self.layout.mode == "column" else record.requested
        masks = [torch.ones_like(ids, dtype=torch.bool) if chunk is None else chunk.select(ids) for ids in sources]
        rows = torch.cat([ids[m] for ids, m in zip(sources, masks)]) - self.layout.row_range[0]
        return masks, rows

    def exchange_grad(self, record: LookupRecord, grad: torch.Tensor, *, chunk: Chunk | None,
                      async_op: bool = False) -> tuple[PendingExchange, torch.Tensor]:
        """Send my lookup gradient (the rows `chunk` selects) to the owners; returns (pending, local rows)."""
        layout = self.layout
        masks, rows = self.landing(record, chunk)
        width = layout.shard_shape[1]
        if layout.mode == "column":
            mine = record.ids[self.me]
            send = grad if chunk is None else grad[chunk.select(mine)]
            starts = _starts(layout.col_sizes)
            chunks = [send[:, starts[k]:starts[k + 1]] for k in range(layout.world)]
        else:
            summed = torch.zeros(record.uniq.numel(), layout.dim, dtype=grad.dtype).index_add_(0, record.inverse, grad)
            keep = torch.ones_like(record.uniq, dtype=torch.bool) if chunk is None else chunk.select(record.uniq)
            chunks = [g[m] for g, m in zip(torch.split(summed, record.sent), torch.split(keep, record.sent))]
        sizes = [int(m.sum()) * width for m in masks]
        pending = exchange(chunks, sizes, self.group, ledger=self.ledger, category="grad", async_op=True,
                           dtype=grad.dtype)
        if not async_op:
            pending.wait()
        return pending, rows

    # ------------------------------------------------------------------ gradient / update

    def sparse_grad(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """A coalesced COO gradient of the shard from (local rows, row gradients) parts (may be empty)."""
        width = self.layout.shard_shape[1]
        rows = torch.cat([r for r, _ in parts]) if parts else torch.empty(0, dtype=torch.long)
        values = torch.cat([v for _, v in parts]).view(-1, width) if parts else torch.empty(0, width)
        # duplicates summed in order of appearance (CPU index_add_ is sequential): the same sums whichever
        # chunk a row travelled in, so scheduled and unscheduled runs stay bit-identical
        unique, inverse = torch.unique(rows, return_inverse=True)
        summed = torch.zeros(unique.numel(), width, dtype=values.dtype).index_add_(0, inverse, values)
        return torch.sparse_coo_tensor(unique.view(1, -1), summed, size=self.layout.shard_shape, is_coalesced=True,
                                       check_invariants=False)

    def finish_unscheduled(self) -> None:
        """End of backward: the step's full sparse gradient becomes the shard's .grad."""
        grad = self.sparse_grad(self.grad_parts)
        rows = grad.indices()[0]
        self.versions.mark_produced(rows, self.step)
        self.versions.mark_applied(rows, self.step)  # the optimizer step lands it before any later read
        self.weight.grad = grad
        self.grad_parts = []
        self.step += 1

    def gather_full(self) -> torch.Tensor:
        """The whole table (a collective), e.g. to compare with a single-process run."""
        flat = self.weight.detach().reshape(-1)
        parts = all_gather_varlen(flat, self.group)
        shapes = [ShardLayout(self.layout.num_rows, self.layout.dim, self.layout.world, k, self.layout.mode).shard_shape
                  for k in range(self.layout.world)]
        return self.layout.assemble([p.view(*s) for p, s in zip(parts, shapes)])


class _ShardedLookup(torch.autograd.Function):
    """Connects a lookup computed by the exchange to autograd; backward hands the gradient to it."""

    @staticmethod
    def forward(ctx, weight, table, record, values):
        ctx.table, ctx.record = table, record
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.table.on_backward(ctx.record, grad)
        return None, None, None, None


class ShardedEmbedding(nn.Module):
    """Drop-in for an nn.Embedding whose rows (or columns) live on all data-parallel ranks."""

    def __init__(self, full_weight: torch.Tensor, *, name: str, mode: str, group: dist.ProcessGroup,
                 ledger: CommLedger):
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        layout = ShardLayout(full_weight.shape[0], full_weight.shape[1], world, rank, mode)
        self.num_embeddings, self.embedding_dim = full_weight.shape
        self.param_name = f"shard{rank}of{world}"
        weight = nn.Parameter(layout.shard_of(full_weight.detach()).clone())
        self.register_parameter(self.param_name, weight)
        self.exchange = TableExchange(name, weight, layout, group, ledger)

    @property
    def shard(self) -> nn.Parameter:
        return getattr(self, self.param_name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.exchange.lookup(ids)

    def extra_repr(self) -> str:
        layout = self.exchange.layout
        return (f"{self.num_embeddings}, {self.embedding_dim}, {layout.mode}-wise over {layout.world} ranks, "
                f"this shard {tuple(layout.shard_shape)}")
