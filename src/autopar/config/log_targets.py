"""Which loggers `--log` may name, and the check that each is installed, made before any rank starts."""

from __future__ import annotations

import importlib.util

from ..errors import ConfigError, choices

LOGGERS = ("csv", "tensorboard", "wandb")
PACKAGES = {"tensorboard": ("tensorboard", "pip install 'autopar[tensorboard]' (or pip install tensorboard)"),
            "wandb": ("wandb", "pip install 'autopar[wandb]' (or pip install wandb)")}


def logger_names(spec: str) -> list[str]:
    """`--log tensorboard,csv` as a list, checked: known names, their packages installed."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise ConfigError(f"--log {spec!r}: unknown logger {unknown[0]!r}; use a comma-separated list of "
                          f"{choices(LOGGERS)} (metrics.jsonl is always written)")
    for name in names:
        package, install = PACKAGES.get(name, (None, ""))
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(f"--log {name}: the {package!r} package is not installed in this Python; {install}, "
                              f"or leave {name} out of --log")
    return names
