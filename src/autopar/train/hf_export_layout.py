"""The names and layout `save_pretrained` writes, from the tensors a model holds.

Recent transformers hold some weights in another form than checkpoints store them: an MoE layer's
experts batched in one tensor (`experts.gate_up_proj`) are stored one tensor per expert and projection,
mixtral's `mlp` block as `block_sparse_moe`. `save_pretrained` writes the stored form, which published
checkpoints use and other tools (older transformers, inference servers) read; the export writes it too,
through the function `save_pretrained` itself calls, one shard at a time. Where a shard cannot be
converted on its own (a conversion that needs tensors of two shards), the model's own names are
written: transformers reads those as well.
"""

from __future__ import annotations

from typing import Any

import torch


def _revert() -> Any:
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions: checkpoints hold the model's names
        return None
    return revert_weight_conversion


class SavedLayout:
    """Converts each shard's tensors (model names) to what `save_pretrained` would write for them."""

    def __init__(self, model: torch.nn.Module, shards: list[dict[str, tuple[int, ...]]]):
        self.model, self.revert = model, _revert()
        if self.revert is not None and not self._shards_convert_alone(shards):
            self.revert = None

    def _names(self, shapes: dict[str, tuple[int, ...]]) -> set[str]:
        return set(self.revert(self.model, {n: torch.empty(s, device="meta") for n, s in shapes.items()}))

    def _shards_convert_alone(self, shards: list[dict[str, tuple[int, ...]]]) -> bool:
        per_shard = [self._names(shard) for shard in shards]
        whole = self._names({n: s for shard in shards for n, s in shard.items()})
        return sum(map(len, per_shard)) == len(whole) and set().union(*per_shard) == whole

    def names(self, shapes: dict[str, tuple[int, ...]]) -> list[str]:
        """The stored names of one shard's tensors."""
        return sorted(self._names(shapes)) if self.revert is not None else list(shapes)

    def convert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.revert is None:
            return tensors
        return {n: t.contiguous() for n, t in self.revert(self.model, tensors).items()}
