"""Count, on CPU, the calls that would make the host wait for a GPU (run by the rank pool).

A TorchFunctionMode sees every tensor method the code calls; the ones that copy a value to
the host (.item(), .tolist(), .cpu(), .numpy(), bool()/float()/int() of a tensor, printing
one) stall a GPU's queue of work. On CPU they cost nothing, so they are found only by
counting. Only autopar's own direct calls count, attributed to the calling function: reads
inside torch (the optimizer's step counter, which torch keeps on the CPU) are torch's choice,
and the data sampler's index tensors live on the CPU by design.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

import autopar
from helpers import train_builtin

HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__repr__",
              "__format__"}
_AUTOPAR = os.path.dirname(autopar.__file__)
_TORCH = os.path.dirname(torch.__file__)


_TENSOR_FILES = {os.path.join(_TORCH, "_tensor.py"), os.path.join(_TORCH, "overrides.py")}
HOST_SIDE_BY_DESIGN = {"data/sampler.py"}  # sample indices: a CPU generator's permutation, never on the GPU


class HostSyncCounter(TorchFunctionMode):
    """Records (step, 'path/in/autopar.py:function', method) for every host read autopar code makes."""

    def __init__(self):
        super().__init__()
        self.step = -1
        self.calls: list[tuple[int, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            where = _autopar_caller()
            if where is not None:
                self.calls.append((self.step, where, name))
        return func(*args, **kwargs)

    def per_step(self, step: int) -> Counter:
        return Counter(f"{where} {name}" for s, where, name in self.calls if s == step)


def _autopar_caller() -> str | None:
    """'relative/path.py:function' of the code calling the tensor method, if that code is autopar's."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _TENSOR_FILES:  # Python-level Tensor methods
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(_AUTOPAR):
        return None
    path = os.path.relpath(frame.f_code.co_filename, _AUTOPAR)
    return None if path in HOST_SIDE_BY_DESIGN else f"{path}:{frame.f_code.co_name}"


def count_host_syncs(out: str, strategies: list[dict], steps: int = 3) -> list[dict[str, int]]:
    """Train gpt-tiny under each strategy, counting host reads; returns step 1's counts per strategy
    (step 0 may set up once, e.g. pipeline metadata; step 1 writes no metrics, runs no eval)."""
    from autopar.train.steps import SynchronousSteps

    results = []
    for i, strategy in enumerate(strategies):
        counter = HostSyncCounter()
        inner = SynchronousSteps.run

        def counted(self, step, *args, inner=inner, counter=counter, **kwargs):
            counter.step = step
            return inner(self, step, *args, **kwargs)

        SynchronousSteps.run = counted
        try:
            with counter:
                train_builtin("gpt-tiny", f"{out}/{i}", model_args={"n_layer": 2}, strategy=strategy, steps=steps,
                              log_every=steps, eval_every=0, checkpoint_every=0)
        finally:
            SynchronousSteps.run = inner
        results.append(dict(counter.per_step(1)))
    return results
