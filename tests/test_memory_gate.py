"""The memory gate: a hand-set run predicted not to fit is refused before any rank starts, with the estimate per
pipeline rank and a change that fits; --force starts it; --dry-run prints the plan. No rank is ever started here:
the launcher and the one-process run are replaced by recorders."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autopar import memory_gate
from autopar.cli import _check_before_start, _job_builder, build_parser, cmd_train, resolve_job
from autopar.errors import ConfigError
from autopar.search import device_memory
from autopar.search.memory_fit import MODEL_ERROR

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
# gpt-small (86M parameters: 1.3 GiB of fp32 AdamW state per replica) on 2 ranks of a host with 2 GiB available
TOO_BIG = ["--model", "gpt-small", "--nproc", "2", "--micro-batch-size", "2", "--seq-len", "128", "--steps", "1",
           "--no-progress"]


@pytest.fixture
def started(monkeypatch):
    """What would have started: the launcher's and the one-process run's calls, recorded instead of made."""
    calls = []
    monkeypatch.setattr("autopar.launch.launch", lambda command, nproc, **kw: calls.append(("launch", nproc)) or 0)
    monkeypatch.setattr("autopar.job.run_job", lambda job: calls.append(("run", 1)))
    return calls


def train(*args: str) -> int:
    argv = ["train", *args]
    return cmd_train(build_parser().parse_args(argv), argv[1:])


def host_with(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(device_memory, "host_available_bytes", lambda: int(gib * GIB))


def suggestion(message: str) -> list[str]:
    """The flags of the 'smallest change that fits' line."""
    found = re.search(r"smallest change that fits: (.*?) \(predicted", message)
    assert found, message
    return found.group(1).split()


def test_a_run_too_big_for_the_host_is_refused_before_any_rank_starts(monkeypatch, started, tmp_path):
    host_with(monkeypatch, 2)
    with pytest.raises(ConfigError) as refused:
        train(*TOO_BIG, "--out", str(tmp_path / "run"))
    message = str(refused.value)
    assert "gpt-small with dp=2 tp=1 pp=1 does not fit" in message
    assert "1 GiB per rank (2 GiB available on this host (MemAvailable) over 2 ranks)" in message
    assert re.search(r"each rank: 1\.\d+ GiB \(parameters 328 MiB \+ gradients 328 MiB \+ optimizer 657 MiB", message)
    assert f"{1 + MODEL_ERROR:g}x the memory" in message and "--force" in message
    assert started == [] and not (tmp_path / "run").exists()
    # the change it names fits by the same model: the same run with it starts
    change = suggestion(message)
    assert train(*TOO_BIG, *change) == 0
    assert started == [("launch", 2)]


def test_the_estimate_is_given_per_pipeline_rank(monkeypatch, started):
    host_with(monkeypatch, 1)
    with pytest.raises(ConfigError) as refused:
        train("--model", "gpt-small", "--nproc", "2", "--pp", "2", "--steps", "1")
    message = str(refused.value)
    assert re.search(r"pipeline rank 0 \(stage 0\): [\d.]+ GiB \(parameters 16\d MiB", message), message
    assert re.search(r"pipeline rank 1 \(stage 1\): [\d.]+ GiB \(parameters 16\d MiB", message), message
    assert "with another process count:" in message  # nothing fits on 2 ranks of this host: named as such
    assert started == []


def test_force_starts_it_anyway(monkeypatch, started, capsys):
    host_with(monkeypatch, 2)
    assert train(*TOO_BIG, "--force") == 0
    assert started == [("launch", 2)]
    assert "autopar: warning: gpt-small with dp=2 tp=1 pp=1 does not fit" in capsys.readouterr().err


def test_a_small_model_is_not_refused_nor_warned(monkeypatch, started, capsys):
    host_with(monkeypatch, 2)
    assert train("--model", "gpt-tiny", "--nproc", "2", "--steps", "1", "--warmup-steps", "1") == 0
    assert train("--model", "gpt-tiny", "--nproc", "1", "--steps", "1", "--warmup-steps", "1") == 0
    assert started == [("launch", 2), ("run", 1)]
    assert "warning" not in capsys.readouterr().err


def test_the_margin_is_the_models_error(monkeypatch):
    """Over the memory but within the model's error: started with a warning; beyond it: refused."""
    def verdict(memory_gb: float | None):
        args = ["train", "--model", "gpt-tiny", "--nproc", "2", "--seq-len", "64"]
        if memory_gb is not None:
            args += ["--memory-per-device-gb", str(memory_gb)]
        job = resolve_job(build_parser().parse_args(args))
        build = _job_builder(job)
        return memory_gate.estimate(job, _check_before_start(job, build), build, suggest=False)

    host_with(monkeypatch, 64)
    roomy = verdict(None)
    assert roomy.fit.fits and roomy.refusal is None and roomy.warning is None
    low = roomy.fit.low
    inside = verdict(low / (1 + MODEL_ERROR * 0.8) / GIB)
    assert not inside.fit.fits and inside.refusal is None and "within its error" in inside.warning
    beyond = verdict(low / (1 + MODEL_ERROR * 1.2) / GIB)
    assert beyond.refusal is not None


def test_strategies_the_model_does_not_cover_are_not_gated(monkeypatch, started, capsys):
    host_with(monkeypatch, 0.01)
    assert train("--model", "gpt-tiny", "--nproc", "2", "--dp-mode", "gossip", "--dry-run") == 0
    assert "memory not estimated for gossip data parallelism (--dp-mode gossip)" in capsys.readouterr().out
    assert train("--model", "gpt-tiny", "--nproc", "2", "--dp-mode", "gossip", "--steps", "1") == 0
    assert started == [("launch", 2)]


def test_dry_run_prints_the_plan_and_starts_nothing(monkeypatch, started, capsys, tmp_path):
    host_with(monkeypatch, 8)
    assert train("--model", "gpt-tiny", "--nproc", "2", "--pp", "2", "--out", str(tmp_path / "run"), "--dry-run") == 0
    out = capsys.readouterr().out
    assert "autopar" in out and "2 process(es), strategy dp=1 tp=1 pp=2, 136,960 parameters, 4 micro-batch(es) of 8" \
        in out
    assert "model: gpt-tiny (causal-lm, 136,960 parameters)" in out and "engine: pipeline" in out
    assert re.search(r"pipeline rank 1 \(stage 1\): [\d.]+ MiB \(parameters ", out)
    assert "memory: 4 GiB per rank (8 GiB available on this host (MemAvailable) over 2 ranks): fits" in out
    assert "dry run: every check passed" in out
    assert started == [] and not (tmp_path / "run").exists()


def test_rank_memory_divides_the_hosts_available_memory(monkeypatch):
    assert device_memory.host_available_bytes() > 0  # /proc/meminfo here (or sysconf)
    host_with(monkeypatch, 12)
    shared = device_memory.rank_memory("cpu", 4)
    assert shared.bytes == 3 * GIB and "12 GiB available on this host (MemAvailable) over 4 ranks" in shared.source
    assert device_memory.rank_memory("cpu", 4, memory_per_device_gb=1.5).bytes == 1.5 * GIB
    monkeypatch.setattr(device_memory, "host_available_bytes", lambda: None)
    assert device_memory.rank_memory("cpu", 4) is None  # unknown: not gated


def test_gpt_20b_on_one_process_is_refused_by_the_command(tmp_path):
    """End to end through `autopar train --dry-run`: the plan and the refusal, exit status 2, no rank."""
    done = subprocess.run([sys.executable, "-m", "autopar", "train", "--model", "gpt-20b", "--nproc", "1", "--steps",
                           "1", "--memory-per-device-gb", "80", "--dry-run", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ))
    assert done.returncode == 2, done.stderr
    assert "1 process(es), strategy dp=1 tp=1 pp=1, 19,949,408,256 parameters" in done.stdout
    assert re.search(r"each rank: 3\d\d GiB \(parameters 74\.3 GiB", done.stdout), done.stdout
    assert "gpt-20b with dp=1 tp=1 pp=1 does not fit" in done.stderr and "Traceback" not in done.stderr
    assert "with another process count:" in done.stdout and "(rank " not in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_cuda_rank_has_its_devices_memory(monkeypatch):
    """Each rank takes device local_rank % count: two ranks per device share it (no GPU needed to check)."""
    import torch

    class Properties:
        name, total_memory = "a GPU", 80 * GIB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Properties())
    assert device_memory.rank_memory("cuda", 2).bytes == 80 * GIB
    shared = device_memory.rank_memory("cuda", 4)
    assert shared.bytes == 40 * GIB and shared.source == "a GPU: 80 GiB per device, shared by 2 ranks"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_memory.rank_memory("cuda", 2) is None


def test_a_model_the_tracer_cannot_take_is_not_gated(monkeypatch, started, capsys):
    """Data parallelism runs a model whole, traced or not: a failed trace loses the estimate, not the run."""
    from autopar.errors import ModelError

    def untraceable(*args, **kwargs):
        raise ModelError("torch.export could not trace it")
    monkeypatch.setattr("autopar.trace.trace", untraceable)
    host_with(monkeypatch, 0.01)
    assert train("--model", "gpt-tiny", "--nproc", "2", "--steps", "1") == 0
    assert started == [("launch", 2)]
    assert train("--model", "gpt-tiny", "--nproc", "2", "--dry-run") == 0
    assert "memory not estimated: the model could not be traced on meta (torch.export could not trace it)" in \
        capsys.readouterr().out


def test_dry_run_under_torchrun_is_refused(monkeypatch, started):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match="--dry-run checks a run before autopar starts its processes"):
        train("--model", "gpt-tiny", "--dry-run")
    assert started == []


def _python_run(force: bool = False, **config):
    """A hand-set Trainer of gpt-mini (on meta: nothing allocated) on one process."""
    import torch

    from autopar import Strategy, Trainer, TrainConfig
    from autopar.data import CausalLMWindows, padded_vocab_size
    from autopar.models import build_model
    model, _ = build_model("gpt-mini", {}, vocab_size=padded_vocab_size(258), device="meta")
    data = CausalLMWindows(torch.zeros(4000, dtype=torch.long), 128)
    return Trainer(model, data, strategy=Strategy(), force=force,
                   config=TrainConfig(**{"steps": 1, "global_batch_size": 8, "micro_batch_size": 8, **config}))


def test_the_python_api_refuses_a_hand_set_run_that_cannot_fit(monkeypatch, capsys):
    """Trainer(...).train() with a strategy set by hand is held to the memory as `autopar train` is: refused before
    the process group or the engine exists, with the estimate per rank and a change that fits; force=True runs
    it (here: its checks pass, with a warning). A run far below the memory is not traced at all."""
    import torch.distributed as dist
    host_with(monkeypatch, 0.03)  # 30 MiB: gpt-mini's batch of 8 needs about 50
    with pytest.raises(ConfigError) as refused:
        _python_run().train()
    message = str(refused.value)
    assert "GPT with dp=1 tp=1 pp=1 does not fit" in message and "each rank: " in message
    assert "smallest change that fits: " in message and "Pass Trainer(..., force=True)" in message
    assert not dist.is_initialized()
    _python_run(force=True)._validate()
    assert "does not fit" in capsys.readouterr().out
    host_with(monkeypatch, 64)
    monkeypatch.setattr(memory_gate, "check_memory", lambda *a, **k: pytest.fail("a small run was traced"))
    _python_run(micro_batch_size=1, global_batch_size=1)._validate()
