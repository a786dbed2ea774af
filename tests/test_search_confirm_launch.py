"""Measured when unsure, in one launch: the ranks build the job once and measure every plan in rounds, one plan's
Trainer alive at a time (confirm_ranks.py). On two pooled gloo ranks, gpt-tiny, two plans, two rounds of two steps."""

from __future__ import annotations

import json


def _measure(spec: dict) -> tuple[list[dict], int, int]:
    import os
    from autopar.confirm_ranks import measure
    from autopar.distributed import process_groups
    fault = spec.pop("fault", None)
    if fault:  # as a test of the training run would set it: the measuring launch must not meet it
        os.environ["AUTOPAR_FAULT"] = fault
    try:
        before = len(process_groups())
        records = measure(spec)
        return records, before, len(process_groups())
    finally:
        os.environ.pop("AUTOPAR_FAULT", None)


def _plan(tmp_path, name: str, zero: int) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"nproc": 2, "strategy": {"dp": 2, "tp": 1, "pp": 1, "zero": zero},
                                "train": {"global_batch_size": 8, "micro_batch_size": 4}}))
    return str(path)


def test_plans_measured_in_rounds_one_alive_at_a_time(rank_pool, tmp_path):
    argv = ["train", "--model", "gpt-tiny", "--seq-len", "32", "--global-batch-size", "8", "--strategy", "auto",
            "--cluster", "cpu-local"]
    plans = [_plan(tmp_path, "replicated", 0), _plan(tmp_path, "sharded", 1)]
    spec = {"argv": argv, "plans": plans, "steps": 2, "rounds": 2, "folder": str(tmp_path / "runs"),
            "fault": "raise-collective:rank=1:step=2"}  # AUTOPAR_FAULT set around it
    per_rank = rank_pool(2).run(_measure, spec)
    records = [records for records, _, _ in per_rank]
    assert records[0] == records[1]  # every rank agrees: the slowest rank's time, the largest peak
    assert len(records[0]) == len(plans)
    for record in records[0]:
        assert "error" not in record, record
        assert len(record["step_times_s"]) == 2 and min(record["step_times_s"]) > 0  # each round's first untimed
        assert record["peak_mem_bytes"] > 0
    # while a plan is timed, only its own groups are alive (the other plan's were destroyed), and none is left after
    replicated, sharded = records[0]
    assert replicated["groups_alive"] == sharded["groups_alive"] > 0
    for _, before, after in per_rank:
        assert after == before
