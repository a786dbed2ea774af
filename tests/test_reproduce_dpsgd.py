"""`autopar reproduce dpsgd`: the analysis helpers, bad input, and a tiny end-to-end run."""

from __future__ import annotations

import json

import pytest

from autopar.errors import ConfigError
from autopar.reproduce import dpsgd


def test_running_mean_and_time_to_target():
    assert dpsgd.running_mean([4, 2, 0, 2], 2) == [4, 3, 1, 1]
    records = [{"workers": 2, "setting": "s", "method": m, "losses": losses, "step_end_s": times}
               for m, losses, times in [("allreduce", [3.0, 2.0, 1.0, 1.0], [1, 2, 3, 4]),
                                        ("gossip", [3.0, 1.0, 1.0, 1.2], [0.5, 1, 1.5, 2])]]
    dpsgd.add_time_to_target(records, window=1)
    assert records[0]["target_loss"] == pytest.approx(1.2 * 1.02)  # the worst final value, +2%
    assert records[0]["time_to_target_s"] == 3 and records[1]["time_to_target_s"] == 1
    assert records[1]["speedup_vs_allreduce"] == pytest.approx(3.0)


def test_settings_and_bad_input():
    assert dpsgd.parse_setting("5:inf")[1:] == (0.005, float("inf"))
    assert dpsgd.parse_setting("0.1:10")[1:] == (0.0001, 1e7)
    for bad in ("slow", "5", "-1:10"):
        with pytest.raises(ConfigError, match="network setting"):
            dpsgd.parse_setting(bad)
    with pytest.raises(ConfigError, match="not divisible"):
        dpsgd.main(["--workers", "3", "--global-batch", "64"])
    with pytest.raises(ConfigError, match="unknown method"):
        dpsgd.main(["--methods", "allreduce", "carrier-pigeon"])


def test_tiny_study_end_to_end(tmp_path):
    out = tmp_path / "study"
    assert dpsgd.main(["--workers", "2", "--epochs", "2", "--samples", "64", "--global-batch", "16",
                       "--settings", "fast", "2:inf", "--out", str(out), "--timeout-s", "120"]) == 0
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    assert {(r["setting"], r["method"]) for r in runs} == {(s, m) for s in ("fast", "2:inf")
                                                           for m in ("allreduce", "gossip", "gossip-atc", "ps")}
    for r in runs:
        assert len(r["losses"]) == 8 and len(r["epoch_loss"]) == 2
        assert r["time_to_target_s"] > 0 and r["bytes_sent"] > 0
    delayed = {r["method"]: r for r in runs if r["setting"] == "2:inf"}
    # the injected latency is paid: all-reduce over 2 workers waits 2 messages of 2 ms per step
    assert delayed["allreduce"]["wall_s"] >= 8 * 2 * 0.002
    # all-reduce and gossip on 2 workers (ring of 2: W = 1/2 everywhere) see the same first loss
    assert delayed["allreduce"]["losses"][0] == pytest.approx(delayed["gossip"]["losses"][0], rel=1e-6)
    assert (out / "dpsgd.png").stat().st_size > 1000 and (out / "table.md").read_text().count("\n") == 10
