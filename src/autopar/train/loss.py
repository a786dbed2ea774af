"""Losses normalised over the whole global batch, so any parallel layout gives the same numbers.

A single process averages the loss over every target token of the global batch. Split
over replicas and micro-batches, each piece computes the *sum* of its token losses and
divides by the global token count (agreed on with one small all-reduce per step); summing
the pieces' gradients then gives exactly the single-process gradient, even when pieces hold
different numbers of targets (masked LM).

What a label means: position i of the output is scored against labels[i] (token-aligned
targets). A Hugging Face causal LM takes labels equal to its input ids and shifts them inside its
own loss; under the "model" label convention the Trainer turns such labels into token-aligned ones
when it loads a batch (`align_labels`), before any split, so the counts and sums here stay exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..data.datasets import IGNORE_INDEX
from ..errors import ConfigError
from ..models.output import logits_of, shifts_labels

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


LABEL_CONVENTIONS = ("model", "aligned", "causal")
"""How `labels` line up with the output. "model": the model's own convention (a Hugging Face causal LM's
labels are its input ids, shifted inside its loss; every other model's are token-aligned). "aligned": labels
are token-aligned for every model (autopar's built-in data: the next token at each position). "causal":
labels are the input ids for every model, scored against the next position (Hugging Face's causal-LM data
for a model of one's own)."""


def label_shift(model: Any, convention: str) -> bool:
    """Whether batches for `model` need `next_token_targets` under `convention`."""
    if convention not in LABEL_CONVENTIONS:
        raise ConfigError(f"label_convention must be one of {list(LABEL_CONVENTIONS)}, got {convention!r}: "
                          f"'model' follows the model's own convention (Hugging Face causal LMs take labels equal "
                          f"to the input ids), 'aligned' means labels[i] is the target of output position i, "
                          f"'causal' that labels[i + 1] is")
    return convention == "causal" or (convention == "model" and shifts_labels(model))


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face causal-LM labels made token-aligned: position i is scored against labels[i + 1], the last
    position against nothing (-100). Within each sample, so a split of the batch by samples stays exact, and
    the target count is Hugging Face's (labels[..., 1:] that are not -100)."""
    aligned = torch.full_like(labels, IGNORE_INDEX)
    aligned[..., :-1] = labels[..., 1:]
    return aligned


def align_labels(batch: Batch, shift: bool) -> Batch:
    """`batch` with token-aligned labels (see `label_shift`)."""
    if not shift or "labels" not in batch:
        return batch
    return {**batch, "labels": next_token_targets(batch["labels"])}


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
