"""The layer map of docs/architecture.md, enforced: import-linter's contracts in pyproject.toml.

Function-local imports count, so an upward import cannot hide inside a function.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    tool = Path(sys.executable).parent / "lint-imports"
    assert tool.exists(), f"{tool} is missing: install the test extras (pip install -e '.[test]')"
    return subprocess.run([str(tool), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], capture_output=True,
                          text=True, timeout=240, cwd=src.parent, env={**os.environ, "PYTHONPATH": str(src)})


def test_the_layer_contracts_hold():
    done = lint_imports(ROOT / "src")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout, done.stdout


def test_a_lower_package_importing_the_trainer_is_refused(tmp_path):
    """A copy of the package where train/loss.py reaches up to the trainer inside a function."""
    shutil.copytree(ROOT / "src" / "autopar", tmp_path / "src" / "autopar",
                    ignore=shutil.ignore_patterns("__pycache__"))
    loss = tmp_path / "src" / "autopar" / "train" / "loss.py"
    loss.write_text(loss.read_text() + "\n\ndef _upward():\n    from ..trainer import Trainer\n    return Trainer\n")
    done = lint_imports(tmp_path / "src")
    assert done.returncode != 0, done.stdout
    assert "BROKEN" in done.stdout and "autopar.train.loss -> autopar.trainer" in done.stdout, done.stdout
