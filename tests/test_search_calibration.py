"""The search's calibration without being asked: this machine measured once per (machine, torch version, process
count, format), cached, reused, measured again when any of those change or the entry is damaged; an explicit
cluster wins; the banner says which calibration priced the plan and how old it is. The measuring itself is
replaced by a counter here (a real measurement: test_search.py's gloo-link test and the calibrate test below)."""

from __future__ import annotations

import argparse
import json
import time

import pytest
import torch

from autopar.config import Strategy, TrainConfig
from autopar.data.tokenizer import padded_vocab_size
from autopar.models import build_model
from autopar.search import calibration_cache
from autopar.search.auto import Plan
from autopar.search.calibration_cache import entry_path, note, search_cluster
from autopar.search.cluster import cluster_from_dict, preset
from autopar.strategies import resolve


def measured_cluster(nproc: int, when: float | None = None):
    """What a calibration returns, with figures unlike cpu-local's (so a test can tell which priced a plan)."""
    return preset("cpu-local").replace(name="calibrated", source=f"test figures for {nproc} ranks", num_devices=nproc,
                                       devices_per_node=nproc, cores_per_node=1.5, memory_per_device_gb=3.0,
                                       measured_at=time.time() if when is None else when)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder, no default cluster from the environment, and the measurement counted, not run."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOPAR_CLUSTER", raising=False)
    calls = []

    def measure(nproc, details=None):
        calls.append(nproc)
        return measured_cluster(nproc)

    monkeypatch.setattr(calibration_cache, "measure", measure)
    return calls


def test_measured_once_then_reused(cache):
    cluster, record = search_cluster(None, nproc=4)
    assert cache == [4] and cluster.name == "calibrated" and cluster.cores_per_node == 1.5
    assert record["cache"] == str(entry_path(4)) and entry_path(4).exists()
    again, record_again = search_cluster(None, nproc=4)
    assert cache == [4], "a second search measured again instead of reading the cache"
    assert again == cluster and record_again == record
    sized, _ = search_cluster(None, nproc=4, memory_per_device_gb=2.0)  # the memory asked still applies
    assert sized.memory_per_device_gb == 2.0 and cache == [4]


@pytest.mark.parametrize("change", ["torch", "nproc", "host", "cpus", "format"])
def test_a_changed_key_measures_again(cache, monkeypatch, change):
    search_cluster(None, nproc=4)
    nproc = 4
    if change == "torch":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    elif change == "nproc":
        nproc = 2
    elif change == "host":
        monkeypatch.setattr(calibration_cache.socket, "gethostname", lambda: "another-host")
    elif change == "cpus":
        monkeypatch.setattr(calibration_cache, "_cpus", lambda: 97)
    else:
        monkeypatch.setattr(calibration_cache, "FORMAT", calibration_cache.FORMAT + 1)
    cluster, record = search_cluster(None, nproc=nproc)
    assert cache == [4, nproc], f"a changed {change} reused the old entry"
    assert cluster.num_devices == nproc and record["cache"] == str(entry_path(nproc))
    search_cluster(None, nproc=nproc)
    assert len(cache) == 2  # and the new entry is reused in turn


def test_an_entry_measured_before_zero_collectives_is_measured_again(cache, monkeypatch):
    """Entries of format 1 have no reduce-scatter and all-gather figures (the ZeRO levels would be priced by the
    ring rule): the current format measures them again."""
    current = calibration_cache.FORMAT
    monkeypatch.setattr(calibration_cache, "FORMAT", 1)
    search_cluster(None, nproc=4)
    monkeypatch.setattr(calibration_cache, "FORMAT", current)
    search_cluster(None, nproc=4)
    assert cache == [4, 4], "an entry without the ZeRO collectives' figures was reused"


@pytest.mark.parametrize("damage", ["not json", "{}", "wrong key", "bad cluster"])
def test_a_damaged_entry_is_measured_again_with_a_warning(cache, capsys, damage):
    search_cluster(None, nproc=4)
    path = entry_path(4)
    entry = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{ half a fil")
    elif damage == "{}":
        path.write_text("{}")
    elif damage == "wrong key":
        path.write_text(json.dumps({**entry, "key": {**entry["key"], "torch": "0.1"}}))
    else:
        path.write_text(json.dumps({**entry, "cluster": {**entry["cluster"], "num_devices": -1}}))
    cluster, record = search_cluster(None, nproc=4)
    assert cache == [4, 4] and cluster.name == "calibrated"
    warning = capsys.readouterr().err
    assert f"calibration cache {path} cannot be used" in warning and "measuring again" in warning
    assert json.loads(path.read_text())["key"] == entry["key"]  # rewritten whole
    search_cluster(None, nproc=4)
    assert cache == [4, 4]


def test_an_explicit_cluster_wins_and_nothing_is_measured(cache, tmp_path, monkeypatch):
    cluster, record = search_cluster("cpu-local", nproc=4)
    assert cluster.name == "cpu-local" and record == {"cluster": "cpu-local", "preset": True, "given_by": "--cluster"}
    assert note(record) == "preset cpu-local (not measured)"
    gpu, record = search_cluster("a100-80gb", nproc=16)
    assert gpu.name == "a100-80gb" and note(record) == "preset a100-80gb (datasheet figures)"
    file = tmp_path / "c.toml"  # a file `autopar calibrate --out` wrote two hours ago
    file.write_text(measured_cluster(4, when=time.time() - 7200).to_toml())
    _, record = search_cluster(str(file), nproc=4)
    assert note(record) == f"calibrated 2 h ago (file: {file})"
    monkeypatch.setenv("AUTOPAR_CLUSTER", "cpu-local")  # the environment's default stands for --cluster
    _, record = search_cluster(None, nproc=4)
    assert note(record) == "preset cpu-local (not measured), from $AUTOPAR_CLUSTER"
    assert cache == [] and not entry_path(4).exists()


def test_not_measured_where_measuring_is_wrong(cache, monkeypatch, capsys):
    for nproc, why in ((1, "one process has no links"), (2 * calibration_cache.max_ranks(), "more than this machine")):
        cluster, record = search_cluster(None, nproc=nproc)
        assert cluster.name == "cpu-local" and why in record["not_measured"]
        assert note(record).startswith("preset cpu-local (not measured: ")
    monkeypatch.setattr(calibration_cache, "_inside_ranks", lambda: True)
    _, record = search_cluster(None, nproc=4)
    assert "inside the ranks" in record["not_measured"]
    assert cache == []
    monkeypatch.setattr(calibration_cache, "_inside_ranks", lambda: False)

    def failing(nproc, details=None):
        from autopar.errors import DistributedError
        raise DistributedError("the ranks could not start")
    monkeypatch.setattr(calibration_cache, "measure", failing)
    cluster, record = search_cluster(None, nproc=4)
    assert cluster.name == "cpu-local" and "the ranks could not start" in record["not_measured"]
    assert "calibrating this machine failed" in capsys.readouterr().err and not entry_path(4).exists()


def test_banner_names_the_calibration_and_its_age(cache):
    """plan_auto prices on the cached calibration and the plan's banner says so, with the entry's age."""
    model, _ = build_model("gpt-tiny", {"n_layer": 2}, vocab_size=padded_vocab_size(258), device="meta")
    example = lambda: ((torch.zeros(1, 32, dtype=torch.long, device="meta"),), {})  # noqa: E731
    calibration_cache.store(measured_cluster(4, when=time.time() - 180), 4)
    plan = resolve(Strategy.auto(dp=4), TrainConfig(global_batch_size=8), 4, model=model, example=example).plan
    assert cache == [], "the cached entry was not used"
    record = plan.record["search"]["calibration"]
    assert record["cache"] == str(entry_path(4)) and plan.record["cluster"] == "calibrated"
    assert f"priced on calibrated on this machine 3 min ago (cache: {entry_path(4)})" in plan.describe()
    again = Plan.from_record(json.loads(plan.to_json()))  # a saved plan keeps saying it, older
    assert "calibrated on this machine" in again.describe()
    assert note(record, now=record["measured_at"] + 3 * 86400).startswith("calibrated on this machine 3 days ago")
    plan.record["search"]["calibration"] = search_cluster("cpu-local", nproc=4)[1]  # what --cluster cpu-local records
    assert "priced on preset cpu-local (not measured)" in plan.describe()


def test_calibrate_command_rewrites_the_cache_entry(cache, tmp_path, monkeypatch, capsys):
    from autopar.search import calibrate
    old = measured_cluster(4, when=time.time() - 86400)
    calibration_cache.store(old, 4)
    monkeypatch.setattr(calibrate, "calibrate",
                        lambda nproc, details=None, per_rank=False: measured_cluster(nproc).replace(cores_per_node=1.25))
    out = tmp_path / "c.toml"
    assert calibrate.cmd_calibrate(argparse.Namespace(nproc=4, out=str(out))) == 0
    assert str(entry_path(4)) in capsys.readouterr().out
    cluster, record = search_cluster(None, nproc=4)
    assert cluster.cores_per_node == 1.25 and note(record).startswith("calibrated on this machine just now")
    assert cache == []
    assert cluster_from_dict(__import__("tomllib").loads(out.read_text())).measured_at == cluster.measured_at


def test_more_ranks_than_measured_unasked_use_an_entry_calibrate_wrote(cache):
    many = 2 * calibration_cache.max_ranks()
    calibration_cache.store(measured_cluster(many), many)
    cluster, record = search_cluster(None, nproc=many)
    assert cluster.name == "calibrated" and record["cache"] == str(entry_path(many)) and cache == []


def test_an_unwritable_cache_still_prices_on_the_measurement(cache, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(blocker / "cache"))  # under a file: no folder can be made
    cluster, record = search_cluster(None, nproc=4)
    assert cache == [4] and cluster.name == "calibrated" and record["cache"] == "not written"
    assert "cannot write the calibration cache" in capsys.readouterr().err


def test_two_searches_at_once_measure_once(cache, monkeypatch):
    import threading
    started = threading.Event()

    def slow(nproc, details=None):
        started.set()
        time.sleep(0.5)
        cache.append(nproc)
        return measured_cluster(nproc)
    monkeypatch.setattr(calibration_cache, "measure", slow)
    first = threading.Thread(target=search_cluster, args=(None,), kwargs={"nproc": 4})
    first.start()
    started.wait(5)
    cluster, record = search_cluster(None, nproc=4)  # waits for the first, then reads its entry
    first.join()
    assert cache == [4] and record["cache"] == str(entry_path(4))


def test_plan_auto_command_prints_the_calibration(cache, capsys):
    from autopar.cli import build_parser, cmd_plan
    ns = build_parser().parse_args(["plan", "--auto", "--model", "gpt-tiny", "--model-arg", "n_layer=2", "--nproc",
                                    "2", "--global-batch-size", "4", "--seq-len", "16", "--cost-model", "flops",
                                    "--top", "1"])
    assert cmd_plan(ns) == 0
    out = capsys.readouterr().out
    assert f"calibration: calibrated on this machine just now (cache: {entry_path(2)})" in out and cache == [2]
    ns.cluster = "cpu-local"
    assert cmd_plan(ns) == 0
    assert "calibration: preset cpu-local (not measured)" in capsys.readouterr().out and cache == [2]


def test_a_calibration_taken_while_busy_says_so(cache, monkeypatch):
    monkeypatch.setattr(calibration_cache, "_cpus", lambda: 2)
    monkeypatch.setattr(calibration_cache, "_load", lambda: 7.5)  # other jobs held the cores
    _, record = search_cluster(None, nproc=4)
    assert note(record).endswith("while busy (load 7.5 on 2 cores; `autopar calibrate --nproc 4` measures again)")
    _, again = search_cluster(None, nproc=4)  # read back from the entry
    assert again == record and cache == [4]
    monkeypatch.setattr(calibration_cache, "_load", lambda: 1.0)
    entry_path(4).unlink()
    _, quiet = search_cluster(None, nproc=4)
    assert "busy" not in quiet and "while busy" not in note(quiet)


def test_the_measurement_covers_the_groups_the_search_forms(monkeypatch):
    """dp, tp and pp groups (divisors of nproc) and a tied weight's pair; not the sizes no layout forms."""
    from autopar.search import calibrate
    seen = []
    monkeypatch.setattr(calibrate, "calibrate",
                        lambda nproc, group_sizes=None, details=None, per_rank=False: seen.append(group_sizes))
    for nproc in (8, 6, 3):
        calibration_cache.measure(nproc)
    assert seen == [[2, 4, 8], [2, 3, 6], [2, 3]]


def test_a_calibration_under_load_is_measured_again_once_quiet(cache, monkeypatch):
    """What the calibration saw other jobs take (calibrate's details) marks the entry as measured under load: the
    banner says so, a still-loaded machine reuses it, a quiet one measures again and the banner says why."""
    def measure(nproc, details=None):
        cache.append(nproc)
        details["others_cores"] = 1.2 if len(cache) == 1 else 0.1
        return measured_cluster(nproc)
    monkeypatch.setattr(calibration_cache, "measure", measure)
    monkeypatch.setattr(calibration_cache, "_cpus", lambda: 2)
    monkeypatch.setattr(calibration_cache, "_load", lambda: 6.0)
    _, record = search_cluster(None, nproc=4)
    assert "under load (other jobs held 1.2 of 2 cores; figures scaled to a quiet machine" in note(record)
    _, again = search_cluster(None, nproc=4)
    assert cache == [4] and again == record  # still loaded: the entry (scaled to a quiet machine) serves
    monkeypatch.setattr(calibration_cache, "_load", lambda: 0.5)
    _, quiet = search_cluster(None, nproc=4)
    assert cache == [4, 4] and "busy" not in quiet
    assert "re-measured: the cached calibration was measured under load (other jobs held 1.2 of 2 cores)" in \
        note(quiet)
    search_cluster(None, nproc=4)
    assert cache == [4, 4]  # the quiet entry is kept


def test_a_run_far_off_its_prediction_marks_the_entry_stale(cache, monkeypatch):
    """The run's measured step against the prediction: within STALE_ERROR the entry stays; beyond, the next
    search measures again and says why. Only the entry that priced the run is marked, and not by a run slower
    than predicted while other jobs load the machine (the figures are a quiet machine's)."""
    monkeypatch.setattr(calibration_cache, "_cpus", lambda: 2)
    monkeypatch.setattr(calibration_cache, "_load", lambda: 9.0)  # other jobs: 4 ranks + 2 cores < 9
    _, record = search_cluster(None, nproc=4)
    assert not calibration_cache.mark_stale(record, calibration_cache.STALE_ERROR - 0.01, 4)
    assert not calibration_cache.mark_stale({**record, "measured_at": 1.0}, -0.5, 4)  # an older entry's plan
    assert not calibration_cache.mark_stale(record, 0.8, 4)  # slower under load: not the figures' fault
    search_cluster(None, nproc=4)
    assert cache == [4]
    assert calibration_cache.mark_stale(record, -0.45, 4)
    _, again = search_cluster(None, nproc=4)
    assert cache == [4, 4] and "re-measured: the cached calibration" in note(again) and "-45% off" in note(again)
    search_cluster(None, nproc=4)
    assert cache == [4, 4]
