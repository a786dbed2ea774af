"""Checkpoint integrity: a manifest per checkpoint, verification, choosing one to resume, pruning.

Each complete checkpoint folder holds `manifest.json` (step, world size, layout, a
fingerprint of the run's config, and the size and sha256 of every other file in it). It is
written last, atomically (temp file + rename), just before the folder itself is renamed
from `step_N.partial` to `step_N`, so a folder with a manifest that verifies was written
whole and has not changed since. A damaged checkpoint (a file missing, truncated or
changed) is found before loading, and resuming from a run folder falls back to the newest
checkpoint that verifies, with a warning. Checkpoints written before manifests existed
are accepted as they are ("unverified").

Everything here reads files only; the caller decides which rank runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint_names import step_of
from ..errors import CheckpointError

MANIFEST = "manifest.json"
LATEST = "latest"
TRAINER_STATE = "trainer.json"


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _content_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST and ".tmp" not in p.name)


def write_manifest(folder: Path, step: int, info: dict[str, Any]) -> None:
    """Hash every file of a fully written checkpoint folder and write its manifest (last, atomically)."""
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in _content_files(folder)}
    write_atomic(folder / MANIFEST, json.dumps({"step": step, **info, "files": files}, indent=1) + "\n")


def verify(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder, or None when it is complete and unchanged."""
    if folder.name.endswith(".partial"):
        return "incomplete: its save was interrupted"
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        missing = [name for name in (".metadata", TRAINER_STATE) if not (folder / name).is_file()]
        return f"missing {', '.join(missing)}" if missing else None  # written before manifests: accepted
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its {MANIFEST} is unreadable ({type(exc).__name__})"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"missing {name} (listed in its {MANIFEST})"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, its {MANIFEST} says {expected['bytes']} (truncated or changed)"
        if _sha256(path) != expected["sha256"]:
            return f"{name} does not match the sha256 in its {MANIFEST} (corrupt or changed since it was saved)"
    return None


@dataclass(frozen=True)
class CheckpointEntry:
    """One checkpoint folder of a run and what state it is in."""

    path: Path
    step: int
    problem: str | None  # None: usable
    verified: bool  # it has a manifest and every file matches

    @property
    def state(self) -> str:
        if self.problem is not None:
            return self.problem if self.problem.startswith("incomplete") else f"damaged: {self.problem}"
        return "complete" if self.verified else "complete (no manifest: saved by an older autopar, unverified)"


def list_checkpoints(run_dir: Path) -> list[CheckpointEntry]:
    """Every step_* folder of a run, oldest first, each verified."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    entries = []
    for folder in root.iterdir():
        step = step_of(folder)
        if step is None or not folder.is_dir():
            continue
        problem = verify(folder)
        entries.append(CheckpointEntry(folder, step, problem, problem is None and (folder / MANIFEST).is_file()))
    return sorted(entries, key=lambda e: (e.step, e.path.name.endswith(".partial")))


def is_run_folder(path: Path) -> bool:
    return any((path / name).exists() for name in ("checkpoints", "run.json", "config.toml", "metrics.jsonl"))


def choose_checkpoint(path: str | Path) -> tuple[Path, list[str]]:
    """Resolve --resume to a checkpoint folder: a run folder gives its newest checkpoint that verifies
    (with one warning per newer damaged one skipped); a checkpoint folder must verify itself."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"--resume {str(path)!r}: no such folder; pass a run folder or one of its "
                              f"checkpoints/step_* folders")
    if step_of(path) is None and is_run_folder(path):
        entries = [e for e in list_checkpoints(path) if not e.path.name.endswith(".partial")]
        if not entries:
            raise CheckpointError(f"--resume {str(path)!r}: the run folder has no complete checkpoint yet (it "
                                  f"stopped before its first save; checkpoints are saved every --checkpoint-every "
                                  f"steps, at the end and when interrupted); start it again without --resume")
        warnings = []
        for entry in reversed(entries):
            if entry.problem is None:
                return entry.path, warnings
            warnings.append(f"checkpoint {entry.path.name} is damaged ({entry.problem}); falling back to an "
                            f"earlier one")
        raise CheckpointError(f"--resume {str(path)!r}: no checkpoint of the run folder is usable: "
                              + "; ".join(f"{e.path.name}: {e.problem}" for e in entries))
    if path.name.endswith(".partial"):
        raise CheckpointError(f"--resume {str(path)!r}: this checkpoint was never completed (a save was "
                              f"interrupted); resume from the run folder to use the latest complete one")
    problem = verify(path)
    if problem is not None and problem.startswith("missing") and not (path / MANIFEST).is_file():
        raise CheckpointError(f"--resume {str(path)!r}: not a complete autopar checkpoint ({problem}); pass a "
                              f"run folder or a checkpoints/step_* folder")
    if problem is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded: {problem}; is it corrupt? Resume from "
                              f"its run folder to fall back to the newest checkpoint that verifies")
    return path, []


def prune(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` usable checkpoints (and interrupted saves older than them)."""
    entries = list_checkpoints(run_dir)
    usable = [e for e in entries if e.problem is None]
    if keep <= 0 or len(usable) <= keep:
        return []
    oldest_kept = usable[-keep].step
    removed = [e.path for e in entries if e.step < oldest_kept]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def describe(run_dir: Path) -> str:
    """The `autopar checkpoints RUN_DIR` listing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{str(run_dir)!r} is not a folder; pass a run folder (runs/<timestamp>/)")
    entries = list_checkpoints(run_dir)
    if not entries:
        return f"{run_dir}: no checkpoints (the run stopped before its first save, or saved none)"
    latest_file = run_dir / "checkpoints" / LATEST
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    resume = next((e for e in reversed(entries) if e.problem is None), None)
    lines = [f"{'checkpoint':22s} {'step':>8s} {'MiB':>9s}  state"]
    for e in entries:
        size = sum(p.stat().st_size for p in e.path.rglob("*") if p.is_file()) / 2**20
        marks = [m for m, on in (("latest", e.path.name == latest), ("--resume uses this", e is resume)) if on]
        lines.append(f"{e.path.name:22s} {e.step:8d} {size:9.2f}  {e.state}"
                     + (f"  [{', '.join(marks)}]" if marks else ""))
    return "\n".join(lines)
