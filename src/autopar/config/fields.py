"""What every configuration section shares: the field with its help text, and the integer checks."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from ..errors import ConfigError


def _f(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with a default and its help text (shown by `--help`)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_nonnegative_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
