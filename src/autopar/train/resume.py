"""Which checkpoint a starting run resumes from, agreed by every rank.

Rank 0 reads the checksums once (manifest.py) and tells the others, so every rank loads the same
folder even when a checkpoint is being damaged or pruned while they start.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from ..errors import CheckpointError
from . import manifest


def agree_on_resume_checkpoint(run_dir: Path, resume: str | None, *, restarted: bool) -> Path | None:
    """On a restart, the run folder's newest checkpoint that verifies; else `resume` (a run folder falls back
    past damaged checkpoints, with a warning); else None. Collective: every rank calls it."""
    chosen: list = [None, [], None]
    if dist.get_rank() == 0:
        try:
            if restarted and any(e.problem is None for e in manifest.list_checkpoints(run_dir)):
                path, warnings = manifest.choose_checkpoint(run_dir)
            elif resume:
                path, warnings = manifest.choose_checkpoint(resume)
            else:
                path, warnings = None, []
            chosen = [None if path is None else str(path), warnings, None]
        except CheckpointError as exc:
            chosen = [None, [], str(exc)]
    dist.broadcast_object_list(chosen, src=0)
    path, warnings, error = chosen
    if error is not None:
        raise CheckpointError(error)
    for warning in warnings if dist.get_rank() == 0 else []:
        print(f"autopar: warning: {warning}", file=sys.stderr, flush=True)
    return None if path is None else Path(path)
