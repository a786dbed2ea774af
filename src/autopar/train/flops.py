"""Model FLOPs per step, TFLOP/s per device and MFU (model FLOPs utilisation).

    model FLOPs per step   = 3 x forward FLOPs of one sample x global batch size
                             (backward = 2 x forward: the gradients of the inputs and of the weights)
    TFLOP/s per device     = model FLOPs per step / step time / devices / 1e12
    MFU                    = TFLOP/s per device x 1e12 / peak FLOP/s of one device
    recomputation          = forward FLOPs run again in backward, reported apart and never in MFU

The forward FLOPs are counted by torch's flop counter (torch.utils.flop_counter, the counter
trace/graph.py costs every traced node with) over one forward of a copy of the model on fake tensors
of one sample, as torch.export traces: no data is read and nothing is allocated. Matmuls,
convolutions and attention are counted; elementwise work is not, as in every MFU figure. The same step time and FLOPs on any layout give the
same MFU, so layouts compare on it. The peak comes from search/device_peak.py.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import default_collate
from torch.utils.flop_counter import FlopCounterMode

from .._torch_internals import fake_tensor_mode
from ..models.hf import turn_off_kv_cache
from .loss import Batch, as_batch


def meta_copy(model: nn.Module, as_fake: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> nn.Module:
    """The model with every parameter and buffer replaced by an empty meta tensor of its shape (made fake by
    `as_fake`): nothing the count's forward does (a cache a module fills on its first call) reaches the model
    that trains, and no weight is copied."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        empty = as_fake(torch.empty_like(tensor, device="meta"))
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def forward_flops_per_sample(model: nn.Module, forward_fn: Callable[[nn.Module, Batch], Any], sample: Any
                             ) -> int | None:
    """Forward FLOPs of `forward_fn(model, batch of sample)`, run on a copy of the model and the sample whose
    tensors are fake (shapes only, as torch.export traces with): the model itself, meta or real, is not touched.
    Fake rather than plain meta tensors, because model code that reads its data skips those reads for them (a
    Hugging Face mask checks its positions unless traced). None when the model cannot run so."""
    mode = fake_tensor_mode()
    as_fake = (lambda t: t) if mode is None else mode.from_tensor
    try:
        copied = meta_copy(model, as_fake)
        turn_off_kv_cache(copied)  # a key/value cache made inside the count is plain meta, which fake mode refuses
        real = default_collate([as_batch(sample)])  # (outside the fake mode, which refuses real tensors)
        with mode or contextlib.nullcontext():
            batch = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
                     for k, v in real.items()}
            with torch.random.fork_rng(devices=[]), torch.no_grad(), FlopCounterMode(display=False) as counter:
                forward_fn(copied, batch)
        return int(counter.get_total_flops())
    except Exception:  # an estimate: a model that cannot run on shapes alone gets no MFU, and still trains
        return None


@dataclass(frozen=True)
class StepFlops:
    """What one optimizer step computes, and the device peak it is measured against."""

    model_flops: float  # 3 x forward FLOPs of the global batch
    recompute_flops: float  # forward FLOPs run again in backward (not in MFU)
    devices: int
    peak_flops_per_device: float | None  # None: no trusted peak, TFLOP/s only
    peak_source: str

    @classmethod
    def of(cls, forward_per_sample: float, global_batch_size: int, *, devices: int, recomputed_fraction: float = 0.0,
           peak_flops_per_device: float | None, peak_source: str) -> StepFlops:
        forward = forward_per_sample * global_batch_size
        return cls(model_flops=3 * forward, recompute_flops=recomputed_fraction * forward, devices=devices,
                   peak_flops_per_device=peak_flops_per_device, peak_source=peak_source)

    def rates(self, seconds: float) -> dict[str, float]:
        """The record's throughput fields for `seconds` of stepping (one step's time, or a run's sum of them, with
        the FLOPs of as many steps: `times(steps)`)."""
        per_device = self.model_flops / seconds / self.devices
        out = {"tflops_per_device": per_device / 1e12}
        if self.peak_flops_per_device:
            out["mfu"] = per_device / self.peak_flops_per_device
        if self.recompute_flops:
            out["recompute_tflops_per_device"] = self.recompute_flops / seconds / self.devices / 1e12
        return out

    def times(self, steps: int) -> StepFlops:
        return StepFlops(self.model_flops * steps, self.recompute_flops * steps, self.devices,
                         self.peak_flops_per_device, self.peak_source)

    def describe(self) -> str:
        """The banner's line: what a step computes and the peak MFU is taken against."""
        peak = (f"{self.peak_flops_per_device / 1e12:.3g} TFLOP/s per device ({self.peak_source})"
                if self.peak_flops_per_device else f"none: {self.peak_source}, so no MFU")
        again = f", recomputation {self.recompute_flops / 1e12:.3g} TFLOP apart" if self.recompute_flops else ""
        return f"model FLOPs per step: {self.model_flops / 1e12:.3g} TFLOP (3 x forward){again}; MFU peak: {peak}"
