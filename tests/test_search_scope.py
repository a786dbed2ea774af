"""What the search does not cover is refused beside --strategy auto, before it runs (rule search-scope)."""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import ConfigError
from autopar.strategies import resolve


@pytest.mark.parametrize("boundary", ["scatter_gather", "auto"])
def test_a_planned_boundary_transfer_is_outside_the_search(boundary):
    """The search prices direct transfers between stages; a plan run with another method was not what it scored."""
    with pytest.raises(ConfigError, match=rf"--boundary {boundary}.*use direct.*\(rule search-scope\)"):
        resolve(autopar.Strategy(search="auto", boundary=boundary), autopar.TrainConfig(global_batch_size=8), 4)
