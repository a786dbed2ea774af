"""Hints that are right: a suggested layout fills the processes and runs the model, errors name the flag the
user typed, a schedule given without what it needs is refused, a warm-up longer than the run is said."""

from __future__ import annotations

import re

import pytest

import autopar
from autopar.cli import _check_before_start, _job_builder, build_parser, resolve_job
from autopar.config import JobConfig, TrainConfig
from autopar.config.degrees import DegreesDoNotFit
from autopar.errors import ConfigError, DataError
from autopar.preflight import schedule_warnings
from autopar.strategies import resolve

LAYOUT = re.compile(r"dp=(\d+) tp=(\d+) pp=(\d+)")


def suggested(message: str) -> list[tuple[int, int, int]]:
    """The layouts a message suggests (after its first ';': before it, the values seen)."""
    return [tuple(map(int, m)) for m in LAYOUT.findall(message.split(";", 1)[1])]


def job_of(*flags: str) -> JobConfig:
    return resolve_job(build_parser().parse_args(["train", "--model", "gpt-tiny", "--seq-len", "32",
                                                  "--global-batch-size", "12", "--micro-batch-size", "1", *flags]))


@pytest.mark.parametrize("world, fields", [(3, dict(pp=2)), (4, dict(tp=5)), (4, dict(tp=3, pp=2)),
                                           (4, dict(dp=3))])
def test_numbers_alone_suggest_only_layouts_that_fill_the_processes(world, fields):
    """`--nproc 3 --pp 2` once suggested dp=1 tp=1 pp=2, and `--tp 5` on 4 processes tp=5."""
    with pytest.raises(DegreesDoNotFit) as caught:
        autopar.Strategy(**fields).resolved(world)
    layouts = suggested(str(caught.value))
    assert layouts and all(dp * tp * pp == world for dp, tp, pp in layouts), str(caught.value)


@pytest.mark.parametrize("flags", [("--nproc", "3", "--pp", "2"), ("--nproc", "4", "--tp", "5"),
                                   ("--nproc", "3", "--tp", "3")])
def test_the_command_suggests_layouts_the_model_runs(flags):
    """With the model traced before launch, every suggestion is checked on it: each one passes the very checks
    that refused the typed degrees (heads for tp, blocks for pp); gpt-tiny has 4 heads, so no tp=3."""
    job = job_of(*flags)
    with pytest.raises(ConfigError) as caught:
        _check_before_start(job, _job_builder(job))
    layouts = suggested(str(caught.value))
    assert layouts, str(caught.value)
    for dp, tp, pp in layouts:
        assert dp * tp * pp == job.launch.nproc
        again = job_of(*flags, "--dp", str(dp), "--tp", str(tp), "--pp", str(pp))
        _check_before_start(again, _job_builder(again))  # runs: no error


def test_a_missing_eval_file_is_named_by_its_own_flag(tmp_path):
    """It used to be reported as --data; now said before any process starts, and by the reader too."""
    from autopar.data import build_tokenizer
    from autopar.data.files import DataFiles, build_file_datasets
    train = tmp_path / "train.txt"
    train.write_text("some text to train on\n" * 40)
    missing = str(tmp_path / "held-out.txt")
    job = job_of("--data", str(train), "--eval-data", missing)
    with pytest.raises(DataError, match=r"^--eval-data '.*held-out.txt': no such file"):
        _check_before_start(job, _job_builder(job))
    with pytest.raises(DataError, match=r"^--eval-data '.*held-out.txt': no such file"):
        build_file_datasets(DataFiles(path=str(train), eval_path=missing, cache_dir=str(tmp_path / "cache")),
                            build_tokenizer("byte"), seq_len=16)
    with pytest.raises(DataError, match=r"--eval-data .* is the held-out file of --data, which is not set"):
        _check_before_start(job_of("--eval-data", str(train)), None)


def test_interleaving_one_chunk_is_refused_by_its_rule():
    with pytest.raises(ConfigError, match=r"interleaved-1f1b with --chunks 1 .*use --chunks 2.*"
                                          r"\(rule interleaved-one-chunk\)"):
        resolve(autopar.Strategy(pp=2, schedule="interleaved-1f1b"), TrainConfig(global_batch_size=8,
                                                                                 micro_batch_size=2), 2)
    resolve(autopar.Strategy(pp=2, schedule="interleaved-1f1b", chunks=2), TrainConfig(global_batch_size=8,
                                                                                       micro_batch_size=2), 2)


def test_a_warm_up_longer_than_the_run_is_said_before_start(capsys):
    (warning,) = schedule_warnings(JobConfig(train=TrainConfig(steps=10, warmup_steps=20)))
    assert "--warmup-steps 20 (the default) is longer than --steps 10" in warning and "10/20 of --lr" in warning
    assert schedule_warnings(JobConfig(train=TrainConfig(steps=10, warmup_steps=10))) == []
    job = job_of("--nproc", "1", "--steps", "4", "--warmup-steps", "8")
    _check_before_start(job, _job_builder(job))
    assert "autopar: warning: --warmup-steps 8 is longer than --steps 4" in capsys.readouterr().err
