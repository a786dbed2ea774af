"""`--strategy auto` and `--plan`: the searched strategy trains like one process, a plan reruns the
same strategy, and plans or searches that cannot work are refused before training, naming the values."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import autopar
from autopar.config import Strategy, TrainConfig
from autopar.data.tokenizer import padded_vocab_size
from autopar.errors import ConfigError
from autopar.models import build_model
from autopar.search.auto import Plan
from autopar.strategies import resolve
from helpers import max_relative_difference, small_data, train_builtin

STEPS = 3
SETTINGS = dict(model_args={"n_layer": 2}, steps=STEPS, global_batch_size=8)


def tiny_model(n_layer: int = 2):
    model, info = build_model("gpt-tiny", {"n_layer": n_layer}, vocab_size=padded_vocab_size(258), device="meta")
    return model, (lambda: ((torch.zeros(1, 32, dtype=torch.long, device="meta"),), {}))


@pytest.fixture(scope="module")
def auto_run(rank_pool, tmp_path_factory):
    """One 4-rank run with pp fixed at 2 and everything else searched, and the one-process reference."""
    out = tmp_path_factory.mktemp("auto")
    reference = rank_pool(1).run(train_builtin, "gpt-tiny", str(tmp_path_factory.mktemp("one")), **SETTINGS)[0]
    results = rank_pool(4).run(train_builtin, "gpt-tiny", str(out), strategy={"search": "auto", "pp": 2}, **SETTINGS)
    return out, reference, results


def test_auto_with_fixed_pp_trains_like_one_process(auto_run):
    out, reference, results = auto_run
    for rank, got in enumerate(results):
        assert max_relative_difference(reference["losses"], got["losses"]) < 1e-5, (rank, got["losses"])
        assert abs(reference["eval_loss"] - got["eval_loss"]) / reference["eval_loss"] < 1e-5, rank
    plan = json.loads((out / "plan.json").read_text())
    assert plan["strategy"]["pp"] == 2  # fixed by the user; the rest was searched
    assert plan["strategy"]["dp"] * plan["strategy"]["tp"] * 2 == 4
    assert plan["search"]["fixed"]["pp"] == 2 and plan["search"]["evaluated"] >= 1
    # the layout the same settings run without the search (dp=2 pp=2, micro-batches of 2) is scored beside the pick
    default = plan["default_layout"]
    assert default["strategy"]["dp"] == default["strategy"]["pp"] == 2 and default["train"]["micro_batch_size"] == 2
    assert default["prediction"]["step_time_s"] > 0 and plan["decision"]["runs"] in ("search", "default")
    assert plan["decision"]["default_step_time_s"] == default["prediction"]["step_time_s"]
    assert 0 < plan["decision"]["model_error"] < 1
    measured = plan["measured"]
    assert len(measured["step_times_s"]) == STEPS and measured["median_step_time_s"] > 0
    assert len(measured["peak_memory_bytes_per_rank"]) == 4 and min(measured["peak_memory_bytes_per_rank"]) > 0
    assert len(measured["peak_memory_bytes_per_pipeline_rank"]) == 2
    assert len(plan["prediction"]["peak_memory_bytes_per_rank"]) == 2  # predicted per pipeline rank, beside it
    # like with like: live tensor bytes counted during step 2 (left out of the median) against the tensors predicted;
    # the process's resident set (Python, torch, gloo) stays a separate figure
    assert measured["median_over"] == "steps after the first, but the one counted for tensor memory"
    assert measured["median_step_time_s"] == measured["step_times_s"][2]
    tensors, rss = measured["peak_tensor_bytes_per_pipeline_rank"], measured["peak_memory_bytes_per_pipeline_rank"]
    for counted, predicted, whole in zip(tensors, plan["prediction"]["peak_memory_bytes_per_rank"], rss):
        assert 0.5 < counted / predicted < 2 and whole > 10 * counted, (counted, predicted, whole)
    line = Plan(plan).measured_vs_predicted()
    assert re.search(r"; peak live tensors [\d.]+ MiB/rank against [\d.]+ MiB predicted \([+-]\d+%\); whole process "
                     r"[\d.]+ MiB/rank \(RSS\)", line), line
    config = (out / "config.toml").read_text()  # what ran, concretely: rerunnable without the search
    assert 'search = "manual"' in config and "pp = 2" in config


def test_plan_round_trip_reproduces_the_strategy(auto_run):
    out, _, _ = auto_run
    plan = Plan.load(out / "plan.json")
    model, example = tiny_model()
    again = resolve(Strategy(plan=str(out / "plan.json")), TrainConfig(global_batch_size=8), 4, model=model,
                    example=example)
    recorded = json.loads((out / "run.json").read_text())["strategy"]
    for key, value in plan.record["strategy"].items():
        assert again.strategy.flat()[key] == value == recorded[key], key
    assert again.config.micro_batch_size == plan.train["micro_batch_size"]
    assert again.strategy.planning.mode == "manual" and again.strategy.planning.plan is None
    # a flag that agrees with the plan is fine; one that contradicts it is refused, naming both values
    resolve(Strategy(plan=str(out / "plan.json"), pp=2), TrainConfig(steps=7), 4)
    with pytest.raises(ConfigError, match=r"--pp 4 contradicts .*pp = 2"):
        resolve(Strategy(plan=str(out / "plan.json"), pp=4), TrainConfig(), 4)


def test_plan_for_another_nproc_or_model_is_refused(auto_run):
    out, _, _ = auto_run
    path = str(out / "plan.json")
    with pytest.raises(ConfigError, match=r"made for 4 processes, this run has 2"):
        resolve(Strategy(plan=path), TrainConfig(), 2)
    bigger, example = tiny_model(n_layer=3)
    with pytest.raises(ConfigError, match=r"made for \w+ \([\d,]+ parameters\), this run trains .* with [\d,]+ "):
        resolve(Strategy(plan=path), TrainConfig(), 4, model=bigger, example=example)


def test_impossible_memory_names_the_smallest_that_works():
    model, example = tiny_model()
    with pytest.raises(ConfigError, match=r"fits no configuration .* smallest memory per device that works is "
                                          r"[\d.e-]+ GiB"):
        resolve(Strategy.auto(memory_per_device_gb=1e-4), TrainConfig(global_batch_size=8), 4, model=model,
                example=example)


def test_auto_refuses_what_it_cannot_search_and_bad_clusters(tmp_path):
    model, example = tiny_model()
    with pytest.raises(ConfigError, match=r"--dp-mode gossip is outside it"):
        resolve(Strategy.auto(dp_mode="gossip"), TrainConfig(global_batch_size=8), 4, model=model, example=example)
    with pytest.raises(ConfigError, match=r"cluster file 'a100-81gb' does not exist; give a file or a preset"):
        resolve(Strategy.auto(cluster="a100-81gb"), TrainConfig(global_batch_size=8), 4, model=model, example=example)
    bad = tmp_path / "cluster.toml"
    bad.write_text('name = "half"\n')
    with pytest.raises(ConfigError, match=r"cluster file: missing field"):
        resolve(Strategy.auto(cluster=str(bad)), TrainConfig(global_batch_size=8), 4, model=model, example=example)
    with pytest.raises(ConfigError, match=r"degrees fixed multiply to 3, which does not divide the 4 processes"):
        resolve(Strategy.auto(pp=3), TrainConfig(global_batch_size=8), 4, model=model, example=example)
    with pytest.raises(ConfigError, match=r"needs the model"):
        resolve(Strategy.auto(), TrainConfig(), 4)


def test_plan_auto_api_fixes_tp_and_returns_a_plan():
    model, _ = tiny_model()
    train_data, _ = small_data("causal-lm", 32)
    plan = autopar.plan_auto(model, train_data, 4, strategy=Strategy.auto(tp=2),
                             config=TrainConfig(global_batch_size=8))
    assert plan.strategy.tp == 2 and plan.strategy.dp * plan.strategy.pp == 2
    assert str(plan).startswith("auto: picked dp=") and "ms/step" in str(plan) and "MiB/rank" in str(plan)


def test_cli_refuses_impossible_memory_before_any_rank_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "autopar", "train", "--strategy", "auto", "--model", "gpt-tiny",
                           "--nproc", "4", "--global-batch-size", "8", "--seq-len", "32",
                           "--memory-per-device-gb", "0.0001", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr
    assert "smallest memory per device that works is" in done.stderr
    assert "rank" not in done.stderr.split("autopar: error")[1].split(":")[0]  # the launcher's process, not a rank
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("eager-1f1b", 1),
                                             ("zb-h1", 1)])
def test_compiled_schedule_equals_the_simulator(schedule, chunks):
    """The search's compiled sweep (timeline.CompiledSchedule) against simulate() on random stage costs and links."""
    import random

    from autopar.search.timeline import StageCosts, _simulate, simulated
    rng = random.Random(7)
    for pp, m, recompute in ((2, 4, False), (3, 6, True), (4, 8, False), (4, 12, True)):
        stages = pp * chunks
        draw = lambda: tuple(rng.uniform(0.1, 3.0) for _ in range(stages))  # noqa: E731
        link = lambda: tuple(rng.choice((0.0, rng.uniform(0.0, 1.0))) for _ in range(stages))  # noqa: E731
        costs = StageCosts(draw(), draw(), draw(), link(), link())
        rc = frozenset(range(stages)) if recompute else frozenset()
        want, got = simulated(schedule, pp, chunks, m, rc, costs), _simulate(schedule, pp, chunks, m, rc, costs, {})
        # the same maxima of the same sums, taken in another order: equal up to float rounding
        assert got.makespan == pytest.approx(want.makespan, rel=1e-12)
        assert got.finish == pytest.approx(want.finish, rel=1e-12) and got.busy == pytest.approx(want.busy, rel=1e-12)
        assert got.in_flight == want.in_flight and got.stashed == want.stashed


def test_auto_with_fixed_dp_searches_the_rest():
    model, example = tiny_model()
    resolved = resolve(Strategy.auto(dp=2), TrainConfig(global_batch_size=8), 4, model=model, example=example)
    assert resolved.strategy.dp == 2 and resolved.strategy.tp * resolved.strategy.pp == 2
    assert resolved.plan.record["search"]["fixed"] == {"dp": 2}
