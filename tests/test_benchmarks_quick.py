"""Every benchmark still runs: each script's `--quick` form, run as a user runs it, must exit 0.

Scripts are found by listing benchmarks/ (and benchmarks/pipeline/), so a new benchmark is covered
without being named here; a module that is not an entry point must be named in HELPERS, with why.
Each quick form runs in its own process, two at a time, in a scratch folder (its working directory
and TMPDIR), so nothing it writes lands in the tree. A failure names the script and shows the end of
its stderr. What the quick forms print is not checked beyond being there: they are smoke runs at
tiny sizes, their figures mean nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
HELPERS = {  # modules under benchmarks/ that are not entry points: why they are not run here
    "emulated_links.py": "network namespaces for resharding.py --emulate-links (needs root); its refusals are "
                         "tested in tests/test_resharding_plan.py",
    "subnormal_census.py": "loaded into each rank by async_pipeline.py --count-subnormals",
    "cpu_quota.py": "cgroup cpu quotas for heterogeneous.py's slow devices (needs root)",
    "strategy_search_ranks.py": "the ranks of strategy_search.py and strategy_user_jobs.py (their quick forms run it)",
    "pipeline/common.py": "a part of pipeline_schedules.py",
    "pipeline/memory.py": "a part of pipeline_schedules.py",
    "pipeline/ours_vs_torch.py": "a part of pipeline_schedules.py",
    "pipeline/recomputation.py": "a part of pipeline_schedules.py",
    "pipeline/simulator.py": "a part of pipeline_schedules.py",
    "pipeline/zero_bubble.py": "a part of pipeline_schedules.py",
}
QUICK_ARGS = {  # where `--quick` alone is not small: its documented validation run is 6 configurations at 4 and 8
    # ranks, calibrated first; the smoke narrows it to one model, 2 ranks, 2 configurations, the preset cluster
    "strategy_search.py": ["--quick", "--world", "2", "--models", "gpt-mini", "--configs", "2", "--repeats", "1",
                           "--cluster", "cpu-local"],
}
START_FIRST = ("async_pipeline.py", "pipeline_schedules.py", "strategy_search.py", "zero_memory.py")  # the longest
TIMEOUT_S = 240
GPU_SKIPPED = "the GPU measurements are skipped"


def scripts() -> list[str]:
    found = sorted(str(p.relative_to(BENCHMARKS)) for pattern in ("*.py", "pipeline/*.py")
                   for p in BENCHMARKS.glob(pattern))
    return [s for s in found if s not in HELPERS]


def run_quick(script: str, scratch: Path) -> subprocess.CompletedProcess:
    """The script's quick form in its own session (so a timeout stops its ranks too)."""
    env = {**os.environ, "TMPDIR": str(scratch),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    argv = [sys.executable, str(BENCHMARKS / script), *QUICK_ARGS.get(script, ["--quick"])]
    proc = subprocess.Popen(argv, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[killed: still running after {TIMEOUT_S} s]"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.fixture(scope="module")
def quick_runs(request, tmp_path_factory) -> dict[str, Future]:
    """Starts the quick forms of the selected scripts at once (two at a time, the longest first)."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_quick_form_runs" and hasattr(item, "callspec")]
    selected.sort(key=lambda s: START_FIRST.index(s) if s in START_FIRST else len(START_FIRST))
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {s: pool.submit(run_quick, s, tmp_path_factory.mktemp(Path(s).stem)) for s in selected}
    yield futures
    pool.shutdown(cancel_futures=True)


def test_every_script_is_an_entry_point_with_a_quick_form_or_a_named_helper():
    for script in scripts():
        text = (BENCHMARKS / script).read_text()
        assert '__name__ == "__main__"' in text, f"benchmarks/{script} is not an entry point: name it in HELPERS"
        assert "--quick" in text, f"benchmarks/{script} has no --quick form"
    for helper in HELPERS:
        assert (BENCHMARKS / helper).exists(), f"HELPERS names benchmarks/{helper}, which is gone"
        assert '__name__ == "__main__"' not in (BENCHMARKS / helper).read_text(), \
            f"benchmarks/{helper} is an entry point: take it out of HELPERS so that it runs here"


@pytest.mark.timeout(900)  # a run may queue behind others; each is stopped TIMEOUT_S after it starts
@pytest.mark.parametrize("script", scripts())
def test_quick_form_runs(script, quick_runs):
    done = quick_runs[script].result()
    command = " ".join(["python", f"benchmarks/{script}", *done.args[2:]])
    if done.returncode != 0:
        pytest.fail(f"`{command}` exited with {done.returncode}; its stderr ends:\n{done.stderr[-3000:]}\n"
                    f"its stdout ends:\n{done.stdout[-1000:]}", pytrace=False)
    assert done.stdout.strip(), f"`{command}` printed nothing"
    if script == "gpu_check.py" and not torch.cuda.is_available():
        assert GPU_SKIPPED in done.stdout, f"`{command}` did not say that it skipped the GPU measurements"
