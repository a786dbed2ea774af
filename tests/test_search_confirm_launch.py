"""Measured when unsure, in one launch: the ranks build the job once and step every plan (confirm_ranks.py),
interleaved or one after another. On two pooled gloo ranks, gpt-tiny, two plans of two steps each."""

from __future__ import annotations

import json


def _measure(spec: dict) -> list[dict]:
    import os
    from autopar.confirm_ranks import measure
    fault = spec.pop("fault", None)
    if fault:  # as a test of the training run would set it: the measuring launch must not meet it
        os.environ["AUTOPAR_FAULT"] = fault
    try:
        return measure(spec)
    finally:
        os.environ.pop("AUTOPAR_FAULT", None)


def _plan(tmp_path, name: str, zero: int) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"nproc": 2, "strategy": {"dp": 2, "tp": 1, "pp": 1, "zero": zero},
                                "train": {"global_batch_size": 8, "micro_batch_size": 4}}))
    return str(path)


def test_plans_measured_in_one_launch_together_and_in_turn(rank_pool, tmp_path):
    argv = ["train", "--model", "gpt-tiny", "--seq-len", "32", "--global-batch-size", "8", "--strategy", "auto",
            "--cluster", "cpu-local"]
    plans = [_plan(tmp_path, "replicated", 0), _plan(tmp_path, "sharded", 1)]
    for together in (True, False):
        spec = {"argv": argv, "plans": plans if together else plans[:1], "steps": 2, "together": together,
                "folder": str(tmp_path / f"runs-{together}"),
                "fault": "raise-collective:rank=1:step=2" if together else None}  # AUTOPAR_FAULT set around it
        per_rank = rank_pool(2).run(_measure, spec)
        assert per_rank[0] == per_rank[1]  # every rank agrees: the slowest rank's time, the largest peak
        for record in per_rank[0]:
            assert "error" not in record, record
            assert len(record["step_times_s"]) == 1 and record["step_times_s"][0] > 0  # the first step untimed
            assert record["peak_mem_bytes"] > 0
        assert len(per_rank[0]) == len(spec["plans"])
