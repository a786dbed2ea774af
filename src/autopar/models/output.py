"""Reading a model's output: the logits, whatever container the model returns them in, and which label
each output position is scored against (`shifts_labels`)."""

from __future__ import annotations

import sys
from typing import Any

import torch


def logits_of(output: Any) -> torch.Tensor:
    """Logits from a tensor, a Hugging Face ModelOutput, or a tuple whose first item is logits."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find logits in the model output of type {type(output).__name__}; "
                    f"pass forward_fn/loss_fn to the Trainer")


def router_aux_loss_coef(model: Any) -> float:
    """The weight a mixture-of-experts model gives its own load-balancing loss, when its config turns that loss on
    (Hugging Face: `output_router_logits` with `router_aux_loss_coef`); 0 otherwise."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def aux_loss_of(output: Any) -> torch.Tensor | None:
    """The auxiliary loss a model returned beside its logits (a Hugging Face MoE output's `aux_loss`), if any."""
    value = getattr(output, "aux_loss", None)
    return value if isinstance(value, torch.Tensor) else None


def _hf_causal_class_names() -> set[str]:
    """Class names Hugging Face maps to its causal-LM head (GPT2LMHeadModel, LlamaForCausalLM, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def shifts_labels(model: Any) -> bool:
    """Whether `model` scores output position i against labels[i + 1]: a Hugging Face causal LM.

    Hugging Face causal LMs take labels equal to the input ids and shift them inside their loss
    (every HF collator builds labels that way); masked LMs and encoder-decoders score position i
    against labels[i]. Decided from the model's class (the causal-LM mapping of its auto classes, or a
    class named *ForCausalLM), never from the data. Any other model's labels are token-aligned.
    """
    transformers = sys.modules.get("transformers")  # a Hugging Face model has imported it already
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return False
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    causal = _hf_causal_class_names()
    return any(cls.__name__ in causal or cls.__name__.endswith("ForCausalLM") for cls in type(model).__mro__)
