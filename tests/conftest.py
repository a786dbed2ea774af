"""Shared fixtures: `rank_pool(n)` gives a pool of n gloo CPU ranks, started once per session."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so spawned ranks can import the test helpers

from rank_pool import STOP_GRACE_S, RankPool  # noqa: E402

# Searches without --cluster price on cpu-local in the tests, as before this machine was calibrated unasked:
# the same plans on every machine, and no measuring in tests that are not about it (test_search_calibration.py
# clears this). Set here, so the ranks and CLI subprocesses the tests start inherit it.
os.environ["AUTOPAR_CLUSTER"] = "cpu-local"
# Kernels --compile builds (inductor's C++) kept across test sessions, inside the checkout, never the user's cache:
# compiling gpt-tiny's blocks cold costs tens of seconds on a small CPU, reading them back a few.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".pytest_cache", "inductor"))


def _cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo, else platform's guess)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def pytest_sessionstart(session):
    """Name the machine once per run, even under -q: float results can depend on the CPU's vector width."""
    import torch
    line = (f"cpu: {_cpu_model()} ({os.cpu_count()} logical cores); torch {torch.__version__}, "
            f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def _calibration_cache(tmp_path_factory):
    """Never the user's cache folder: a calibration a test writes (autopar calibrate) goes to a temporary one."""
    os.environ["AUTOPAR_CACHE_DIR"] = str(tmp_path_factory.mktemp("autopar-cache"))


@pytest.fixture(scope="session")
def rank_pool():
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():  # all pools wind down at once: their workers' exits overlap
        pool.ask_to_stop()
    deadline = time.monotonic() + STOP_GRACE_S
    for pool in pools.values():
        pool.wait_stopped(deadline)
