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


@contextmanager
def construction_errors(name: str, model_args: dict[str, Any]) -> Iterator[None]:
    """Any failure of the config's or the model's own construction code (a validation error, an IndexError
    deep in a layer's __init__) becomes one ModelError naming the model and the arguments given."""
    try:
        yield
    except ModelError:
        raise
    except Exception as exc:  # transformers' construction code raises many kinds; all mean these arguments
        reason = " ".join(str(exc).split())  # one line: the CLI prints errors as one line
        given = f"with model arguments {model_args}" if model_args else "with its default arguments"
        raise ModelError(f"cannot build {name} {given}: {type(exc).__name__}: {reason}") from exc


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
        # Config validation errors (huggingface_hub's strict dataclass errors are not
        # ValueErrors) and shape errors in the modules are both bad model_args.
        with construction_errors(name, model_args):
            config = config_cls(**resolved)
            with device:
                model = model_cls(config)
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


# ----------------------------------------------------------------------------- any architecture, any folder

GENERIC_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": False,
}
"""Small sizes for `hf:<model_type>`, applied where the model type's config has the attribute (directly or
through its attribute_map, e.g. GPT-2's n_embd); dropout probabilities are set to 0 as for the named models."""


def causal_lm_types() -> list[str]:
    """Every model type transformers builds as a causal LM (what `hf:<model_type>` accepts)."""
    import_transformers("hf:<model_type>")  # a clear error when it is not installed
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def is_folder_name(name: str) -> bool:
    """`hf:PATH` names a local folder (anything with a path separator, or an existing directory)."""
    from pathlib import Path
    rest = name[3:]
    return "/" in rest or rest.startswith(".") or Path(rest).is_dir()


def _info(name: str, config: Any, model: nn.Module, args: dict[str, Any]) -> ModelInfo:
    positions = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions", "max_seq_len")
                      if isinstance(getattr(config, k, None), int)), 2048)
    return ModelInfo(name=name, task="causal-lm", vocab_size=config.vocab_size, max_seq_len=positions,
                     num_params=count_params(model), args={k: v for k, v in args.items() if v is not None})


def _build_causal_lm(name: str, config: Any, device: torch.device) -> nn.Module:
    transformers = import_transformers(name)
    try:
        with device:
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError as exc:
        if "sdpa" not in str(exc).lower():
            raise
    with device:  # an architecture without SDPA attention: its own written-out attention
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _apply_args(name: str, config: Any, model_args: dict[str, Any]) -> dict[str, Any]:
    """Set model_args on a config (coerced to the attribute's type); unknown names are refused."""
    applied = _checked_args(name, config, model_args)
    for key, value in applied.items():
        setattr(config, key, value)
    return applied


def _checked_args(name: str, reference: Any, model_args: dict[str, Any]) -> dict[str, Any]:
    """model_args by the config's own attribute names (aliases resolved), coerced to the types of `reference`'s
    values; unknown names are refused."""
    aliases = getattr(type(reference), "attribute_map", {}) or {}
    checked = {}
    for key, value in model_args.items():
        canon = aliases.get(key, key)
        if canon.startswith("_") or not hasattr(reference, canon) or callable(getattr(reference, canon)):
            raise ModelError(f"unknown model argument '{key}' for {name}: {type(reference).__name__} has no such "
                             f"attribute")
        checked[canon] = coerce_value(name, key, value, getattr(reference, canon))
    return checked


def build_hf_model_type(name: str, model_args: dict[str, Any], vocab_size: int | None,
                        device: torch.device) -> tuple[nn.Module, ModelInfo]:
    """`hf:<model_type>`: any causal-LM architecture transformers knows, small, built from its config class."""
    transformers = import_transformers(name)
    model_type = name[3:]
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    causal = causal_lm_types()
    if model_type not in CONFIG_MAPPING_NAMES:
        close = [t for t in causal if model_type.lower()[:3] in t][:8]
        raise ModelError(f"unknown model {name!r}: transformers {transformers.__version__} has no model type "
                         f"{model_type!r}; `autopar models --hf` lists the {len(causal)} causal-LM types"
                         + (f" (similar: {', '.join(close)})" if close else "")
                         + "; a local folder is named hf:./PATH")
    if model_type not in causal:
        raise ModelError(f"{name}: {model_type!r} is not a causal language model in transformers (no "
                         f"AutoModelForCausalLM class); `autopar models --hf` lists the {len(causal)} that are")
    with quiet_transformers(transformers):
        reference = transformers.AutoConfig.for_model(model_type)
        aliases = getattr(type(reference), "attribute_map", {}) or {}
        defaults = {k: v for k, v in GENERIC_DEFAULTS.items() if hasattr(reference, aliases.get(k, k))}
        defaults.update({k: 0.0 for k, v in reference.to_dict().items()
                         if isinstance(v, float) and ("dropout" in k or "pdrop" in k)})
        defaults["vocab_size"] = vocab_size if vocab_size is not None else DEFAULT_VOCAB_SIZE
        defaults = {aliases.get(k, k): v for k, v in defaults.items()}
        applied = _checked_args(name, reference, model_args)
        # given to the constructor, not set afterwards: fields derived from others follow them (Qwen2's
        # layer_types has one entry per layer, so num_hidden_layers set on a built config left it short)
        with construction_errors(name, model_args):
            config = transformers.AutoConfig.for_model(model_type, **{**defaults, **applied})
            model = _build_causal_lm(name, config, device)
    return model, _info(name, config, model, {**defaults, **applied})


def build_hf_folder(name: str, model_args: dict[str, Any], device: torch.device) -> tuple[nn.Module, ModelInfo]:
    """`hf:PATH`: the architecture of a local pretrained folder (its config.json), on `device` (meta: no memory).

    The weights are not read here: `PretrainedWeights` checks them against this model and each rank reads its
    part later. model_args may change settings such as dropout; a changed shape is caught by that check.
    """
    from pathlib import Path
    transformers = import_transformers(name)
    folder = Path(name[3:])
    if not (folder / "config.json").is_file():
        raise ModelError(f"{name}: {str(folder)!r} is not a pretrained model folder (no config.json); save one with "
                         f"model.save_pretrained(PATH), or name an architecture as hf:<model_type>")
    with quiet_transformers(transformers):
        try:
            config = transformers.AutoConfig.from_pretrained(str(folder))
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"{name}: config.json cannot be read: {' '.join(str(exc).split())}") from None
        config.use_cache = False
        applied = _apply_args(name, config, model_args)
        with construction_errors(name, model_args):
            model = _build_causal_lm(name, config, device)
    return model, _info(name, config, model, applied)


def hf_config_json(model: nn.Module, source_folder: str | None = None) -> str | None:
    """The model's Hugging Face config.json text (written into the run folder, used by export), if it has one;
    `architectures` names the model's class, as save_pretrained writes it (export rebuilds that class), and
    `use_cache` is the source's own (training turns it off; a model that generates wants it back)."""
    import copy
    from .hf_side_files import source_use_cache
    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        return None
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    own = source_use_cache(config, source_folder)
    if own is not None:
        config.use_cache = own
    return config.to_json_string()
