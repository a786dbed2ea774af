"""I + W against B for two versions of pipeline/split_backward.py in one process, timings interleaved.

One stage (the second of 2) of part 5a's gpt-mini (6 layers, d=128, 4 x 64 tokens), one thread; each
repeat runs B, then I + W with this tree's module, then I + W with the module at OLD (a file, e.g. from
`git show 03f91fc:src/autopar/pipeline/split_backward.py > /tmp/old_split.py`); every variant's
parameter gradients are checked against B's. Medians of REPEATS after 2 warm-ups.

    PYTHONPATH=src:benchmarks python benchmarks/pipeline/split_before_after.py /tmp/old_split.py [REPEATS]
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import torch

import autopar.pipeline.split_backward as current
from pipeline.common import Setup
from pipeline.zero_bubble import _local_setup
from pipeline_schedules import parse_args


def _load(path: str):
    spec = importlib.util.spec_from_file_location("split_backward_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def main(old_path: str, repeats: int) -> None:
    torch.set_num_threads(1)
    old = _load(old_path)
    args = parse_args(["--parts", "5"])
    args.model_args = {**args.model_args, "n_layer": 6}
    setup = Setup.__new__(Setup)
    _local_setup(setup, args)
    first, stage = setup.stage(0, 2), setup.stage(1, 2)
    batch = setup.batches(0)[0]
    with torch.no_grad():
        acts = tuple(first(batch["input_ids"]))
    params = [p for p in stage.parameters() if p.requires_grad]

    def forward():
        xs = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in acts)
        return [x for x in xs if x.requires_grad], setup.loss(stage(*xs), batch["labels"])

    def fused():
        _, loss = forward()
        begin = time.perf_counter()
        loss.backward()
        return time.perf_counter() - begin, 0.0

    def split(module):
        def run():
            xs, loss = forward()
            begin = time.perf_counter()
            _, work = module.backward_input([loss], [None], xs, params)
            middle = time.perf_counter()
            module.backward_weight(work)
            return middle - begin, time.perf_counter() - middle
        return run

    runs, reference = {"B": [], "new": [], "old": []}, None
    for i in range(repeats + 2):
        for name, fn in (("B", fused), ("new", split(current)), ("old", split(old))):
            for p in params:
                p.grad = None
            t = fn()
            if i >= 2:
                runs[name].append(t)
            grads = [p.grad.clone() for p in params]
            reference = reference or grads
            if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(reference, grads)):
                raise SystemExit(f"{name}: parameter gradients differ from B's")
    b = statistics.median(t[0] for t in runs["B"])
    print(f"B (fused backward)  {b * 1e3:7.2f} ms   medians of {repeats}")
    for name in ("new", "old"):
        i = statistics.median(t[0] for t in runs[name])
        w = statistics.median(t[1] for t in runs[name])
        print(f"I + W ({name})        {(i + w) * 1e3:7.2f} ms   (I {i * 1e3:.2f} + W {w * 1e3:.2f})  ratio to B {(i + w) / b:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 31)
