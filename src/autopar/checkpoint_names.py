"""How checkpoint folders are named: `step_00000012` (and `step_00000012.partial` while being written).

One definition, low in the layers, because both the training side (train/checkpoint.py writes them,
train/manifest.py lists and verifies them) and the launcher (launch.py logs which step a shrunk job
resumes from) read a step from a folder's name; no torch here.
"""

from __future__ import annotations

import re
from pathlib import PurePath

_STEP_FOLDER = re.compile(r"^step_(\d+)(\.partial)?$")


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint of `step` (zero-padded, so names sort as steps do)."""
    return f"step_{step:08d}"


def step_of(folder: str | PurePath) -> int | None:
    """The step a checkpoint folder (a path, or just its name) holds; None for any other name."""
    match = _STEP_FOLDER.match(PurePath(folder).name)
    return int(match.group(1)) if match else None
