"""Hugging Face models built from a config (never downloaded), for testing autopar on
models it did not write.

Each name has tiny defaults (2 layers, width 64) so a model builds and runs in
milliseconds on CPU; model_args override any config attribute. transformers is
imported only when one of these names is built, so it stays an optional dependency.
Dropout defaults to 0 (as in the reference GPT) so that parallel runs can be compared
bit-for-bit against a single-process run; set it back with model_args if wanted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.errors import ModelError, choices

from .registry import DEFAULT_VOCAB_SIZE, ModelInfo, coerce_value, count_params

# Not a config attribute (it is `_attn_implementation`), but accepted by every config.
_ATTN_ARG = "attn_implementation"


@dataclass(frozen=True)
class HFSpec:
    """How to build one `hf:` name: the transformers classes and the tiny defaults."""

    config_class: str
    model_class: str
    task: str
    defaults: dict[str, Any] = field(default_factory=dict)


_COMMON = {"use_cache": False, _ATTN_ARG: "sdpa"}  # training, and sdpa runs on CPU

SPECS: dict[str, HFSpec] = {
    "hf:gpt2": HFSpec(
        "GPT2Config",
        "GPT2LMHeadModel",
        "causal-lm",
        {
            "n_layer": 2,
            "n_embd": 64,
            "n_head": 4,
            "n_positions": 256,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            # GPT-2's default ids (50256) lie outside a small vocabulary.
            "bos_token_id": 0,
            "eos_token_id": 0,
            **_COMMON,
        },
    ),
    "hf:llama": HFSpec(
        "LlamaConfig",
        "LlamaForCausalLM",
        "causal-lm",
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 176,  # about 8/3 * hidden, SwiGLU style
            "num_attention_heads": 4,
            "num_key_value_heads": 2,  # grouped-query attention
            "max_position_embeddings": 256,
            "bos_token_id": 1,
            "eos_token_id": 2,
            **_COMMON,
        },
    ),
    "hf:bert": HFSpec(
        "BertConfig",
        "BertForMaskedLM",
        "masked-lm",
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "intermediate_size": 256,
            "max_position_embeddings": 256,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            "pad_token_id": 0,
            **_COMMON,
        },
    ),
}


def import_transformers(name: str) -> Any:
    """Import transformers, or explain how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ModelError(
            f"{name} needs the transformers package: pip install 'autopar[hf]' "
            "(or pip install transformers)"
        ) from exc
    return transformers


def _strict_error() -> type[Exception]:
    """huggingface_hub's config validation error class, if this version has one."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ValueError
    return StrictDataclassError


@contextmanager
def quiet_transformers(transformers: Any) -> Iterator[None]:
    """Silence transformers' info/warning logging while building, then restore it."""
    log = transformers.utils.logging
    old = log.get_verbosity()
    log.set_verbosity_error()
    try:
        yield
    finally:
        log.set_verbosity(old)


def _resolve_args(
    name: str, spec: HFSpec, config_cls: type, model_args: dict[str, Any], vocab_size: int | None
) -> dict[str, Any]:
    """Defaults, then the caller's vocab_size, then model_args (coerced, aliases resolved)."""
    reference = config_cls()  # HF defaults: for type coercion and for "is this an attribute"
    aliases = getattr(config_cls, "attribute_map", {}) or {}
    resolved = dict(spec.defaults)
    resolved["vocab_size"] = vocab_size if vocab_size is not None else DEFAULT_VOCAB_SIZE
    for key, value in model_args.items():
        canon = aliases.get(key, key)
        if canon in resolved:
            default = resolved[canon]
        elif (
            not canon.startswith("_")
            and hasattr(reference, canon)
            and not callable(getattr(reference, canon))
        ):
            default = getattr(reference, canon)
        else:
            valid = choices(sorted(resolved))
            raise ModelError(
                f"unknown model argument '{key}' for {name}; valid: {valid} "
                f"or any other {config_cls.__name__} attribute"
            )
        resolved[canon] = coerce_value(name, key, value, default)
    return resolved


def build_hf(
    name: str, model_args: dict[str, Any], vocab_size: int | None, device: torch.device
) -> tuple[nn.Module, ModelInfo]:
    """Build the `hf:` model `name` from a config on `device`; no weights are downloaded."""
    spec = SPECS[name]
    transformers = import_transformers(name)
    config_cls = getattr(transformers, spec.config_class)
    model_cls = getattr(transformers, spec.model_class)
    with quiet_transformers(transformers):
        resolved = _resolve_args(name, spec, config_cls, model_args, vocab_size)
        try:
            # Config validation errors (huggingface_hub's strict dataclass errors are not
            # ValueErrors) and shape errors in the modules are both bad model_args.
            config = config_cls(**resolved)
            with device:
                model = model_cls(config)
        except (ValueError, TypeError, AssertionError, _strict_error()) as exc:
            reason = " ".join(str(exc).split())  # one line: the CLI prints errors as one line
            raise ModelError(
                f"cannot build {name} with model arguments {model_args}: {reason}"
            ) from exc
    info = ModelInfo(
        name=name,
        task=spec.task,
        vocab_size=config.vocab_size,
        max_seq_len=config.max_position_embeddings,
        num_params=count_params(model),
        # None cannot be written to TOML; a dropped None means "transformers' default".
        args={k: v for k, v in resolved.items() if v is not None},
    )
    return model, info


def turn_off_kv_cache(model: nn.Module) -> bool:
    """Set `use_cache=False` on every config a model's modules carry; True if any had it on.

    A Hugging Face model built from a default config returns its key/value cache (a
    DynamicCache object, not a tensor) from forward, which cannot be traced and is of no use
    in training. Encoder-decoder stacks keep their own copies of the config, hence all of them.
    """
    changed = False
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False) is True:
            config.use_cache = False
            changed = True
    return changed
