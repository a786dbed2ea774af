"""Context parallelism (--cp): the sequence of every batch split over cp ranks, attention over the ring.

layout.py says which tokens each rank holds (load-balanced chunks), ring.py and all_to_all.py are the
two attentions, rewrite.py finds attention and positions in the traced graph and rewrites them. The
pipeline engine (pipeline/build.py) traces the model on the local shard, asks `ContextParallel` to
rewrite it, and feeds every micro-batch through `shard`; weight gradients are summed over dp x cp
(mesh.py), since each cp rank's loss is its tokens' share of the global token sum (train/loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config.strategy import CP_MODES
from ..trace import ModelGraph
from .layout import check_divisible, chunk_indices, shard_batch, shard_positions
from .rewrite import MaskKind, check_rewritable, mask_kinds, rewrite_graph

PROBE_TOKENS = 8  # the probe's sequence: long enough for a padded tail and a causal pattern


@dataclass
class ContextParallel:
    """One rank's part of a cp group: its shard of every batch and the graph rewrite."""

    cp: int
    rank: int
    mode: str
    group: dist.ProcessGroup
    tp: int = 1  # heads are split by tp first: each tp rank's exchange runs in its own cp group
    sp: bool = False  # --sp: each rank's share of the sequence is cut again over tp
    kinds: list[MaskKind] | None = None  # per attention node, from the probe

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_batch(batch, self.rank, self.cp)

    def probe(self, trace_fn, example_batch: dict[str, torch.Tensor], device: torch.device,
              declared_window: int | None = None) -> None:
        """Trace the model on a short probe and read what each attention's mask means (rewrite.py).
        `trace_fn(batch)` traces the model on a batch and returns its ModelGraph. `declared_window`: a
        sliding window the model declares (declared_window()); the probe is made long enough to show it."""
        length = _length(example_batch)
        check_divisible(length, self.cp, self.tp if self.sp else 1)
        tokens = PROBE_TOKENS + (declared_window or 0)  # a window shows once a query sees past it
        probe_batch = _probe_batch(example_batch, device, tokens)
        graph: ModelGraph = trace_fn(probe_batch)
        check_rewritable(graph, self.cp, self.mode, self.tp)
        main = "input_ids" if "input_ids" in probe_batch else "inputs"
        self.kinds = mask_kinds(graph, {**probe_batch, "__main__": probe_batch[main]})

    def rewrite(self, graph: ModelGraph) -> int:
        check_rewritable(graph, self.cp, self.mode, self.tp)
        return rewrite_graph(graph, self.kinds, mode=self.mode, group=self.group, rank=self.rank, cp=self.cp)

    def summary(self) -> str:
        kinds = ", ".join(sorted({k.describe() for k in self.kinds or []}))
        return (f"context parallel: cp={self.cp} {self.mode}, this rank holds chunks "
                f"{chunk_indices(self.rank, self.cp)} of {2 * self.cp}; attention masks: {kinds}")


def _length(batch: dict[str, torch.Tensor]) -> int:
    return batch["input_ids" if "input_ids" in batch else "inputs"].shape[1]


def declared_window(model: torch.nn.Module) -> int | None:
    """The sliding window a model's config declares (`config.sliding_window`, the Hugging Face convention),
    if any: whether its attention uses it is still read from the mask on the probe."""
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def _probe_batch(example: dict[str, torch.Tensor], device: torch.device, tokens: int) -> dict[str, torch.Tensor]:
    """A short, concrete batch: two rows of the example's first tokens, the second padded at its end."""
    length = _length(example)
    size = min(tokens, length)
    rows = {k: v[:2] if v.dim() >= 1 else v for k, v in example.items()}
    if rows[next(iter(rows))].shape[0] < 2:
        rows = {k: torch.cat([v, v]) if v.dim() >= 1 else v for k, v in rows.items()}
    batch = {k: (v[:, :size] if v.dim() >= 2 and v.shape[1] == length else v).to(device) for k, v in rows.items()}
    if "attention_mask" in batch:
        mask = torch.ones_like(batch["attention_mask"])
        mask[1, size - 3:] = 0
        batch["attention_mask"] = mask
    return batch


__all__ = ["CP_MODES", "ContextParallel", "MaskKind", "chunk_indices", "declared_window", "shard_batch",
           "shard_positions"]
