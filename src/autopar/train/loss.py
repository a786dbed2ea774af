"""Losses normalised over the whole global batch, so any parallel layout gives the same numbers.

A single process averages the loss over every target token of the global batch. Split
over replicas and micro-batches, each piece computes the *sum* of its token losses and
divides by the global token count (agreed on with one small all-reduce per step); summing
the pieces' gradients then gives exactly the single-process gradient, even when pieces hold
different numbers of targets (masked LM).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..data.datasets import IGNORE_INDEX
from ..models.output import logits_of

Batch = dict[str, torch.Tensor]


def as_batch(sample: Any) -> Batch:
    """Accept dict samples {"input_ids" or "inputs", "labels", ...} or (inputs, labels) pairs."""
    if isinstance(sample, Mapping):
        return dict(sample)
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        return {"inputs": sample[0], "labels": sample[1]}
    raise TypeError(f"a training sample must be a dict with 'input_ids' and 'labels' or an (inputs, labels) "
                    f"pair, got {type(sample).__name__}")


def main_input(batch: Batch) -> torch.Tensor:
    """The tensor the model is called on: token ids for language models, else `inputs`."""
    if "input_ids" in batch:
        return batch["input_ids"]
    if "inputs" in batch:
        return batch["inputs"]
    raise KeyError(f"a batch needs 'input_ids' or 'inputs', got keys {sorted(batch)}; or pass forward_fn to the Trainer")


def forward_inputs(batch: Batch) -> tuple[tuple, dict]:
    """(args, kwargs) the model is called with: the main input positional, every other non-label
    field as a keyword (attention_mask, token_type_ids, decoder_input_ids, ...). Traced engines
    trace and call the model on exactly these, so every layout sees what one process sees."""
    extra = {k: v for k, v in batch.items() if k not in ("input_ids", "inputs", "labels")}
    return (main_input(batch),), extra


def default_forward(model: torch.nn.Module, batch: Batch) -> Any:
    """Call the model on the main input, passing any other non-label fields as keyword arguments."""
    args, kwargs = forward_inputs(batch)
    return model(*args, **kwargs)


def tokens_in(batch: Batch) -> int:
    """Throughput unit: tokens for token batches, samples otherwise."""
    return batch["input_ids"].numel() if "input_ids" in batch else len(main_input(batch))


def count_targets(batch: Batch) -> int:
    return int((batch["labels"] != IGNORE_INDEX).sum())


def target_count(batch: Batch) -> torch.Tensor:
    """`count_targets` as a device tensor: no host wait (the step loop's form)."""
    return (batch["labels"] != IGNORE_INDEX).sum()


def token_loss_sum(output: Any, batch: Batch) -> torch.Tensor:
    """Sum of cross-entropy over target tokens (labels of -100 are skipped), in fp32."""
    logits = logits_of(output)
    return F.cross_entropy(logits.float().flatten(0, -2), batch["labels"].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


LossFn = Callable[[Any, Batch], torch.Tensor]
