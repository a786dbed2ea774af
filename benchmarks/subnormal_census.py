"""Count subnormal (denormal) floats a training run computes with, per rank and optimizer step.

Why: CPU kernels run many times slower on subnormal numbers, and a schedule whose compute
hits them looks slow for a reason that has nothing to do with the schedule. This census says
whether, and where, a run produces them. It is a diagnostic, not part of autopar: a rank imports
it at start-up (benchmarks/async_pipeline.py --count-subnormals writes a sitecustomize that does)
when SUBNORMAL_CENSUS_DIR is set, and it writes one JSON line per optimizer step to
SUBNORMAL_CENSUS_DIR/rank{RANK}.jsonl with the non-zero counts of:

- `op:NAME`: elements of the outputs of every aten op (forward, backward and optimizer ops),
  counted by a dispatch mode entered at the first stage forward (after model tracing), so ops
  before it are not seen; ops that only allocate (empty and friends) are left out, since
  uninitialised memory is not a computed value;
- `backward_grad_in`: the gradients handed to autograd.backward (received from the next stage);
- `module_in:CLASS`: the inputs of every module call (received activations included);
- `param`, `grad`, `state.KEY`: after each optimizer step, over the optimizer's parameters;
- `older`: PipeDream-2BW's older weight version (`pipeline/weight_versions.py`).

In-place foreach updates return nothing, so the optimizer's in-place results are covered by
the `param` and `state` counts, not by `op:`. Counting slows a run several times: never time one.
"""

from __future__ import annotations

import atexit
import json
import os
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

ALLOCATING = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def subnormals(t) -> int:
    """Non-zero elements smaller in magnitude than the dtype's smallest normal number."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or not t.is_floating_point() or t.device.type == "meta" \
            or t.numel() == 0:
        return 0
    with torch.no_grad(), _disable_current_modes():
        return int(((t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)).sum())


def tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensors(y)


class Census(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in ALLOCATING:
            for t in tensors(out):
                self.counts[f"op:{name}"] += subnormals(t)
        return out


def install(folder: str, rank: str) -> None:
    counts: Counter = Counter()
    records: list[dict] = []
    versions: list = []  # the 2BW version holders, found on the first optimizer step
    scanned = []
    started = []

    def before_forward(module, args):
        if not started and type(module).__name__ == "StageModule" and not torch.compiler.is_compiling() \
                and all(type(t) is torch.Tensor for t in tensors(args)):
            started.append(Census(counts))
            started[0].__enter__()  # stays on for the rest of the run

    def after_forward(module, args, out):
        if started and not torch.compiler.is_compiling():
            for t in tensors(args):
                counts[f"module_in:{type(module).__name__}"] += subnormals(t)

    torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
    torch.nn.modules.module.register_module_forward_hook(after_forward)

    plain_backward = torch.autograd.backward

    def backward(outputs, grad_tensors=None, *args, **kwargs):
        for g in tensors(grad_tensors):
            counts["backward_grad_in"] += subnormals(g)
        return plain_backward(outputs, grad_tensors, *args, **kwargs)

    torch.autograd.backward = backward

    def after_step(optimizer, args, kwargs):
        record = {"step": len(records) + 1}
        for group in optimizer.param_groups:
            for p in group["params"]:
                counts["param"] += subnormals(p)
                counts["grad"] += subnormals(p.grad)
                for key, value in optimizer.state.get(p, {}).items():
                    counts[f"state.{key}"] += subnormals(value)
        if not scanned:
            import gc
            import warnings

            from autopar.pipeline.weight_versions import TwoWeightVersions
            with warnings.catch_warnings():  # isinstance on some module objects warns of deprecations
                warnings.simplefilter("ignore")
                versions.extend(o for o in gc.get_objects() if isinstance(o, TwoWeightVersions))
            scanned.append(True)
        for holder in versions:
            counts["older"] += sum(subnormals(b) for b in holder.older())
        record.update({k: v for k, v in sorted(counts.items()) if v})
        counts.clear()
        records.append(record)

    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(after_step)

    @atexit.register
    def write() -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{rank}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


if os.environ.get("SUBNORMAL_CENSUS_DIR") and os.environ.get("RANK") is not None:
    install(os.environ["SUBNORMAL_CENSUS_DIR"], os.environ["RANK"])
