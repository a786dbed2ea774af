"""Models autopar can build by name, and meta-device materialisation.

`build_model` returns a model on the meta device (no memory) plus a `ModelInfo`;
`materialize` then allocates and seeds it identically on every rank.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["ModelInfo", "available_models", "build_model", "materialize", "materialize_partial"]
_EXPORTS = {"ModelInfo": ".registry", "available_models": ".registry", "build_model": ".registry",
            "materialize": ".materialize", "materialize_partial": ".materialize"}

if TYPE_CHECKING:
    from .materialize import materialize, materialize_partial
    from .registry import ModelInfo, available_models, build_model


def __getattr__(name: str) -> Any:
    """Imported when first used, so that `autopar models` (models/catalog.py) starts without torch."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autopar.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
