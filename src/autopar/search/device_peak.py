"""The peak FLOP/s of one training device, the denominator of MFU, and where the figure comes from.

On a GPU: the datasheet's dense rate of the cluster preset that matches the device's name (cluster.py;
an unknown GPU gets no MFU, only its TFLOP/s). On a CPU there is no datasheet to trust: the figure of
the cluster a user named (--cluster or $AUTOPAR_CLUSTER), else this machine's cached calibration
(`autopar calibrate`, calibration_cache.py), else one thread's matmul rate measured now (a rank
runs one thread: launch.py). A user's --cluster also overrides the GPU lookup.
"""

from __future__ import annotations

import os

import torch

from .calibration_cache import CLUSTER_ENV, lookup
from .cluster import preset, resolve_cluster

# A name CUDA reports -> the preset with its datasheet figures. H200 has H100 SXM5's compute (NVIDIA's datasheets:
# 67 TFLOPS fp32, 989 TFLOPS bf16 dense); H100 PCIe is slower and has no entry (no MFU rather than a wrong one).
GPU_PRESETS = (("H100 PCIe", None), ("H100", "h100-80gb"), ("H200", "h100-80gb"), ("A100", "a100-80gb"),
               ("V100", "v100-32gb-nvlink"), ("3090", "rtx3090-24gb-pcie"))


def precision_of(dtype: str) -> str:
    """The rate a run's --dtype computes at: bf16 for bf16 and bf16-autocast, else fp32."""
    return "bf16" if dtype.startswith("bf16") else "fp32"


def device_peak(device: torch.device, dtype: str, *, world: int, cluster: str | None = None
                ) -> tuple[float | None, str]:
    """(peak FLOP/s of one device at the run's precision or None, what the figure is)."""
    precision = precision_of(dtype)
    spec = cluster or os.environ.get(CLUSTER_ENV)
    if spec:
        named = resolve_cluster(spec)
        return named.flops_per_s.get(precision), f"cluster {spec!r} ({named.source}), {precision}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        match = next((entry for key, entry in GPU_PRESETS if key in name), None)
        if match is None:
            return None, f"no datasheet figure for {name!r} (give --cluster FILE with its flops_per_s)"
        return preset(match).flops_per_s[precision], f"{name}: {preset(match).source.split(';')[0]}, {precision}"
    cached = lookup(world)
    if cached is not None:
        return cached[0].flops_per_s.get(precision), f"{cached[0].source}, {precision} matmul rate of one thread"
    from .calibrate import matmul_rate
    rate = matmul_rate(torch.bfloat16 if precision == "bf16" else torch.float32)
    return rate, (f"one thread's {precision} matmul rate measured at the start of this run (`autopar calibrate "
                  f"--nproc {world}` measures it once, on a quiet machine)")
