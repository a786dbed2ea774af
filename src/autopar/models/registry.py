"""Model names, the GPT size table, and argument checking shared by all builders.

One table maps each public model name to a builder, so `available_models()`, the
"unknown model" message and `build_model` can never disagree. Model arguments often
come from the command line as strings, so they are coerced here to the type of the
field's default, with an error that names the argument, the value and the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from autopar.errors import ModelError, choices

from .gpt import GPT, GPTConfig

DEFAULT_VOCAB_SIZE = 256
"""Vocabulary size used when neither the caller nor model_args gives one."""

GPT_SIZES: dict[str, dict[str, int]] = {
    "gpt-tiny": {"n_layer": 2, "n_head": 4, "d_model": 64, "max_seq_len": 256},
    "gpt-mini": {"n_layer": 4, "n_head": 4, "d_model": 128, "max_seq_len": 256},
    "gpt-small": {"n_layer": 12, "n_head": 12, "d_model": 768, "max_seq_len": 1024},
    "gpt-medium": {"n_layer": 24, "n_head": 16, "d_model": 1024, "max_seq_len": 1024},
    "gpt-1.5b": {"n_layer": 48, "n_head": 25, "d_model": 1600, "max_seq_len": 2048},
    "gpt-2.5b": {"n_layer": 54, "n_head": 20, "d_model": 1920, "max_seq_len": 2048},
    "gpt-8.3b": {"n_layer": 72, "n_head": 32, "d_model": 3072, "max_seq_len": 2048},
    "gpt-20b": {"n_layer": 44, "n_head": 64, "d_model": 6144, "max_seq_len": 2048},
}
"""Preset shapes of the reference GPT: GPT-2 small/medium; GPT-2 XL (1.5b), Megatron-LM's 2.5b and 8.3b
and a GPT-NeoX-20B-shaped 20b (the billions assume GPT-2's 50257-token vocabulary; build them on meta)."""

HF_NAMES = ("hf:gpt2", "hf:llama", "hf:bert")

WORD_SIZES: dict[str, dict[str, int]] = {
    "word-lstm": {},
    "word-gpt": {"n_layer": 2, "n_head": 4, "d_model": 64, "max_seq_len": 256},
}
"""Word-level LMs with untied input embeddings (models/word_lm.py); vocabulary from the tokenizer."""


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of autopar needs to know about a built model, without inspecting it."""

    name: str
    """The name as requested, e.g. "gpt-mini" or "hf:llama"."""
    task: str
    """"causal-lm" or "masked-lm"; decides how the trainer builds labels."""
    vocab_size: int
    """Number of output logits per position."""
    max_seq_len: int
    """Longest sequence the model accepts (number of positions)."""
    num_params: int
    """Unique parameters; a tied weight is counted once."""
    args: dict
    """Fully resolved model arguments (plain values), written to the run's config file."""


def available_models() -> list[str]:
    """Every name `build_model` accepts, GPT sizes first."""
    return [*GPT_SIZES, *WORD_SIZES, *HF_NAMES]


def count_params(module: nn.Module) -> int:
    """Unique parameter count (`parameters()` yields a shared Parameter once); works on meta."""
    return sum(p.numel() for p in module.parameters())


# ----------------------------------------------------------------------------- coercion

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(value)


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        return int(value.strip().replace("_", ""))
    raise ValueError(value)


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value.strip())
    raise ValueError(value)


def _loose(value: Any) -> Any:
    """Best guess for a field whose default is None: null, bool, int, float, JSON, else str."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    if text[:1] in "[{":
        return json.loads(text)
    return text


def coerce_value(model: str, key: str, value: Any, default: Any) -> Any:
    """Convert `value` to the type of `default`, or raise a ModelError naming all three."""
    try:
        if isinstance(default, bool):
            return _to_bool(value)
        if isinstance(default, int):
            return _to_int(value)
        if isinstance(default, float):
            return _to_float(value)
        if default is None:
            return _loose(value)
        if isinstance(default, (list, tuple, dict)):
            parsed = json.loads(value) if isinstance(value, str) else value
            if isinstance(default, dict) != isinstance(parsed, dict) or not isinstance(
                parsed, (list, tuple, dict)
            ):
                raise ValueError(value)
            return list(parsed) if isinstance(parsed, tuple) else parsed
        if isinstance(default, str):
            if isinstance(value, str):
                return value
            raise ValueError(value)
        return value
    except (ValueError, TypeError) as exc:
        kind = "true/false" if isinstance(default, bool) else type(default).__name__
        raise ModelError(
            f"invalid value {value!r} for model argument '{key}' of {model}: "
            f"expected {kind} (default {default!r})"
        ) from exc


def check_model_args(model_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """A plain dict copy of model_args; rejects non-mapping input and non-string keys."""
    if model_args is None:
        return {}
    if not isinstance(model_args, Mapping):
        raise ModelError(
            "model_args must be a mapping of argument name to value, "
            f"got {type(model_args).__name__}"
        )
    for key in model_args:
        if not isinstance(key, str):
            raise ModelError(f"model argument names must be strings, got {key!r}")
    return dict(model_args)


def check_vocab_size(vocab_size: Any) -> int | None:
    """The caller's vocab_size, if any, must be a positive integer."""
    if vocab_size is None:
        return None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ModelError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    return vocab_size


def to_device(device: str | torch.device) -> torch.device:
    """Parse a device, turning torch's RuntimeError into a ModelError."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelError(
            f"invalid device {device!r}; use e.g. 'meta', 'cpu', 'cuda' or 'cuda:0'"
        ) from exc


# ----------------------------------------------------------------------------- builders


def build_gpt(
    name: str, model_args: dict[str, Any], vocab_size: int | None, device: torch.device
) -> tuple[nn.Module, ModelInfo]:
    """Build the reference GPT at the preset size `name`, overridden by model_args."""
    valid = GPTConfig.field_names()
    unknown = [k for k in model_args if k not in valid]
    if unknown:
        raise ModelError(
            f"unknown model argument '{unknown[0]}' for {name}; valid: {choices(sorted(valid))}"
        )
    defaults = asdict(GPTConfig())
    resolved: dict[str, Any] = dict(GPT_SIZES[name])
    resolved["vocab_size"] = vocab_size if vocab_size is not None else DEFAULT_VOCAB_SIZE
    for key, value in model_args.items():
        resolved[key] = coerce_value(name, key, value, defaults[key])
    config = GPTConfig(**resolved)
    with device:
        model = GPT(config)
    info = ModelInfo(
        name=name,
        task="causal-lm",
        vocab_size=config.vocab_size,
        max_seq_len=config.max_seq_len,
        num_params=count_params(model),
        args=asdict(config),
    )
    return model, info


def build_word_lm(
    name: str, model_args: dict[str, Any], vocab_size: int | None, device: torch.device
) -> tuple[nn.Module, ModelInfo]:
    """word-lstm / word-gpt: the vocabulary comes from the (word) tokenizer unless model_args sets it."""
    from .word_lm import WordGPT, WordLSTM, WordLSTMConfig  # noqa: PLC0415

    config_cls, model_cls = (WordLSTMConfig, WordLSTM) if name == "word-lstm" else (GPTConfig, WordGPT)
    valid = config_cls.field_names()
    unknown = [k for k in model_args if k not in valid]
    if unknown:
        raise ModelError(f"unknown model argument '{unknown[0]}' for {name}; valid: {choices(sorted(valid))}")
    defaults = asdict(config_cls())
    resolved: dict[str, Any] = dict(WORD_SIZES[name])
    if vocab_size is not None:
        resolved["vocab_size"] = vocab_size
    for key, value in model_args.items():
        resolved[key] = coerce_value(name, key, value, defaults[key])
    config = config_cls(**resolved)
    with device:
        model = model_cls(config)
    info = ModelInfo(name=name, task="causal-lm", vocab_size=config.vocab_size, max_seq_len=config.max_seq_len,
                     num_params=count_params(model), args=asdict(config))
    return model, info


def _build_hf(
    name: str, model_args: dict[str, Any], vocab_size: int | None, device: torch.device
) -> tuple[nn.Module, ModelInfo]:
    from .hf import build_hf  # lazy: keeps transformers out of plain GPT runs

    return build_hf(name, model_args, vocab_size, device)


def _build_hf_any(
    name: str, model_args: dict[str, Any], vocab_size: int | None, device: torch.device
) -> tuple[nn.Module, ModelInfo]:
    from .hf import build_hf_folder, build_hf_model_type, is_folder_name

    if is_folder_name(name):
        return build_hf_folder(name, model_args, device)
    return build_hf_model_type(name, model_args, vocab_size, device)


BUILDERS: dict[str, Callable[..., tuple[nn.Module, ModelInfo]]] = {
    **{name: build_gpt for name in GPT_SIZES},
    **{name: build_word_lm for name in WORD_SIZES},
    **{name: _build_hf for name in HF_NAMES},
}


def build_model(
    name: str,
    model_args: Mapping[str, Any] | None = None,
    *,
    vocab_size: int | None = None,
    device: str | torch.device = "meta",
) -> tuple[nn.Module, ModelInfo]:
    """Build model `name` on `device` (meta by default: no memory until `materialize`).

    `vocab_size` (the tokenizer's, padded) is used unless model_args sets vocab_size.
    """
    builder = BUILDERS.get(name) if isinstance(name, str) else None
    if builder is None and isinstance(name, str) and name.startswith("hf:") and len(name) > 3:
        builder = _build_hf_any  # hf:PATH (a pretrained folder) or hf:<model_type> (any causal-LM architecture)
    if builder is None:
        raise ModelError(f"unknown model {name!r}; available: {choices(available_models())}")
    args = check_model_args(model_args)
    return builder(name, args, check_vocab_size(vocab_size), to_device(device))
