"""Typed config: defaults < TOML file < flags, and clear errors for bad values."""

from __future__ import annotations

import pytest

from autopar.cli import build_parser, resolve_job
from autopar.config import JobConfig, Strategy, TrainConfig, from_dict, load_toml, to_dict, to_toml
from autopar.errors import ConfigError


def job_from(argv: list[str]) -> JobConfig:
    return resolve_job(build_parser().parse_args(["train", *argv]))


def test_defaults_are_the_main_job():
    job = job_from([])
    assert job.model.name == "gpt-mini" and job.launch.nproc == 4
    assert job.strategy.resolved(4) == Strategy(dp=4, tp=1, pp=1)
    assert job.strategy.pipeline.schedule == "1f1b" and job.strategy.pipeline.partition == "time"


def test_flags_override_file_and_model_args_add_up(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "gpt-tiny"\n[model.args]\nn_layer = 3\n[train]\nsteps = 7\nlr = 0.01\n')
    job = job_from(["--config", str(path), "--lr", "0.5", "--model-arg", "d_model=32", "--dp", "2", "--no-progress"])
    assert job.model.name == "gpt-tiny"
    assert job.model.args == {"n_layer": 3, "d_model": "32"}  # model args are coerced by the model builder
    assert job.train.steps == 7 and job.train.lr == 0.5 and job.strategy.dp == 2 and job.train.progress is False


def test_toml_round_trip():
    job = job_from(["--model", "hf:llama", "--steps", "3", "--model-arg", "num_hidden_layers=1"])
    again = from_dict(__import__("tomllib").loads(to_toml(job)))
    assert again == job


@pytest.mark.parametrize("text,needle", [
    ("[train]\nstepz = 3\n", "unknown key 'stepz'"),
    ("[trian]\nsteps = 3\n", "unknown section [trian]"),
    ("[train]\nsteps = 'many'\n", "expected int, got 'many'"),
    ("[train\nsteps = 3\n", "is not valid TOML"),
])
def test_bad_config_files(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=__import__("re").escape(needle)):
        load_toml(path)


def test_missing_and_unreadable_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "nope.toml")
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(ConfigError, match="cannot be read|not valid TOML"):
        load_toml(binary)


@pytest.mark.parametrize("argv,needle", [
    (["--steps", "0"], "train.steps must be a positive integer, got 0"),
    (["--steps", "ten"], "--steps: expected int, got 'ten'"),
    (["--dtype", "fp16"], "train.dtype must be one of {fp32, bf16, bf16-autocast}"),
    (["--lr", "-1"], "train.lr must be > 0"),
    (["--model-arg", "n_layer"], "expected KEY=VALUE"),
])
def test_bad_flags(argv, needle):
    with pytest.raises(ConfigError, match=__import__("re").escape(needle)):
        job_from(argv)


def test_degrees_must_match_world_size():
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp = 3\*1\*1 does not equal the number of processes \(4\)"):
        Strategy(dp=3).resolved(4)
    assert Strategy(tp=2).resolved(4).dp == 2
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp = \?\*3\*1"):
        Strategy(tp=3).resolved(4)
    assert Strategy(pp=2).resolved(4).dp == 2
    with pytest.raises(ConfigError, match="strategy.recompute must be one of"):
        Strategy(recompute="some").resolved(1)


def test_degrees_are_keyword_only():
    with pytest.raises(TypeError):
        Strategy(2, 1, 1)  # type: ignore[misc]


def test_batch_sizes_must_divide():
    config = TrainConfig(global_batch_size=30, micro_batch_size=4)
    with pytest.raises(ConfigError, match=r"global_batch_size=30 is not divisible by dp\*micro_batch_size = 2\*4 = 8"):
        config.accumulation_steps(2)
    assert TrainConfig(global_batch_size=32, micro_batch_size=4).accumulation_steps(2) == 4
    # unset (flags, TOML and the constructor alike): the per-replica batch up to 8, resolved once dp is known
    for given in (TrainConfig(global_batch_size=8), job_from(["--global-batch-size", "8"]).train,
                  from_dict({"train": {"global_batch_size": 8}}).train):
        assert given.micro_batch_size is None and "micro_batch_size" not in to_dict(given)  # config.toml keeps it unset
        assert [(given.with_micro_batches(dp).micro_batch_size, given.accumulation_steps(dp)) for dp in (1, 2, 4, 8)] \
            == [(8, 1), (4, 1), (2, 1), (1, 1)]
    assert TrainConfig(global_batch_size=48).with_micro_batches(4).micro_batch_size == 6  # 8 does not divide 12
    with pytest.raises(ConfigError, match=r"global_batch_size=30 does not split evenly over dp=4 replicas; use a "
                                          r"global batch size that is a multiple of 4 \(e.g. 32\)"):
        TrainConfig(global_batch_size=30).accumulation_steps(4)
    with pytest.raises(ConfigError, match="train.micro_batch_size must be a positive integer, got 0"):
        TrainConfig(micro_batch_size=0).validate()


def test_strategy_groups_options_by_concern_and_names_them_flat(tmp_path):
    """Flat keywords, flags and TOML keys land in their group; a flat read names the group to use."""
    import dataclasses

    from autopar.config import PipelineOptions, PlanningOptions, ReplicaOptions, SparseOptions
    from autopar.strategies import pick_entry

    s = Strategy(pp=2, schedule="gpipe", chunks=1, dp_mode="gossip", topology="torus", sparse_embeddings="embrace",
                 sparse_threshold=0.2, search="auto", confirm=0, zero=1)
    assert s.pipeline == PipelineOptions(schedule="gpipe", chunks=1)
    assert s.replicas == ReplicaOptions(mode="gossip", topology="torus", zero=1)
    assert s.sparse == SparseOptions(mode="embrace", threshold=0.2)
    assert s.planning == PlanningOptions(mode="auto", confirm=0) and s.planning.searched
    # a flat change keeps the rest of its group; a group given whole is taken as it is
    changed = dataclasses.replace(s, schedule="1f1b", dp=2)
    assert (changed.pipeline.schedule, changed.pipeline.chunks, changed.dp, changed.replicas.topology) == \
        ("1f1b", 1, 2, "torus")
    assert Strategy(replicas=ReplicaOptions(zero=2), zero=3).replicas.zero == 3
    with pytest.raises(AttributeError, match=r"Strategy.schedule lives in its group: Strategy.pipeline.schedule"):
        s.schedule
    with pytest.raises(TypeError, match="unknown option 'shedule'"):
        Strategy(shedule="gpipe")
    # flags and TOML stay flat, and round-trip
    names = [f.name for f in Strategy.flat_fields()]
    assert len(names) == len(set(names)) and {"dp_mode", "sparse_embeddings", "search", "schedule"} <= set(names)
    job = resolve_job(build_parser().parse_args(["train", "--schedule", "gpipe", "--dp-mode", "gossip",
                                                 "--sparse-threshold", "0.3", "--strategy", "auto"]))
    assert (job.strategy.pipeline.schedule, job.strategy.replicas.mode, job.strategy.sparse.threshold,
            job.strategy.planning.mode) == ("gpipe", "gossip", 0.3, "auto")
    text = to_toml(job)
    assert 'schedule = "gpipe"' in text and 'dp_mode = "gossip"' in text and "[strategy.pipeline]" not in text
    (tmp_path / "c.toml").write_text(text)
    assert load_toml(tmp_path / "c.toml").strategy == job.strategy
    with pytest.raises(ConfigError, match=r"unknown key 'mode'"):  # group attribute names are not TOML keys
        from_dict({"strategy": {"mode": "gossip"}})
    # engines receive their group: the data-parallel entries the replicas' options
    entry = pick_entry(Strategy(zero=1).resolved(2), TrainConfig())
    assert entry.options(Strategy(zero=1), TrainConfig()) == ReplicaOptions(zero=1)
