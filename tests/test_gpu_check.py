"""benchmarks/gpu_check.py: without CUDA it measures nothing and says so; its pieces import.

The measurements themselves need a GPU; on CPU the script's functions were
run once by hand with gpt-tiny, not here: they train several models."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_measures_nothing_and_exits_0(monkeypatch, capsys):
    gpu_check = load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.strip() == "no CUDA device: nothing measured"


def test_its_pieces_are_there():
    gpu_check = load()
    for name in ("compare_with_eager", "strategies_match_cpu", "block_time_errors", "memory_errors",
                 "eager_step_seconds", "trainer_run", "measured_block_seconds"):
        assert callable(getattr(gpu_check, name)), name
    assert gpu_check.device_preset("NVIDIA H100 80GB HBM3").name == "h100-80gb"
    assert gpu_check.device_preset("NVIDIA H200").flops_per_s["bf16"] == 989e12  # H100's compute
    assert gpu_check.device_preset("Some Other Accelerator") is None
