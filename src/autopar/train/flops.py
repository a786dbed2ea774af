"""Model FLOPs per step, TFLOP/s per device and MFU (model FLOPs utilisation).

    model FLOPs per step   = 3 x forward FLOPs of one sample x global batch size
                             (backward = 2 x forward: the gradients of the inputs and of the weights)
    TFLOP/s per device     = model FLOPs per step / step time / devices / 1e12
    MFU                    = TFLOP/s per device x 1e12 / peak FLOP/s of one device
    recomputation          = forward FLOPs run again in backward, reported apart and never in MFU

The forward FLOPs are counted by torch's flop counter (torch.utils.flop_counter, the counter
trace/graph.py costs every traced node with) over one forward of the model on meta tensors of one
sample: no data is read and nothing is allocated. Matmuls, convolutions and attention are counted;
elementwise work is not, as in every MFU figure. The same step time and FLOPs on any layout give the
same MFU, so layouts compare on it. The peak comes from search/device_peak.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import default_collate
from torch.utils.flop_counter import FlopCounterMode

from .loss import Batch, as_batch


class _Call(nn.Module):
    """The user's forward as a module, so that functional_call can swap every tensor of the model for meta."""

    def __init__(self, model: nn.Module, forward_fn: Callable[[nn.Module, Batch], Any]):
        super().__init__()
        self.model, self.forward_fn = model, forward_fn

    def forward(self, batch: Batch) -> Any:
        return self.forward_fn(self.model, batch)


def forward_flops_per_sample(model: nn.Module, forward_fn: Callable[[nn.Module, Batch], Any], sample: Any
                             ) -> int | None:
    """Forward FLOPs of `forward_fn(model, batch of sample)`, on meta copies of the model's tensors and the sample's:
    the model itself (meta or real) is not touched. None when the model cannot run on meta tensors."""
    call = _Call(model, forward_fn)
    meta = lambda t: torch.empty_like(t, device="meta")  # noqa: E731
    tensors = {name: meta(t) for name, t in [*call.named_parameters(remove_duplicate=False),
                                              *call.named_buffers(remove_duplicate=False)]}
    batch = {k: meta(v) if isinstance(v, torch.Tensor) else v for k, v in default_collate([as_batch(sample)]).items()}
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), FlopCounterMode(display=False) as counter:
            functional_call(call, tensors, (batch,), tie_weights=False, strict=False)
    except Exception:  # an estimate: a model that only runs on real tensors gets no MFU, and still trains
        return None
    return int(counter.get_total_flops())


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
