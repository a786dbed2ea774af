"""Which batch fields a traced model takes, and how each micro-batch is handed to its first stage.

A whole-model engine calls `model(main_input, **other non-label fields)` (loss.default_forward).
A traced engine must see the same call, or a padded batch silently trains without its mask:
so the model is traced on every tensor field but `labels` (the main input positional, the
others as keywords) and stage 0 is given those tensors in the graph's input order.

Fields a later stage reads (a decoder's `decoder_input_ids`, a mask every layer adds) are
*carried* by the stages in between, like any other value needed later (partition/stages.py):
the stage interface stays "inputs of the first stage = the model's inputs", interleaved
schedules and tp sub-batches need nothing new, and the cost is a few integer tensors per
cut (listed in the partition table). Taking them from each rank's own copy of the batch
would save those bytes but give every stage two kinds of inputs.

The trace is static, so every micro-batch must have the traced shapes: checked on every
micro-batch with an error that names the field, rather than a wrong trace.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .loss import Batch, as_batch, forward_inputs


def traced_call(batch: Batch, device: torch.device | str = "meta") -> tuple[tuple, dict]:
    """(args, kwargs) of zeros on `device` (meta, or where a model built for real lives) to trace the model on,
    as default_forward would call it on `batch`."""
    args, kwargs = forward_inputs(batch)
    for key, value in [("main input", args[0]), *kwargs.items()]:
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"batch field {key!r} is a {type(value).__name__}, not a tensor; with pp>1 or tp>1 "
                              f"the model is traced on every batch field but 'labels', so each must be a tensor "
                              f"with the same shape in every micro-batch. Drop the field from the samples or make "
                              f"it a tensor")
    zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
    return tuple(zeros(a) for a in args), {k: zeros(v) for k, v in kwargs.items()}


def first_stage_inputs(batch: Batch, input_keys: list[int | str], shapes: list[tuple[int, ...]]) -> tuple:
    """The tensors stage 0 takes, in the traced graph's order; a shape unlike the trace's is an error."""
    args, kwargs = forward_inputs(batch)
    missing = [k for k in input_keys if isinstance(k, str) and k not in kwargs]
    extra = sorted(set(kwargs) - {k for k in input_keys if isinstance(k, str)})
    if missing or extra:
        raise ConfigError(f"this micro-batch has fields {sorted(batch)}, but the model was traced with "
                          f"{[k for k in input_keys if isinstance(k, str)]} besides the main input and labels "
                          f"(missing: {missing}, unexpected: {extra}); every micro-batch needs the same fields")
    values = tuple(args[k] if isinstance(k, int) else kwargs[k] for k in input_keys)
    for key, value, shape in zip(input_keys, values, shapes):
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
            seen = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            name = "main input" if isinstance(key, int) else key
            raise ConfigError(f"batch field {name!r} has shape {seen} in this micro-batch but {list(shape)} in the "
                              f"one the model was traced on; with pp>1 or tp>1 shapes are static: pad every "
                              f"sample to one length (or use pp=1 tp=1)")
    return values


def example_call(model: torch.nn.Module, data) -> tuple[tuple, dict]:
    """(args, kwargs) of one sample, on the device the model lives on (meta or real): what the strategy
    search traces the model on (search/auto.py), as a traced engine would call it."""
    from torch.utils.data import default_collate

    from ..models.hf import turn_off_kv_cache
    turn_off_kv_cache(model)
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    return traced_call(default_collate([as_batch(data[0])]), device)
