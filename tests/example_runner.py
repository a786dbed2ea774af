"""Run an examples/ script's main() on a rank-pool worker: the workers import it from examples/ themselves
(a pool started before a test put examples/ on sys.path would not find it)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(module: str, argv: list[str]):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(module).main(argv)
