"""Errors that users see.

Every error autopar raises on bad input is an `AutoparError` whose message says what is
wrong, the value seen and what would work. The CLI and the launcher print these as one
short line (no traceback) and exit with status 2; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

from collections.abc import Iterable


class AutoparError(Exception):
    """Base class for errors caused by the user's input or environment."""


class ConfigError(AutoparError):
    """A configuration value is invalid (bad flag, bad TOML, bad combination)."""


class ModelError(AutoparError):
    """An unknown model name, an unknown model argument, or a missing optional package."""


class DataError(AutoparError):
    """The training or eval data cannot be used as configured."""


class CheckpointError(AutoparError):
    """A checkpoint is missing, incomplete or corrupt."""


class TrainingError(AutoparError):
    """Training cannot go on (the loss became NaN or infinite)."""


class DistributedError(AutoparError):
    """The process group could not be formed, or another rank failed."""


def choices(values: Iterable[object]) -> str:
    """Format a set of valid values for an error message: `{a, b, c}`."""
    return "{" + ", ".join(str(v) for v in values) + "}"
