"""Per-expert checkpoint tensors read as the batched expert parameters a model holds.

Recent transformers MoE blocks (mixtral, qwen2_moe, qwen3_moe, olmoe and their kin) hold every
expert of a layer in two batched parameters, `experts.gate_up_proj` [E, 2I, H] (each expert's gate
rows then its up rows) and `experts.down_proj` [E, H, I], while `save_pretrained` (and the published
checkpoints) store one tensor per expert and projection: `experts.{e}.gate_proj.weight`, ... (mixtral:
`block_sparse_moe.experts.{e}.w1/w3/w2.weight`, its router under `block_sparse_moe.gate`).
transformers converts these on load by materialising every expert's tensors and stacking them; here
the batched tensor is a virtual view over the per-expert tensors instead, so a rank that holds some
experts (expert parallelism), or some rows of them (tensor parallelism, ZeRO-3), reads only those bytes.
The stacking order (expert-major; gate before up) is the one transformers' conversion uses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import ModelError

# (gate, up, down) names of one expert's projections, as checkpoints store them.
EXPERT_PART_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# Where a block's per-expert tensors may live, relative to the model's block name ("model.layers.0.mlp").
BLOCK_RENAMES = ((".mlp", ".mlp"), (".mlp", ".block_sparse_moe"))

ViewOf = Callable[[str], object]
"""Stored name -> its safetensors slice view (supports get_shape() and [slices])."""


def _span(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    if step != 1:
        raise ValueError(f"expert views read contiguous slices only, got step {step}")
    return start, max(start, stop)


class StackedExpertsView:
    """A batched expert tensor [E, rows, cols] whose expert e is the concatenation along rows of the
    stored tensors `parts[e]`; indexing with slices reads only the selected experts and rows."""

    def __init__(self, parts: list[list[str]], view_of: ViewOf):
        self.parts, self.view_of = parts, view_of
        shapes = [tuple(view_of(name).get_shape()) for name in parts[0]]
        self.part_rows = [shape[0] for shape in shapes]
        self.cols = shapes[0][1]

    def get_shape(self) -> list[int]:
        return [len(self.parts), sum(self.part_rows), self.cols]

    def __getitem__(self, index) -> torch.Tensor:
        index = tuple(index) if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (3 - len(index))
        experts = range(*_span(index[0], len(self.parts)))
        low, high = _span(index[1], sum(self.part_rows))
        stacked = []
        for expert in (experts or [0]):  # no expert selected: an empty read of expert 0 gives dtype and shape
            pieces, offset = [], 0
            for name, rows in zip(self.parts[expert], self.part_rows):
                start, stop = max(low, offset), min(high, offset + rows)
                if start < stop:
                    pieces.append(self.view_of(name)[start - offset:stop - offset, index[2]])
                offset += rows
            if not pieces:  # no rows selected: an empty read keeps dtype and column count
                pieces.append(self.view_of(self.parts[expert][0])[0:0, index[2]])
            stacked.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        out = torch.stack(stacked)
        return out if experts else out[:0]


class RenamedView:
    """A stored tensor served under the model's name (mixtral's router under `block_sparse_moe.gate`);
    the file is opened on each read, so the view outlives the folder's closing between loads."""

    def __init__(self, stored: str, view_of: ViewOf):
        self.stored, self.view_of = stored, view_of

    def get_shape(self) -> list[int]:
        return list(self.view_of(self.stored).get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self.view_of(self.stored)[index]


def expert_views(model_names: dict[str, tuple[int, ...]], on_file: set[str],
                 view_of: ViewOf) -> tuple[dict[str, object], set[str]]:
    """(model name -> view, stored names those views read) for every batched expert parameter (and a
    renamed router) of the model that the file holds per expert; empty when the file holds the model's names."""
    views: dict[str, object] = {}
    used: set[str] = set()
    for name, shape in model_names.items():
        block, _, leaf = name.rpartition(".experts.")
        if leaf not in ("gate_up_proj", "down_proj") or name in on_file or len(shape) != 3:
            continue
        for (ours, theirs), (gate, up, down) in ((r, p) for r in BLOCK_RENAMES for p in EXPERT_PART_NAMES):
            stored_block = block[: len(block) - len(ours)] + theirs if block.endswith(ours) else block
            if f"{stored_block}.experts.0.{gate if leaf == 'gate_up_proj' else down}.weight" not in on_file:
                continue
            projections = (gate, up) if leaf == "gate_up_proj" else (down,)
            parts = [[f"{stored_block}.experts.{e}.{p}.weight" for p in projections] for e in range(shape[0])]
            missing = [n for group in parts for n in group if n not in on_file]
            if missing:
                raise ModelError(f"{name}: the checkpoint stores its experts one by one but lacks "
                                 f"{len(missing)} of their tensors: {', '.join(missing[:3])}; the model expects "
                                 f"{shape[0]} experts (is config.json the one these weights were saved with?)")
            views[name] = StackedExpertsView(parts, view_of)
            used.update(n for group in parts for n in group)
            router, stored_router = f"{block}.gate.weight", f"{stored_block}.gate.weight"
            if router != stored_router and router in model_names and router not in on_file \
                    and stored_router in on_file:
                views[router] = RenamedView(stored_router, view_of)
                used.add(stored_router)
            break
    return views, used
