"""Non-finite steps: each is skipped (no update); more than --max-bad-steps in a row stops the run.

Every rank sees the same summed loss and norm, so every rank counts alike and all stop together.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import TrainingError
from .deferred import Finished
from .run_folder import non_finite_message


class BadSteps:
    """Counts skipped steps (in a row, and in all) as their results arrive, in step order."""

    def __init__(self, max_in_a_row: int, run_dir: Path):
        self.max_in_a_row, self.run_dir = max_in_a_row, run_dir
        self.in_a_row = self.total = 0

    def count(self, finished: Finished) -> None:
        """Note `finished`; raises TrainingError when one more bad step in a row than allowed."""
        out = finished.result
        self.in_a_row = self.in_a_row + 1 if out.skipped else 0
        self.total += out.skipped
        if self.in_a_row > self.max_in_a_row:
            raise TrainingError(non_finite_message(out.loss, finished.number, finished.lr, out.grad_norm,
                                                   self.run_dir, self.in_a_row, self.max_in_a_row))
