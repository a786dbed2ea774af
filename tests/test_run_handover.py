"""Handing a run on: its config.toml works from any directory and cannot be fooled into resuming another model,
exports never overwrite an earlier one, and any model exports as one plain state_dict."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
import torch

from autopar.cli import build_parser, cmd_export, resolve_job
from autopar.config import DataConfig, JobConfig, ModelConfig, Strategy, TrainConfig
from autopar.errors import ConfigError
from autopar.train.run_folder import config_toml

from helpers import train_builtin


def job_of(*flags: str) -> JobConfig:
    return resolve_job(build_parser().parse_args(["train", *flags]))


def fake_run(folder: Path, job: JobConfig) -> Path:
    """A run folder as training leaves it (config.toml holds the strategy the run resolved, as the Trainer writes
    it), as far as the command line reads it before any process starts."""
    from autopar.strategies import resolve
    folder.mkdir(parents=True)
    strategy = resolve(job.strategy, job.train, job.launch.nproc).strategy
    (folder / "config.toml").write_text(config_toml(strategy, job.train, job, planned=False))
    (folder / "run.json").write_text("{}")
    return folder


def test_config_toml_stores_paths_absolute_and_says_how_they_were_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = JobConfig(model=ModelConfig(name="hf:./my-model"), data=DataConfig(tokenizer="hf:tok", data="data/p.jsonl"),
                    train=TrainConfig(export_hf="out/exported"))
    text = config_toml(Strategy(dp=2), job.train, job, planned=False)
    stored = tomllib.loads(text)
    assert stored["model"]["name"] == f"hf:{tmp_path / 'my-model'}"
    assert stored["data"]["tokenizer"] == f"hf:{tmp_path / 'tok'}"
    assert stored["data"]["data"] == str(tmp_path / "data" / "p.jsonl")
    assert stored["train"]["export_hf"] == str(tmp_path / "out" / "exported")
    assert "model.name = 'hf:./my-model'" in text and "data.data = 'data/p.jsonl'" in text  # as typed, a comment
    named = JobConfig(model=ModelConfig(name="hf:llama"))  # an architecture by name is no path
    assert tomllib.loads(config_toml(Strategy(dp=1), named.train, named, planned=False))["model"]["name"] == "hf:llama"


@pytest.mark.parametrize("flags, flag, mine, theirs", [
    (["--model", "gpt-mini"], "--model", "gpt-mini", "gpt-tiny"),
    (["--tokenizer", "bpe"], "--tokenizer", "bpe", "byte"),
    (["--data", "other.txt"], "--data", "other.txt", "None"),
])
def test_resume_refuses_a_flag_that_contradicts_the_run(tmp_path, monkeypatch, flags, flag, mine, theirs):
    """`--resume runs/tiny --model gpt-mini` once kept gpt-tiny's weights and relabelled the run gpt-mini."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other.txt").write_text("text")
    run = fake_run(tmp_path / "tiny", job_of("--model", "gpt-tiny"))
    assert job_of("--resume", str(run)).model.name == "gpt-tiny"  # the run's own config, nothing contradicts it
    assert job_of("--resume", str(run), "--model", "gpt-tiny", "--steps", "9").train.steps == 9
    with pytest.raises(ConfigError) as caught:
        job_of("--resume", str(run), *flags)
    message = str(caught.value)
    assert message.startswith(f"{flag} ") and mine in message and theirs in message and "config.toml" in message


def test_a_runs_config_rederives_dp_for_another_process_count(tmp_path):
    """The file holds the dp its run resolved (4 processes: dp=4); with --nproc 2 the degrees are derived again."""
    from autopar.strategies import resolve
    run = fake_run(tmp_path / "run", job_of("--model", "gpt-tiny", "--nproc", "4"))
    assert tomllib.loads((run / "config.toml").read_text())["strategy"]["dp"] == 4
    job = job_of("--config", str(run / "config.toml"), "--nproc", "2")
    assert resolve(job.strategy, job.train, job.launch.nproc).strategy.dp == 2
    assert job_of("--config", str(run / "config.toml"), "--nproc", "2", "--dp", "1", "--tp", "2").strategy.dp == 1


def train_in(cwd: str, argv: list[str]) -> int:
    """`autopar train ARGV` run from `cwd` on a rank of the pool (the directory is restored after)."""
    from autopar.job import run_job
    before = os.getcwd()
    os.chdir(cwd)
    try:
        return run_job(job_of(*argv)).first_step
    finally:
        os.chdir(before)


def test_resume_from_another_directory_finds_the_runs_files(rank_pool, tmp_path):
    """Started in one directory with a relative --data, resumed from another with --resume alone: config.toml's
    paths are absolute (the relative one used to be looked for in the wrong place)."""
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first.mkdir(), elsewhere.mkdir()
    (first / "docs.txt").write_text("a small text to train on, again and again.\n" * 200)
    small = ["--model", "gpt-tiny", "--model-arg", "n_layer=1", "--seq-len", "16", "--global-batch-size", "4",
             "--micro-batch-size", "4", "--eval-batches", "1", "--no-progress", "--nproc", "1", "--warmup-steps", "1",
             "--data-cache", str(tmp_path / "cache")]
    pool = rank_pool(1)
    assert pool.run(train_in, str(first), [*small, "--data", "docs.txt", "--steps", "2", "--out", "run"])[0] == 1
    assert pool.run(train_in, str(elsewhere), ["--resume", str(first / "run"), "--steps", "3"])[0] == 3
    steps = [json.loads(line)["step"] for line in (first / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_an_export_never_overwrites_an_earlier_one(tmp_path):
    from autopar.preflight import check_export_folder
    from autopar.train.hf_export import unused_folder
    earlier = tmp_path / "exported"
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    for to in ("hf", "torch"):
        with pytest.raises(ConfigError, match="already holds files .* an export never overwrites"):
            cmd_export(build_parser().parse_args(["export", str(tmp_path / "run"), "--to", to, str(earlier)]))
    with pytest.raises(ConfigError, match="--export-hf .* already holds files"):  # a resumed run keeps --export-hf
        check_export_folder(JobConfig(train=TrainConfig(export_hf=str(earlier))))
    check_export_folder(JobConfig(train=TrainConfig(export_hf=str(tmp_path / "new"))))
    assert unused_folder(earlier) == tmp_path / "exported-2"  # where the end of training writes instead, said
    assert unused_folder(tmp_path / "new") == tmp_path / "new"
    assert (earlier / "config.json").read_text() == "{}"


def test_any_model_exports_as_one_state_dict(rank_pool, tmp_path):
    """`autopar export RUN --to torch OUT` of a two-process run of gpt-tiny (not a Hugging Face model; its head
    is tied to the embedding): the trained parameters under every name, loaded strictly into a fresh model."""
    from autopar.models import build_model
    from autopar.data import padded_vocab_size
    trained = rank_pool(2).run(train_builtin, "gpt-tiny", str(tmp_path / "run"), steps=2)[0]["params"]
    assert cmd_export(build_parser().parse_args(["export", str(tmp_path / "run"), "--to", "torch",
                                                 str(tmp_path / "model.pt")])) == 0
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[name], trained[name]) for name in state)
    model, _ = build_model("gpt-tiny", vocab_size=padded_vocab_size(258), device="cpu")
    model.load_state_dict(state)  # strict: every name, the tied one too
    assert torch.equal(model.lm_head.weight, trained["lm_head.weight"])
