"""End to end through the `autopar` command: real processes, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from helpers import max_relative_difference

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model", "gpt-tiny", "--seq-len", "32", "--global-batch-size", "8", "--lr", "1e-3", "--no-progress",
         "--eval-batches", "1", "--micro-batch-size", "2"]


def autopar(*args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_a_complete_run_folder(tmp_path):
    run = tmp_path / "run"
    unset = [a for a in SMALL if a not in ("--micro-batch-size", "2")]  # the default: 4 of the 8 per replica
    done = autopar("train", *unset, "--nproc", "2", "--steps", "6", "--eval-every", "3", "--out", str(run))
    assert done.returncode == 0, done.stderr
    assert "1 micro-batch(es) of 4 per replica per step" in done.stdout, done.stdout
    config = tomllib.loads((run / "config.toml").read_text())
    assert {k: config["strategy"][k] for k in ("dp", "tp", "pp")} == {"dp": 2, "tp": 1, "pp": 1}
    assert "micro_batch_size" not in config["train"]  # unset stays unset: a resume on another count resolves it anew
    assert config["model"]["args"]["n_layer"] == 2
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_bytes"} <= r.keys()
        assert r["peak_mem_bytes"] > 10_000_000 and r["tokens_per_s"] > 0
    assert "eval_loss" in records[2] and "eval_loss" in records[5]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_loss"] == records[-1]["eval_loss"]  # exact: one value written to two files
    assert (run / "checkpoints" / "latest").read_text() == "step_00000006"
    assert json.loads((run / "run.json").read_text())["world_size"] == 2
    # the written config reproduces the run
    again = tmp_path / "again"
    done = autopar("train", "--config", str(run / "config.toml"), "--out", str(again), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert [r["loss"] for r in metrics(again)] == [r["loss"] for r in records]
    # resumed on 4 processes (the command line's config, resolved in this process): the unset micro-batch
    # is resolved for dp=4, as a new run on 4 would be
    from autopar.cli import build_parser, resolve_job
    from autopar.strategies import resolve
    job = resolve_job(build_parser().parse_args(["train", "--resume", str(run), "--nproc", "4"]))
    resumed = resolve(job.strategy, job.train, job.launch.nproc)
    assert (resumed.strategy.dp, resumed.config.micro_batch_size, resumed.accumulation) == (4, 2, 1)


def test_cli_dp4_matches_one_process_for_20_steps(tmp_path):
    runs = {}
    for nproc, micro in ((1, 8), (4, 1)):
        runs[nproc] = tmp_path / f"n{nproc}"
        done = autopar("train", *SMALL, "--nproc", str(nproc), "--steps", "20", "--micro-batch-size", str(micro),
                       "--out", str(runs[nproc]))
        assert done.returncode == 0, done.stderr
    one, four = ([r["loss"] for r in metrics(runs[n])] for n in (1, 4))
    assert len(one) == 20 and one[-1] < one[0]
    assert max_relative_difference(one, four) < 1e-5


def test_resume_from_the_command_line(tmp_path):
    run = tmp_path / "run"
    done = autopar("train", *SMALL, "--nproc", "2", "--steps", "6", "--micro-batch-size", "4",
                   "--checkpoint-every", "3", "--out", str(run))
    assert done.returncode == 0, done.stderr
    losses = [r["loss"] for r in metrics(run)]
    resumed = tmp_path / "resumed"
    done = autopar("train", *SMALL, "--nproc", "2", "--steps", "6", "--micro-batch-size", "4", "--resume",
                   str(run / "checkpoints" / "step_00000003"), "--out", str(resumed))
    assert done.returncode == 0, done.stderr
    assert [r["loss"] for r in metrics(resumed)] == losses[3:]


@pytest.mark.parametrize("args,message", [
    (["--nproc", "4", "--dp", "3"], "dp*tp*pp = 3*1*1 does not equal the number of processes (4)"),
    (["--nproc", "2", "--model", "gpt-huge"], "unknown model 'gpt-huge'"),
    (["--nproc", "2", "--model-arg", "n_layers=3"], "unknown model argument 'n_layers'"),
    (["--nproc", "2", "--model-arg", "n_layer=abc"], "'abc'"),
    (["--nproc", "2", "--global-batch-size", "30", "--micro-batch-size", "4"], "not divisible by dp*micro_batch_size"),
    (["--nproc", "1", "--seq-len", "1000"], "seq_len=1000 is longer than gpt-tiny's context of 256"),
    (["--nproc", "2", "--resume", "/nonexistent/run"], "no such folder"),
    (["--nproc", "1", "--config", "/nonexistent.toml"], "config file '/nonexistent.toml' does not exist"),
    (["--nproc", "1", "--steps", "-3"], "train.steps must be a positive integer, got -3"),
    pytest.param(["--nproc", "1", "--device", "cuda"], "no CUDA GPU is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_bad_input_gives_one_clear_line(args, message):
    base = [a for a in SMALL if a not in ("--seq-len", "32")]
    done = autopar("train", *base, *args, "--steps", "2") if "--steps" not in args else autopar("train", *base, *args)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_unknown_config_key_names_the_valid_ones(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 2\nlearning_rate = 0.1\n")
    done = autopar("train", "--config", str(path), "--nproc", "1")
    assert done.returncode == 2 and "unknown key 'learning_rate'" in done.stderr and "lr" in done.stderr


def test_errors_are_reported_on_every_rank():
    """A refusal only the ranks can make: the memory budget's recomputation plan needs each stage's saved bytes."""
    base = [a for a in SMALL if a not in ("--micro-batch-size", "2")]
    done = autopar("train", *base, "--nproc", "2", "--pp", "2", "--memory-budget-mb", "0.01", "--steps", "2")
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "the least any plan needs is" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "(rank 0 of 2)" in done.stderr and "(rank 1 of 2)" in done.stderr, done.stderr


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt-huge"], "unknown model 'gpt-huge'"),
    (["--resume", "/nonexistent/run"], "no such folder"),
    (["--seq-len", "1000"], "seq_len=1000 is longer than gpt-tiny's context of 256"),
    (["--model", "hf:/nonexistent/llama"], "pretrained model folder '/nonexistent/llama' does not exist"),
])
def test_model_and_resume_errors_come_before_any_rank_starts(args, message):
    done = autopar("train", *[a for a in SMALL if a not in ("--seq-len", "32")], "--nproc", "2", "--steps", "2", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "(rank" not in done.stderr, done.stderr  # said once, by the launcher


DYING_SCRIPT = """
import os, torch, autopar
from torch.utils.data import TensorDataset
calls = [0]
def forward(model, batch):
    calls[0] += 1
    if os.environ["RANK"] == "1" and calls[0] == 3:
        raise RuntimeError("rank 1 ran out of luck")
    return model(batch["inputs"])
data = TensorDataset(torch.randn(256, 4), torch.randn(256, 2))
autopar.Trainer(torch.nn.Linear(4, 2), data, config=autopar.TrainConfig(steps=50, global_batch_size=8,
    micro_batch_size=4, progress=False, timeout_s=600, out=OUT), forward_fn=forward,
    loss_fn=lambda y, b: torch.nn.functional.mse_loss(y, b["labels"])).train()
"""


def test_a_dying_rank_stops_the_job_quickly_with_its_message(tmp_path):
    script = tmp_path / "dying.py"
    script.write_text(f"OUT = {str(tmp_path / 'run')!r}\n" + DYING_SCRIPT)
    began = time.monotonic()
    done = autopar("launch", "--nproc", "2", str(script), timeout=120)
    assert done.returncode != 0
    assert time.monotonic() - began < 60  # not the 600 s collective timeout
    assert "rank 1 ran out of luck" in done.stderr, done.stderr
    # the launcher names rank 1 as the cause: usually its error exit ("rank 1 failed (exit code 1)"); sometimes
    # the dying rank aborts while torch tears its gloo group down after the traceback ("rank 1 was killed by
    # SIGABRT"), seen once in 1100-test fresh-clone runs
    assert "autopar launch: rank 1 failed" in done.stderr or "autopar launch: rank 1 was killed by" in done.stderr, \
        done.stderr


def test_torchrun_runs_the_same_entry_point(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "autopar", "train", *SMALL, "--steps", "3", "--micro-batch-size", "4",
                           "--out", str(run)], capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert json.loads((run / "run.json").read_text())["world_size"] == 2 and len(metrics(run)) == 3


def test_example_script_single_and_launched(tmp_path):
    example = str(ROOT / "examples" / "train_custom_model.py")
    single = subprocess.run([sys.executable, example, "--steps", "30", "--out", str(tmp_path / "a")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert single.returncode == 0, single.stderr
    launched = autopar("launch", "--nproc", "2", example, "--steps", "30", "--out", str(tmp_path / "b"))
    assert launched.returncode == 0, launched.stderr
    one, two = ([r["loss"] for r in metrics(tmp_path / d)] for d in "ab")
    assert one[-1] < one[0] / 5
    assert max_relative_difference(one, two) < 1e-5


def test_models_command_lists_every_family():
    done = autopar("models")
    assert done.returncode == 0
    for name in ("gpt-tiny", "gpt-medium", "hf:gpt2", "hf:llama", "hf:bert"):
        assert name in done.stdout


def test_pipeline_training_from_the_command_line(tmp_path):
    run = tmp_path / "pp"
    done = autopar("train", *SMALL, "--nproc", "2", "--pp", "2", "--schedule", "1f1b", "--micro-batches", "4",
                   "--global-batch-size", "16", "--steps", "4", "--trace", "--out", str(run))  # 4 micro-batches of 4
    assert done.returncode == 0, done.stderr
    records = metrics(run)
    assert len(records) == 4
    for r in records:
        assert 0 <= r["bubble_fraction"] < 1 and len(r["bubble_per_stage"]) == 2
        assert len(r["peak_mem_bytes_per_stage"]) == 2 and min(r["peak_mem_bytes_per_stage"]) > 10_000_000
    trace = json.loads((run / "timeline.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"0F0", "0B3", "1F0", "1B3"} <= names  # both stages, all four micro-batches
    assert (run / "timeline.png").stat().st_size > 1000
    config = tomllib.loads((run / "config.toml").read_text())
    assert config["strategy"]["pp"] == 2 and config["strategy"]["dp"] == 1
    # the same run on one process gives the same losses
    one = tmp_path / "one"
    assert autopar("train", *SMALL, "--nproc", "1", "--steps", "4", "--global-batch-size", "16",
                   "--out", str(one)).returncode == 0
    assert max_relative_difference([r["loss"] for r in metrics(one)], [r["loss"] for r in records]) < 1e-5


@pytest.mark.parametrize("args,message", [
    (["--pp", "2", "--schedule", "2f2b"], "unknown pipeline schedule '2f2b'"),
    (["--pp", "2", "--schedule", "interleaved-1f1b", "--chunks", "2", "--micro-batches", "3",
      "--global-batch-size", "6"], "num_microbatches must be a multiple of 2, got 3"),
    (["--pp", "2", "--partition", "random"], "unknown partition method 'random'"),
])
def test_pipeline_bad_input(args, message):
    base = [a for a in SMALL if a not in ("--micro-batch-size", "2")]
    done = autopar("train", *base, "--nproc", "2", "--steps", "2", *args)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("args,message", [
    (["--nproc", "4", "--dp-mode", "gossip", "--pp", "2"], "--dp-mode gossip is data-parallel only"),
    (["--nproc", "2", "--dp-mode", "gossip", "--gossip-order", "cta"], "strategy.gossip_order must be one of"),
    (["--nproc", "2", "--tp", "2", "--tp-subbatches", "3"], "strategy.tp_subbatches=3 does not divide"),
    (["--nproc", "2", "--dp-mode", "async", "--optimizer", "adamw"], "use --optimizer sgd"),
    (["--nproc", "2", "--sparse-embeddings", "embrace", "--sparse-schedule", "--grad-clip", "1"],
     "use --grad-clip 0"),
    (["--nproc", "2", "--pp", "2", "--schedule", "2f2b"], "unknown pipeline schedule '2f2b'"),
    (["--nproc", "2", "--pp", "2", "--schedule", "pipedream-2bw", "--dp-mode", "async"],
     "schedule 'pipedream-2bw' cannot be combined with --dp-mode async"),
    # the traced model's checks (cli._check_traced_model): tp splits and the pipeline's stage count
    (["--nproc", "4", "--tp", "4", "--model-arg", "n_head=2"], "tp=4 does not divide the 2 heads"),
    (["--nproc", "2", "--tp", "2", "--model-arg", "vocab_size=321"], "tp=2 does not divide the vocabulary of 321"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved-1f1b", "--chunks", "3", "--micro-batches", "4",
      "--model-arg", "n_layer=2"], "pp=2 x chunks=3 = 6 stages, but the model has only 4 blocks"),
])
def test_bad_strategy_is_refused_before_any_rank_starts(tmp_path, args, message):
    """strategies.resolve() and the traced model's checks run in `autopar train` itself: one error line, no rank
    started, no run folder."""
    run = tmp_path / "run"
    began = time.perf_counter()
    done = autopar("train", *SMALL, "--steps", "2", "--out", str(run), *args)
    elapsed = time.perf_counter() - began
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "(rank " not in done.stderr, done.stderr  # a launched rank would name itself
    assert not run.exists()
    assert elapsed < 60, elapsed  # no process group: the command's own start-up (and a trace on meta)
