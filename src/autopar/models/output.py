"""Reading a model's output: the logits, whatever container the model returns them in."""

from __future__ import annotations

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
