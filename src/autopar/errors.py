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


# Exit statuses the CLI and the launcher use besides 0 (done), 1 (a bug or a failed rank) and 2 (bad input).
PREEMPTED_EXIT = 75  # stopped by SIGTERM/SIGINT after saving a checkpoint: resumable (EX_TEMPFAIL, "try again")
HANG_EXIT = 124  # the hang watchdog stopped the run (no step finished within --hang-timeout-s), as timeout(1)


class Preempted(Exception):
    """Training stopped on a signal after saving a checkpoint; `autopar train --resume RUN_DIR` continues it."""

    exit_code = PREEMPTED_EXIT
