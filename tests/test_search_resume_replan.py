"""`autopar train --resume RUN --nproc N` on a run whose own `--strategy auto` search chose its plan for another
process count searches again for N (the elastic agent's re-plan, for a restart by hand); no process starts."""

from __future__ import annotations

import json

import pytest

from autopar.cli import build_parser, resolve_job
from autopar.config import JobConfig, LaunchConfig, ModelConfig, Strategy, TrainConfig, to_toml


@pytest.fixture
def run(tmp_path):
    """A run folder as a 4-process `--strategy auto` run leaves it: the chosen layout in config.toml, its plan."""
    folder = tmp_path / "run"
    folder.mkdir()
    chosen = {"dp": 2, "tp": 1, "pp": 2, "schedule": "1f1b", "chunks": 1, "partition": "time", "recompute": "none",
              "zero": 1}
    train = {"global_batch_size": 16, "micro_batch_size": 8, "micro_batches": 1}
    job = JobConfig(model=ModelConfig(name="gpt-tiny"), strategy=Strategy(**chosen),
                    train=TrainConfig(**train, steps=5), launch=LaunchConfig(nproc=4))
    (folder / "config.toml").write_text(to_toml(job))
    (folder / "run.json").write_text("{}")
    (folder / "plan.json").write_text(json.dumps({"nproc": 4, "strategy": chosen, "train": train,
                                                  "chosen_by": "--strategy auto"}))
    return folder


def _job(run, *flags):
    return resolve_job(build_parser().parse_args(["train", "--resume", str(run), *flags]))


def test_another_process_count_searches_again(run):
    job = _job(run, "--nproc", "2")
    assert job.strategy.planning.mode == "auto" and not job.strategy.planning.plan
    assert (job.strategy.pp, job.strategy.replicas.zero, job.strategy.pipeline.partition) == (1, 0, Strategy().pipeline.partition)  # defaults
    assert job.train.micro_batch_size == TrainConfig().micro_batch_size and job.train.global_batch_size == 16
    assert job.train.out == str(run) and job.train.steps == 5  # the run's own folder and settings


@pytest.mark.parametrize("flags", [("--nproc", "4"), ("--nproc", "2", "--pp", "2"), ("--nproc", "2", "--dp", "2")])
def test_the_same_count_or_a_layout_given_keeps_the_run_as_it_was(run, flags):
    job = _job(run, *flags)
    assert job.strategy.planning.mode == "manual" and job.strategy.pp == 2 and job.strategy.replicas.zero == 1


def test_a_plan_given_by_file_is_not_replaced(run):
    record = json.loads((run / "plan.json").read_text())
    del record["chosen_by"]  # `--plan FILE` wrote it: the user's choice
    (run / "plan.json").write_text(json.dumps(record))
    job = _job(run, "--nproc", "2")
    assert job.strategy.planning.mode == "manual" and job.strategy.pp == 2


def test_the_ranks_take_the_new_plan_over_the_runs_old_layout(run, tmp_path):
    """The CLI hands the ranks `--plan RUN/plan.json` (now for 2 processes): the layout config.toml holds from
    the 4-process plan yields to it instead of contradicting it."""
    from autopar.search.auto import Plan
    new = tmp_path / "new-plan.json"
    new.write_text(json.dumps({"nproc": 2, "strategy": {"dp": 2, "tp": 1, "pp": 1, "zero": 0},
                               "train": {"global_batch_size": 16, "micro_batch_size": 8}}))
    job = _job(run, "--nproc", "2", "--plan", str(new))
    assert job.strategy.pp == 1 and job.strategy.replicas.zero == 0
    Plan.load(new).apply(job.strategy, job.train)  # nothing the run had set contradicts the plan


def test_the_fields_fixed_beside_auto_stay_fixed_on_the_new_count(run):
    """The run's first command was `--pp 2 --zero 1 --dp 2 --micro-batch-size 8 --strategy auto` (plan.json's
    search.fixed): pp, zero and the micro-batch size stay fixed for the new count; dp is the new count's rest."""
    record = json.loads((run / "plan.json").read_text())
    record["search"] = {"fixed": {"pp": 2, "zero": 1, "dp": 2, "micro_batch_size": 8}}
    (run / "plan.json").write_text(json.dumps(record))
    job = _job(run, "--nproc", "2")
    assert job.strategy.planning.mode == "auto" and not job.strategy.planning.plan
    assert (job.strategy.pp, job.strategy.replicas.zero, job.train.micro_batch_size) == (2, 1, 8)
    assert job.strategy.dp is None and job.strategy.pipeline.partition == Strategy().pipeline.partition
    from autopar.search.auto import fixed_fields
    assert fixed_fields(job.strategy, job.train) == {"pp": 2, "zero": 1, "micro_batch_size": 8}  # what the new search keeps
