"""What --compile buys on this machine, measured on one block: for a planner pricing compiled layouts.

A step's time under --compile is the blocks' forward and backward compiled (train/compile.py) plus the
optimizer update as torch's fused kernel (train/optim.py); the rest (embeddings, loss, collectives)
runs as eagerly. So two ratios price it, each measured on this machine rather than assumed, since they
depend on the CPU or GPU, the width and the thread count:

- `block`: compiled / eager seconds of one block's forward + backward (on CPU near 1 for wide blocks,
  whose matrix products are the same kernels either way; below 1 where element-wise work counts);
- `update`: fused / foreach seconds of the optimizer update over the block's parameters (~0.25 on
  gpt-small's CPU thread: the update is ~10 element-wise passes per parameter that fusing makes one);

and one cost, `compile_s`, the seconds the first compiled call took (cold, or from inductor's cache,
as found: a run pays it once, in its first steps). Times are process CPU seconds, medians of
interleaved calls, so other jobs on a shared machine move them less than wall time.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import TrainConfig
from .compile import compile_forward, use_inductor_cache
from .optim import build_optimizer


@dataclass(frozen=True)
class CompileSpeedup:
    """Compiled / eager time ratios measured on one block (see the module's docstring)."""

    block: float  # forward + backward, compiled / eager
    update: float  # optimizer update, fused / foreach
    compile_s: float  # the block's first compiled forward + backward (compile, or load from the cache)
    backend: str

    def step_seconds(self, *, blocks_s: float, update_s: float, other_s: float = 0.0) -> float:
        """An eager step's parts (blocks' forward + backward, update, everything else), priced compiled."""
        return blocks_s * self.block + update_s * self.update + other_s


def measure_compile_speedup(block: nn.Module, example: torch.Tensor, *, backend: str = "inductor",
                            optimizer: str = "adamw", repeats: int = 5) -> CompileSpeedup:
    """Time `block` (called on `example`, e.g. [micro-batch, seq, width] activations) eager and compiled, and its
    optimizer update foreach and fused; the block itself is left as it was (copies are timed)."""
    use_inductor_cache()
    eager, compiled = copy.deepcopy(block), copy.deepcopy(block)
    compile_forward(compiled, backend)
    x = example.detach().requires_grad_()

    def pass_of(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            out = module(x)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()
            module.zero_grad(set_to_none=False)
        return run

    began = time.perf_counter()
    pass_of(compiled)()
    compile_s = time.perf_counter() - began
    passes = {"eager": pass_of(eager), "compiled": pass_of(compiled)}
    updates = {}
    for kind in ("foreach", "fused"):
        for p in eager.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        updates[kind] = build_optimizer(eager, TrainConfig(optimizer_kernel=kind, optimizer=optimizer)).step
    block_times = _interleaved_cpu_seconds(passes, repeats)
    update_times = _interleaved_cpu_seconds(updates, repeats)
    return CompileSpeedup(block=block_times["compiled"] / block_times["eager"],
                          update=update_times["fused"] / update_times["foreach"], compile_s=compile_s, backend=backend)


def _interleaved_cpu_seconds(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median process CPU seconds of each call, the calls alternating (drift on the machine hits each alike)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(repeats + 1):
        for name in (names if r % 2 == 0 else names[::-1]):
            began = time.process_time()
            calls[name]()
            if r:  # the first round warms up
                times[name].append(time.process_time() - began)
    return {name: max(statistics.median(t), 1e-9) for name, t in times.items()}
