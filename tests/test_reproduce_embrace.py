"""`autopar reproduce embrace` runs end to end (tiny sizes) and checks its own training parity."""

from __future__ import annotations

import json

import pytest

from autopar.reproduce import run_study


def test_study_prints_its_table_and_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "study"
    code = run_study("embrace", ["--worlds", "2", "--steps", "2", "--warmup", "1", "--vocab-size", "512",
                                 "--d-embed", "8", "--d-hidden", "8", "--seq-len", "8", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed  # non-zero when a variant's parameters left the dense run's
    for variant in ("dense", "allgather", "embrace", "embrace+2D"):
        assert f"    2 {variant} " in printed
    record = json.loads((out / "embrace.json").read_text())["records"][0]
    assert record["world"] == 2 and record["tables"][0]["sparse"]
    assert record["table_bytes_per_step"]["embrace"] < record["table_bytes_per_step"]["dense"]
    assert (out / "embrace.png").stat().st_size > 0


def test_study_rejects_bad_options():
    with pytest.raises(SystemExit):
        run_study("embrace", ["--worlds", "1"])
