"""Models autopar can build by name, and meta-device materialisation.

`build_model` returns a model on the meta device (no memory) plus a `ModelInfo`;
`materialize` then allocates and seeds it identically on every rank.
"""

from __future__ import annotations

from .materialize import materialize, materialize_partial
from .registry import ModelInfo, available_models, build_model

__all__ = ["ModelInfo", "available_models", "build_model", "materialize", "materialize_partial"]
