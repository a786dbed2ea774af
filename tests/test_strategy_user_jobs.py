"""benchmarks/strategy_user_jobs.py's verdicts: the ratios and thresholds it prints, from made-up measurements.

The measuring itself (a search, a launch per job) runs in its --quick form with the other benchmarks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "strategy_user_jobs.py"


def load():
    spec = importlib.util.spec_from_file_location("strategy_user_jobs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config(predicted_ms: float, measured_ms: float, predicted_mib: float, measured_mib: float, **tags) -> dict:
    mib = 2**20
    return {"strategy": {"dp": 2, "tp": 1, "pp": 1}, "predicted_s": predicted_ms / 1e3, "measured_s": measured_ms / 1e3,
            "predicted_bytes_per_pp_rank": [predicted_mib * mib], "measured_bytes_per_rank": [measured_mib * mib] * 2,
            "describe": "x", **tags}


def test_auto_is_judged_against_the_default_layout_and_the_measured_best():
    jobs = load()
    block = {"configs": [config(10, 10, 4, 4, auto=True), config(12, 12.5, 4, 4, default=True),
                         config(9, 9.6, 4, 4)]}
    verdict = jobs.judge(block)
    assert abs(verdict["auto_over_default"] - 10 / 12.5) < 1e-12
    assert abs(verdict["auto_over_best"] - 10 / 9.6) < 1e-12
    line, ok = jobs.summary_line([{"verdict": verdict}])
    assert ok and "NOT met" not in line and line.count(": met") == 4


def test_each_threshold_is_marked_not_met_on_its_own():
    jobs = load()
    slower_than_default = {"configs": [config(12.3, 12.3, 4, 4, auto=True), config(12, 12, 4, 4, default=True)]}
    off_the_best = {"configs": [config(10, 10, 4, 4, auto=True, default=True), config(9, 9, 4, 4)]}
    time_wrong = {"configs": [config(15, 10, 4, 4, auto=True, default=True)]}
    memory_wrong = {"configs": [config(10, 10, 5, 4, auto=True, default=True)]}
    for block, failing in ((slower_than_default, "auto/default"), (off_the_best, "auto/best"),
                           (time_wrong, "median time error"), (memory_wrong, "worst memory error")):
        line, ok = jobs.summary_line([{"verdict": jobs.judge(block)}])
        assert not ok
        marked = dict(part.rsplit(": ", 1) for part in line.split("; "))
        assert [text for text, mark in marked.items() if mark == "NOT met"] == \
            [text for text in marked if text.startswith(failing)], line


def test_a_job_where_auto_or_the_default_failed_is_not_met():
    jobs = load()
    failed = config(10, 10, 4, 4, default=True)
    del failed["measured_s"]
    block = {"configs": [config(10, 10, 4, 4, auto=True), failed]}
    line, ok = jobs.summary_line([{"verdict": jobs.judge(block)}])
    assert not ok and "failed to run on 1 of 1 jobs: NOT met" in line


def test_configurations_that_execute_alike_share_a_key():
    jobs = load()
    flat = {"dp": 4, "tp": 1, "pp": 1, "schedule": "1f1b", "chunks": 1, "partition": "time", "recompute": "none",
            "zero": 0}
    assert jobs.key_of(flat, 2) == jobs.key_of({**flat, "schedule": "gpipe", "partition": "uniform"}, 2)
    assert jobs.key_of(flat, 2) != jobs.key_of(flat, 1)
    piped = {**flat, "dp": 2, "pp": 2}
    assert jobs.key_of(piped, 2) != jobs.key_of({**piped, "schedule": "gpipe"}, 2)


def test_jobs_are_chosen_by_model_world_and_shape():
    jobs = load()
    assert jobs.selected("gpt-mini", "gpt-mini", 8, 32, 128)
    assert jobs.selected("hf:llama/8,gpt-mini/4/8x128", "gpt-mini", 4, 8, 128)
    assert not jobs.selected("hf:llama/8,gpt-mini/4/8x128", "gpt-mini", 4, 32, 128)
    assert jobs.selected("hf:llama/8", "hf:llama", 8, 32, 128) and not jobs.selected("hf:llama/8", "hf:llama", 4, 8, 128)
