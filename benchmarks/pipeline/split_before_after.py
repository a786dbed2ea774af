"""I + W against B for two versions of pipeline/split_backward.py in one process, timings interleaved.

One stage (the second of 2) of part 5a's gpt-mini (6 layers, d=128, 4 x 64 tokens), one thread; each
repeat runs B, then I + W with this tree's module (with the plan cache the runtime keeps, and without
one when the module takes it), then I + W with the module at OLD (a file, e.g. from
`git show 03f91fc:src/autopar/pipeline/split_backward.py > /tmp/old_split.py`); every variant's
parameter gradients are checked against B's. Medians of REPEATS after 2 warm-ups, of wall time and of
the thread's CPU time (one thread: all of the backward runs on it; on a loaded machine CPU time leaves
out the waits for a core, though not the cache another process evicts).

    PYTHONPATH=src:benchmarks python benchmarks/pipeline/split_before_after.py /tmp/old_split.py [REPEATS] [OPTIONS]
    PYTHONPATH=src python benchmarks/pipeline/split_before_after.py --quick   # smoke test: this tree against itself

OPTIONS are pipeline_schedules.py's model options (e.g. `--d-model 16 --seq 8 --mb 1`: kernels too small
to matter, so what is left of I + W - B is the split's fixed overhead).
"""

from __future__ import annotations

import importlib.util
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: pipeline.*, pipeline_schedules

import autopar.pipeline.split_backward as current  # noqa: E402
from pipeline.common import Setup  # noqa: E402
from pipeline.zero_bubble import _local_setup  # noqa: E402
from pipeline_schedules import parse_args  # noqa: E402


def _load(path: str):
    # inside autopar.pipeline, so that the file's relative imports (split_plan, ...) find this tree's modules
    spec = importlib.util.spec_from_file_location("autopar.pipeline.split_backward_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def main(old_path: str, repeats: int, options: list[str]) -> None:
    torch.set_num_threads(1)
    old = _load(old_path)
    args = parse_args(["--parts", "5", *options])
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
        begin, cpu = time.perf_counter(), time.thread_time()
        loss.backward()
        return time.perf_counter() - begin, 0.0, time.thread_time() - cpu, 0.0

    def split(module, cached=False):
        kw = {"cache": module.SplitPlanCache()} if cached else {}
        def run():
            xs, loss = forward()
            begin, cpu = time.perf_counter(), time.thread_time()
            _, work = module.backward_input([loss], [None], xs, params, **kw)
            middle, cpu_middle = time.perf_counter(), time.thread_time()
            module.backward_weight(work)
            return middle - begin, time.perf_counter() - middle, cpu_middle - cpu, time.thread_time() - cpu_middle
        return run

    variants = [("B", fused), ("new", split(current))]
    if "cache" in inspect.signature(current.backward_input).parameters:
        variants = [("B", fused), ("new", split(current, cached=True)), ("new, uncached", split(current))]
    variants.append(("old", split(old)))
    runs, reference = {name: [] for name, _ in variants}, None
    for i in range(repeats + 2):
        for name, fn in variants:
            for p in params:
                p.grad = None
            t = fn()
            if i >= 2:
                runs[name].append(t)
            grads = [p.grad.clone() for p in params]
            reference = reference or grads
            if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(reference, grads)):
                raise SystemExit(f"{name}: parameter gradients differ from B's")
    for clock, first in (("wall", 0), ("thread CPU", 2)):
        b = statistics.median(t[first] for t in runs["B"])
        print(f"{clock} time, medians of {repeats}:")
        print(f"  {'B (fused backward)':21s}{b * 1e3:7.2f} ms")
        for name in list(runs)[1:]:
            i = statistics.median(t[first] for t in runs[name])
            w = statistics.median(t[first + 1] for t in runs[name])
            print(f"  {'I + W (' + name + ')':21s}{(i + w) * 1e3:7.2f} ms   (I {i * 1e3:.2f} + W {w * 1e3:.2f})  "
                  f"ratio to B {(i + w) / b:.3f}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--quick"]:  # this tree's module as OLD too, kernels too small to matter, 2 repeats
        main(current.__file__, 2, ["--d-model", "16", "--seq", "8", "--mb", "1"])
    else:
        main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 31, sys.argv[3:])
