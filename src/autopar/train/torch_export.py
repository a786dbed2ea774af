"""Export a run's checkpoint as one plain PyTorch state_dict file, for any model (one of ours, a user's module,
a Hugging Face one): `model.load_state_dict(torch.load(path))`.

Checkpoints hold whole tensors under the model's own names (tensor-parallel slices gathered, ZeRO shards
whole, train/checkpoint.py), so the file is the single-process state_dict. A tied weight is stored once in a
checkpoint; the run folder's run.json names its other names (`tied_weights`, written by the Trainer), and the
file lists it under every name, sharing one tensor, so that a strict `load_state_dict` finds all of them.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ..errors import CheckpointError
from .checkpoint import find_checkpoint

MODEL_PREFIX = "model."


def export_torch(source: str | Path, out: str | Path) -> tuple[Path, int]:
    """Write the model state of `source`'s checkpoint (a run folder's newest, or a checkpoint folder) to the file
    `out` with torch.save; returns the file and the number of entries."""
    checkpoint = find_checkpoint(source)
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    stored = {key[len(MODEL_PREFIX):]: meta for key, meta in metadata.items()
              if key.startswith(MODEL_PREFIX) and hasattr(meta, "size")}
    if not stored:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} holds no model tensors; is it an autopar checkpoint?")
    state = {"model": {name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                       for name, meta in stored.items()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    weights = dict(state["model"])
    for group in _tied_groups(checkpoint.parent.parent):
        held = next((name for name in group if name in weights), None)
        for name in group if held is not None else ():
            weights.setdefault(name, weights[held])  # one tensor under every name (torch.save keeps it shared)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out)
    return out, len(weights)


def _tied_groups(run_dir: Path) -> list[list[str]]:
    try:
        groups = json.loads((run_dir / "run.json").read_text()).get("tied_weights", [])
    except (OSError, ValueError):
        return []
    return [list(g) for g in groups if isinstance(g, list)]
