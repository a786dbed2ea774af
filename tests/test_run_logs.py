"""Watching a run: loggers (metrics.jsonl, CSV, TensorBoard), plain lines in a log that is not a terminal,
MFU and its formula, the banner, a dying rank named first, and a command line that starts without torch."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.config import TrainConfig
from autopar.errors import ConfigError
from autopar.train.banner import batch_line, parameters_text
from autopar.train.flops import StepFlops, forward_flops_per_sample
from autopar.train.log_lines import format_line
from autopar.train.loggers import CsvLogger, scalars
from autopar.train.loss import default_forward

ROOT = Path(__file__).resolve().parents[1]


def autopar(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=os.environ.copy())


def test_a_logged_run_writes_every_metric_to_every_logger_and_prints_plain_lines(tmp_path):
    """One process, stdout captured: not a terminal."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = tmp_path / "run"
    done = autopar("train", "--model", "gpt-tiny", "--seq-len", "32", "--global-batch-size", "8",
                   "--micro-batch-size", "4", "--steps", "4", "--nproc", "1", "--eval-every", "2",
                   "--eval-batches", "1", "--log-every", "2", "--log", "tensorboard,csv", "--no-progress",
                   "--out", str(run))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # the banner, even with --no-progress: run folder, tokens per step, data size, what MFU is taken against
    assert f"run folder: {run}" in out, out
    assert "global batch 8 x 32 tokens = 256 tokens per step; train data " in out, out
    assert "model FLOPs per step: " in out and "MFU peak: 0.02 TFLOP/s per device (cluster 'cpu-local'" in out, out
    # plain lines at the records' cadence (every 2 steps), with what a log reader needs
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 4/4"], out
    for field in ("loss ", "eval loss ", "lr ", " tok/s", " TFLOP/s/dev", "MFU ", "mem ", "eta "):
        assert field in lines[-1], (field, lines[-1])

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", r["time"]), r["time"]
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] * 1e12 / 2e10)  # cpu-local's fp32 peak (conftest)
    metrics = {key for r in records for key in r if isinstance(r[key], (int, float)) and key not in
               ("step", "elapsed_s")}
    assert {"loss", "eval_loss", "lr", "tokens_per_s", "mfu", "tflops_per_device"} <= metrics

    # TensorBoard's own reader finds every metric, at its step, with its value
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for key in metrics:
        tag = "eval/loss" if key == "eval_loss" else f"train/{key}"
        found = {e.step: e.value for e in events.Scalars(tag)}
        expected = {r["step"]: r[key] for r in records if key in r}
        assert found.keys() == expected.keys(), (tag, found, expected)
        for step, value in expected.items():
            assert found[step] == pytest.approx(value, rel=1e-6), (tag, step)
    # the CSV holds the same records
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [int(row["step"]) for row in rows] == [2, 4]
    assert all(float(rows[i][key]) == pytest.approx(r[key]) for i, r in enumerate(records) for key in metrics if key in r)

    summary = json.loads((run / "summary.json").read_text())
    assert summary["tokens"] == 4 * 256 and summary["duration_s"] > 0 and summary["tokens_per_s"] > 0
    assert summary["mfu"] == pytest.approx(summary["tflops_per_device"] * 1e12 / 2e10)
    assert "cpu-local" in summary["mfu_peak_source"]


def test_recomputed_forward_share_of_a_pipeline_counts_whole_stages_and_budgeted_blocks():
    from types import SimpleNamespace as NS

    from autopar.pipeline.engine import PipelineEngine
    blocks = [NS(flops=f) for f in (10, 20, 30, 40)]  # stage 0: blocks 0-1, stage 1: blocks 2-3
    specs = [NS(index=0, block_range=(0, 2)), NS(index=1, block_range=(2, 4))]
    engine = NS(partition=NS(graph=NS(blocks=blocks), specs=specs), pipe=NS(recompute=frozenset({0})),
                recompute_report=None)
    assert PipelineEngine.recomputed_forward_fraction(engine) == pytest.approx(30 / 100)  # stage 0 whole
    engine.pipe.recompute, engine.recompute_report = frozenset(), NS(blocks={0: 0, 1: 1})
    assert PipelineEngine.recomputed_forward_fraction(engine) == pytest.approx(30 / 100)  # stage 1's first block
    engine.recompute_report = None
    assert PipelineEngine.recomputed_forward_fraction(engine) == 0


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3, bias=False), nn.Linear(3, 2, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_mfu_formula_on_a_hand_computed_case():
    model = TwoLayers()
    before = [p.detach().clone() for p in model.parameters()]
    sample = {"inputs": torch.randn(5, 4), "labels": torch.zeros(5, 2)}  # 5 positions of 4 features
    forward = forward_flops_per_sample(model, default_forward, sample)
    assert forward == 2 * 5 * 4 * 3 + 2 * 5 * 3 * 2  # two matmuls: 2 x rows x in x out each = 180
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # counted on meta: untouched
    assert all(p.grad is None for p in model.parameters())

    flops = StepFlops.of(forward, 8, devices=2, recomputed_fraction=0.5, peak_flops_per_device=1e4,
                         peak_source="test")
    assert flops.model_flops == 3 * 180 * 8 == 4320  # forward + backward (2 x forward) of the global batch
    rates = flops.rates(0.5)  # 4320 FLOP in 0.5 s over 2 devices: 4320 FLOP/s each
    assert rates["tflops_per_device"] == pytest.approx(4320e-12)
    assert rates["mfu"] == pytest.approx(4320 / 1e4)
    assert rates["recompute_tflops_per_device"] == pytest.approx(0.5 * 180 * 8 / 0.5 / 2 * 1e-12)
    run = flops.times(3).rates(1.5)  # three such steps: the same rates
    assert run["mfu"] == pytest.approx(rates["mfu"])
    assert "mfu" not in StepFlops.of(forward, 8, devices=2, peak_flops_per_device=None, peak_source="?").rates(1.0)


def test_the_peak_is_the_gpus_datasheet_or_the_named_cluster(monkeypatch):
    from autopar.search.device_peak import device_peak
    monkeypatch.delenv("AUTOPAR_CLUSTER", raising=False)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert device_peak(cuda, "bf16-autocast", world=8)[0] == 989e12  # H100 SXM5 datasheet, bf16 dense
    assert device_peak(cuda, "fp32", world=8)[0] == 67e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    peak, source = device_peak(cuda, "fp32", world=8)
    assert peak is None and "no datasheet figure for 'Tesla T4'" in source  # no MFU rather than a wrong one
    assert device_peak(cuda, "bf16", world=8, cluster="a100-80gb")[0] == 312e12  # a named cluster wins


def test_a_hugging_face_model_with_a_key_value_cache_is_counted():
    """A Hugging Face model builds its key/value cache inside the forward (use_cache defaults on); the count
    runs without it, so such models get FLOPs (and an MFU) at all, and the model's own config is untouched."""
    import transformers
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.zeros(16, dtype=torch.long)
    flops = forward_flops_per_sample(model, lambda m, batch: m(**batch), {"input_ids": tokens, "labels": tokens})
    linears = 2 * 16 * (64 * 3 * 64 + 64 * 64 + 2 * 64 * 256) * 2 + 2 * 16 * 64 * 128  # 2 blocks + the head
    assert flops is not None and flops >= linears  # + attention's two matmuls
    assert model.config.use_cache


def test_a_model_that_cannot_run_on_meta_gets_no_mfu():
    class OnlyReal(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 2))

        def forward(self, x):
            return x @ self.w + torch.tensor(x.tolist()).sum()  # reads the data: impossible on meta

    assert forward_flops_per_sample(OnlyReal(), default_forward, (torch.ones(4), torch.zeros(2))) is None


def test_loggers_are_refused_early_and_clearly(monkeypatch):
    with pytest.raises(ConfigError, match=r"--log 'csv,bogus': unknown logger 'bogus'; use a comma-separated list"):
        TrainConfig(log="csv,bogus").validate()
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"--log tensorboard: the 'tensorboard' package is not installed.*pip install"):
        TrainConfig(log="tensorboard").validate()
    TrainConfig(log="csv").validate()


def test_csv_rows_after_a_resumed_checkpoint_are_dropped_and_new_columns_widen_it(tmp_path):
    path = tmp_path / "metrics.csv"
    first = CsvLogger(path, start=0)
    for step in (1, 2, 3):
        first.log({"step": step, "loss": 1.0 / step})
    resumed = CsvLogger(path, start=2)  # the checkpoint was at step 2: step 3 will be redone
    resumed.log({"step": 3, "loss": 0.5, "eval_loss": 0.7})
    rows = list(csv.DictReader(open(path)))
    assert [(r["step"], r["loss"], r["eval_loss"]) for r in rows] == [("1", "1.0", ""), ("2", "0.5", ""),
                                                                      ("3", "0.5", "0.7")]


def test_wandb_is_offline_in_the_run_folder_unless_configured(tmp_path, monkeypatch):
    """W&B is not a test dependency: a stand-in module records what the logger asks of it."""
    import types

    from autopar.train.loggers import WandbLogger
    calls = []
    run = types.SimpleNamespace(log=lambda values, step: calls.append(("log", values, step)),
                                finish=lambda: calls.append(("finish",)))
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    logger = WandbLogger(tmp_path, {"train": {"lr": 0.1}})
    logger.log({"step": 3, "loss": 2.5, "eval_loss": 2.0, "time": "t", "elapsed_s": 1.0, "grad_norm": None})
    logger.close()
    init = calls[0][1]
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path / "wandb") and init["project"] == "autopar"
    assert calls[1:] == [("log", {"train/loss": 2.5, "eval/loss": 2.0}, 3), ("finish",)]
    monkeypatch.setenv("WANDB_MODE", "online")  # configured by the user: theirs to choose
    WandbLogger(tmp_path, {})
    assert calls[-1][1]["mode"] is None


def test_plain_lines_banner_lines_and_scalars():
    record = {"step": 40, "loss": 3.21544, "lr": 2.85e-3, "tokens_per_s": 41210.4, "tflops_per_device": 1.92,
              "mfu": 0.0412, "peak_mem_bytes": 1.3 * 2**30, "time": "2026-01-01T00:00:00.000+00:00"}
    assert format_line(record, total=200, eta_s=131.2) == ("step 40/200 | loss 3.2154 | lr 2.85e-03 | 41,210 tok/s | "
                                                           "1.92 TFLOP/s/dev | MFU 4.1% | mem 1.30 GiB | eta 0:02:11")
    assert scalars({**record, "eval_loss": 3.0, "grad_norm": None, "skipped": True}) == {
        "train/loss": 3.21544, "train/lr": 2.85e-3, "train/tokens_per_s": 41210.4, "train/tflops_per_device": 1.92,
        "train/mfu": 0.0412, "train/peak_mem_bytes": 1.3 * 2**30, "eval/loss": 3.0}
    assert parameters_text(1000, 1000) == "1,000 parameters"
    assert parameters_text(1000, 600) == "1,000 parameters (600 on rank 0)"
    assert batch_line(global_batch_size=8, tokens_per_sample=32, train_samples=800, eval_samples=80, steps=50) == (
        "global batch 8 x 32 tokens = 256 tokens per step; train data 800 samples, 80 held out (0.5 epochs in 50 steps)")


KILLED_SCRIPT = """
import os, signal, torch, torch.distributed as dist
from datetime import timedelta
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(t)  # the survivors: gloo's connection error, a traceback
"""


def test_a_killed_rank_is_named_first_and_the_survivors_are_kept_in_logs(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SCRIPT)
    done = autopar("launch", "--nproc", "2", str(script), timeout=120)
    assert done.returncode == 128 + 9, (done.returncode, done.stderr)  # as a shell says it, not 247
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("autopar launch: rank 1 was killed by SIGKILL (exit status 137); stopping the "
                               "other ranks"), done.stderr
    assert "Traceback" not in done.stderr and "Connection" not in done.stderr, done.stderr
    logs = Path(re.search(r"every rank's whole output: (\S+)", lines[-1]).group(1))
    assert "Traceback" in (logs / "rank_0.log").read_text()  # kept whole, not shown


def test_every_exit_status_is_documented():
    from autopar.launch import EXIT_STATUSES
    table = (ROOT / "docs" / "features" / "command-line.md").read_text()
    assert [status for status in EXIT_STATUSES if f"| {status} |" not in table] == []


def test_the_command_line_starts_without_torch():
    """`autopar --help` and `autopar models` import no torch (a second or more); the listing is the builders'."""
    probe = ("import sys; from autopar.cli import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "heavy = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformers'))]\n"
             "print('HEAVY', heavy)")
    for args in (["--help"], ["models"]):
        done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        assert done.returncode == 0, done.stderr
        assert "HEAVY []" in done.stdout, (args, done.stdout[-500:])
    from autopar.config.model_catalog import CATALOG
    from autopar.models import available_models, build_model
    live = tuple((name, info.task, info.num_params, info.max_seq_len)
                 for name, info in ((name, build_model(name, device="meta")[1]) for name in available_models()))
    assert live == CATALOG, ("the model catalog (src/autopar/config/model_catalog.py) differs from what the registry "
                             "builds; paste this as CATALOG:\n" + "\n".join(f"    {row!r}," for row in live))
