"""Which parameters are sparse: measured row density of every embedding table.

A table is worth sharding only if one step touches few of its rows. We measure, not
guess: one forward pass over this rank's first-step batch with hooks on every
`nn.Embedding` records the ids it reads; the rows touched on all ranks are combined
(all-reduce MAX of a row mask), and density = rows touched / rows. Below
`Strategy.sparse_threshold` the table is sparse. Everything else is dense: ordinary
weights, tables above the threshold (a position table reads all its rows), and any table
whose weight is also used elsewhere, e.g. tied to the output softmax, because that use
gives it a dense gradient (EmbRace's pitfall); tables with max_norm (renormalises on
read) or padding_idx (a row whose gradient is masked) are kept dense too, to stay exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True)
class TableInfo:
    """One nn.Embedding of the model and how it is classified."""

    module_path: str
    param_name: str  # the weight's name under the model
    num_rows: int
    dim: int
    rows_touched: int
    sparse: bool
    reason: str

    @property
    def density(self) -> float:
        return self.rows_touched / max(1, self.num_rows)


def _other_uses(model: nn.Module, module: nn.Embedding, path: str) -> list[str]:
    """Other names under which the table's weight is reachable (a tie)."""
    own = f"{path}.weight" if path else "weight"
    return [name for name, p in model.named_parameters(remove_duplicate=False)
            if p is module.weight and name != own]


@torch.no_grad()
def classify_tables(model: nn.Module, run_forward: Callable[[], None], *, threshold: float,
                    group: dist.ProcessGroup | None, reads: dict[str, list[torch.Tensor]] | None = None
                    ) -> list[TableInfo]:
    """Measure every nn.Embedding's row density on one step (all ranks' batches); a collective.

    `reads`, if given, receives each table's ids per lookup (the scheduler uses it to see which
    tables are read with the batch's token ids, so that it can know their next reads).
    """
    tables = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.Embedding)]
    touched = {path: torch.zeros(m.num_embeddings, dtype=torch.uint8) for path, m in tables}

    def recorder(path: str):
        def hook(module, args):
            ids = args[0].detach().reshape(-1).to("cpu", torch.long)
            touched[path][ids] = 1
            if reads is not None:
                reads.setdefault(f"{path}.weight" if path else "weight", []).append(ids)
        return hook

    handles = [m.register_forward_pre_hook(recorder(path)) for path, m in tables]
    was_training = model.training
    try:
        model.eval()
        run_forward()
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    if group is not None and dist.get_world_size(group) > 1 and tables:
        flat = torch.cat([touched[path] for path, _ in tables]).to(torch.int32)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        offset = 0
        for path, m in tables:
            touched[path] = flat[offset:offset + m.num_embeddings]
            offset += m.num_embeddings
    result = []
    for path, m in tables:
        rows = int(touched[path].sum())
        density = rows / max(1, m.num_embeddings)
        ties = _other_uses(model, m, path)
        if not m.weight.requires_grad:
            sparse, reason = False, "frozen (requires_grad False): no gradient, nothing to exchange; kept as it is"
        elif ties:
            sparse, reason = False, f"tied to {ties[0]}: its gradient is dense, so it stays in the all-reduce"
        elif m.max_norm is not None:
            sparse, reason = False, "max_norm renormalises rows on read; kept dense"
        elif m.padding_idx is not None:
            sparse, reason = False, "padding_idx masks a row's gradient; kept dense"
        elif density < threshold:
            sparse, reason = True, f"density {density:.4f} < threshold {threshold:g}"
        else:
            sparse, reason = False, f"density {density:.4f} >= threshold {threshold:g}"
        result.append(TableInfo(module_path=path, param_name=f"{path}.weight" if path else "weight",
                                num_rows=m.num_embeddings, dim=m.embedding_dim, rows_touched=rows,
                                sparse=sparse, reason=reason))
    return result


def describe(tables: list[TableInfo], mode: str) -> str:
    """The run-log lines that show the classification."""
    lines = [f"sparse embeddings ({mode}): {sum(t.sparse for t in tables)} of {len(tables)} table(s) sparse"]
    for t in tables:
        lines.append(f"  {t.param_name}: {t.num_rows} x {t.dim}, {t.rows_touched} rows touched in step 1 "
                     f"-> {'SPARSE' if t.sparse else 'dense'} ({t.reason})")
    return "\n".join(lines)


def check_sparse_tables(tables: list[TableInfo], *, mode: str, world: int, sharding: str) -> None:
    """Bad input, found before any table is sharded: same error on every rank."""
    if not tables:
        raise ConfigError(f"--sparse-embeddings {mode} needs a model with an nn.Embedding table, and this model has "
                          f"none; use --sparse-embeddings dense (or a model with an embedding, e.g. word-lstm)")
    if mode != "embrace":
        return
    for t in tables:
        if not t.sparse:
            continue
        if t.num_rows < world:
            raise ConfigError(f"{t.param_name} has {t.num_rows} rows, fewer than the {world} data-parallel ranks it "
                              f"would be sharded over; use a vocabulary of at least {world} rows or fewer ranks")
        if sharding == "column" and t.dim < world:
            raise ConfigError(f"{t.param_name} is {t.dim} wide, narrower than the {world} ranks its columns would be "
                              f"split over; use --sparse-sharding row or a dimension >= {world}")
