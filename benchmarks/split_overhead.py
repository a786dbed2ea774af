"""The zero-bubble split's fixed cost in one process: a stage's fused backward B against I then W.

One thread, no ranks. A gpt-mini stage as zbv_breakdown.py runs it (6 layers, 4 x 64 tokens, vocabulary 320):
`last` is the second of 2 stages (zb-h1's stage 1, its loss inside), `middle` the third of 4 (a zbv stage fed an
output gradient). Per repeat, interleaved (order rotating), each variant runs forward (untimed) then its backward:

  B        torch.autograd.backward from the outputs, parameters' .grad accumulated, inputs' gradients asked
  I, W     pipeline/split_backward.py as the runtime calls it (one SplitPlanCache per stage, kept across repeats)

timed by time.perf_counter (wall) and time.thread_time (this thread's CPU: one thread does all of the backward),
with the thread's minor page faults. Every variant's input and parameter gradients are checked against B's.
Printed: medians of B, I, W and I + W (the median of each repeat's sum), (I + W) / B and (I + W) - B.

Page faults: depending on a loop's allocation history, glibc may hand the gradients I keeps for W back to the
system after each W and map them afresh in the next I. One such loop (F, B and I + W in turn, gradients set to
None) took about 1,500 faults a micro-batch in I and W (none in B) and (I + W) - B rose by about 1 ms; in the
pipeline itself zb-h1's I and W took none (zbv_breakdown.py with the actions' clock reading ru_minflt,
2026-11-26). So by default this loop asks glibc (mallopt) to keep freed memory, and prints the faults it sees;
--glibc-default measures with glibc's own thresholds.

--other SRC loads pipeline/split_plan.py and split_backward.py from another tree's src (e.g. main's) beside this
tree's, so a before/after pair is measured in the same run. --profile adds cProfile of this tree's I and W
(cumulative over the repeats, top functions by own time) and, from torch.profiler, the matmuls' time in B, I
and W by operand shape. --grouped
times W's weight matmuls that share a saved input (q, k, v) one by one against one matmul per group. --parts
times I and W by segment (the boundary walk, the structure key, each engine call, the weight-side rules, the
Python around them), beside B and I-alone (autograd.grad to the inputs with nothing captured), interleaved.

    PYTHONPATH=src python benchmarks/split_overhead.py [--stage last|middle|both] [--repeats 41]
        [--other /work/main/src] [--profile] [--parts] [--grouped] [--glibc-default] [--d-model 16 --seq 8 --mb 1]
    PYTHONPATH=src python benchmarks/split_overhead.py --quick    # smoke test: 4 layers of width 16, 3 repeats
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import importlib.util
import io
import os
import pstats
import resource
import statistics
import sys
import time
import types
from pathlib import Path

import torch

import autopar.pipeline.split_backward as this_split
import autopar.pipeline.split_plan as this_plan
from pipeline.common import Setup
from pipeline.zero_bubble import _local_setup


def load_other(src: str):
    """split_plan and split_backward from `src`/autopar/pipeline as a package of their own (relative import kept)."""
    folder = Path(src, "autopar", "pipeline")
    if not (folder / "split_backward.py").is_file():
        raise SystemExit(f"--other {src}: no autopar/pipeline/split_backward.py under it; pass a tree's src folder")
    package = types.ModuleType("split_other")
    package.__path__ = [str(folder)]
    sys.modules["split_other"] = package
    modules = {}
    for name in ("split_plan", "split_backward"):
        spec = importlib.util.spec_from_file_location(f"split_other.{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and the relative import look it up here
        spec.loader.exec_module(module)
        modules[name] = module
    return modules["split_backward"], modules["split_plan"]


def faults() -> int:
    """This thread's minor page faults so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def keep_heap() -> bool:
    """Ask glibc not to trim its heap nor to map large blocks apart (256 MiB thresholds); False off glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_TRIM_THRESHOLD, 256 << 20)) and bool(mallopt(M_MMAP_THRESHOLD, 256 << 20))


class Stage:
    """One stage module with a fixed input (the upstream stages' output) and, if not last, a fixed output gradient."""

    def __init__(self, setup: Setup, index: int, num_stages: int):
        batch = setup.batches(0)[0]
        self.module = setup.stage(index, num_stages)
        self.last = index == num_stages - 1
        acts = (batch["input_ids"],)
        with torch.no_grad():
            for s in range(index):
                acts = tuple(setup.stage(s, num_stages)(*acts))
        self.acts, self.labels, self.loss = acts, batch["labels"], setup.loss
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.grads = None
        if not self.last:
            _, outs = self.forward()
            gen = torch.Generator().manual_seed(1)
            self.grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]

    def forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(inputs needing a gradient, outputs needing one), as the runtime's _pairs picks them."""
        xs = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in self.acts)
        out = self.module(*xs)
        if self.last:
            outs = [self.loss(out, self.labels)]
        else:
            out = out if isinstance(out, tuple) else (out,)
            outs = [o for o in out if o.is_floating_point() and o.requires_grad]
        return [x for x in xs if x.requires_grad], outs

    def grad_outputs(self, outs):
        return [None] * len(outs) if self.grads is None else self.grads


def fused(stage: Stage):
    def run():
        xs, outs = stage.forward()
        f, w, c = faults(), time.perf_counter(), time.thread_time()
        torch.autograd.backward(outs, [torch.ones_like(o) if g is None else g
                                       for o, g in zip(outs, stage.grad_outputs(outs))])
        w, c = time.perf_counter() - w, time.thread_time() - c
        return (w, c, 0.0, 0.0, faults() - f, 0), [x.grad for x in xs]
    return run


def split(stage: Stage, module, plans):
    cache = plans.SplitPlanCache()  # one per stage, kept across repeats, as the runtime keeps it

    def run():
        xs, outs = stage.forward()
        f0, w0, c0 = faults(), time.perf_counter(), time.thread_time()
        got, work = module.backward_input(outs, stage.grad_outputs(outs), xs, stage.params, cache)
        w1, c1, f1 = time.perf_counter(), time.thread_time(), faults()
        module.backward_weight(work)
        w2, c2, f2 = time.perf_counter(), time.thread_time(), faults()
        return (w1 - w0, c1 - c0, w2 - w1, c2 - c1, f1 - f0, f2 - f1), got
    return run


def measure(stage: Stage, variants: dict, repeats: int, warmup: int = 3) -> dict:
    runs = {name: [] for name in variants}
    names, reference = list(variants), None
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            for p in stage.params:
                p.grad = None
            t, inputs = variants[name]()
            grads = [*inputs, *(p.grad for p in stage.params)]
            if name == "B":
                reference = [None if g is None else g.clone() for g in grads]
            elif reference is not None:
                for a, b in zip(reference, grads):
                    if (a is None) != (b is None) or (a is not None and not torch.allclose(a, b, rtol=1e-5, atol=1e-6)):
                        raise SystemExit(f"{name}: gradients differ from B's")
            if i >= warmup:
                runs[name].append(t)
    return runs


def report(label: str, runs: dict, repeats: int) -> list[str]:
    med = statistics.median
    lines = [f"{label}: medians of {repeats} (ms)",
             f"  {'variant':24s} {'clock':5s} {'B or I':>7s} {'W':>7s} {'I + W':>7s} {'(I+W)/B':>8s} {'(I+W)-B':>8s}"
             f"  page faults (B or I, W)"]
    for clock, k in (("wall", 0), ("cpu", 1)):
        b = med(t[k] for t in runs["B"])
        flt = lambda name: f"{med(t[4] for t in runs[name]):.0f}, {med(t[5] for t in runs[name]):.0f}"
        lines.append(f"  {'B (fused backward)':24s} {clock:5s} {b * 1e3:7.2f} {'':35s}{flt('B')}")
        for name in list(runs)[1:]:
            i, w = med(t[k] for t in runs[name]), med(t[k + 2] for t in runs[name])
            both = med(t[k] + t[k + 2] for t in runs[name])
            lines.append(f"  {name:24s} {clock:5s} {i * 1e3:7.2f} {w * 1e3:7.2f} {both * 1e3:7.2f} {both / b:8.3f} "
                         f"{(both - b) * 1e3:8.2f}  {flt(name)}")
    return lines


def profile(stage: Stage, repeats: int) -> str:
    """cProfile of this tree's I and of its W apart, over `repeats` runs each; the matmuls by pass."""
    cache = this_plan.SplitPlanCache()
    for _ in range(3):  # warm the plan cache as the runtime's is
        xs, outs = stage.forward()
        _, work = this_split.backward_input(outs, stage.grad_outputs(outs), xs, stage.params, cache)
        this_split.backward_weight(work)
    pi, pw, out = cProfile.Profile(), cProfile.Profile(), io.StringIO()
    for _ in range(repeats):
        for p in stage.params:
            p.grad = None
        xs, outs = stage.forward()
        pi.enable()
        _, work = this_split.backward_input(outs, stage.grad_outputs(outs), xs, stage.params, cache)
        pi.disable()
        pw.enable()
        this_split.backward_weight(work)
        pw.disable()
    for name, prof in (("I", pi), ("W", pw)):
        out.write(f"--- cProfile of {name}, {repeats} calls, by own time (cumulative times include callees)\n")
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    out.write(matmuls_by_pass(stage, cache, repeats))
    return out.getvalue()


def matmuls_by_pass(stage: Stage, cache, repeats: int) -> str:
    """torch.profiler over `repeats` rounds of B then I, W (record_function scopes): aten::mm's self CPU time
    per pass and operand shapes, so B's matmuls and the split's same matmuls are compared one by one."""
    scope = torch.profiler.record_function
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(repeats):
            for name in ("B", "split"):
                for p in stage.params:
                    p.grad = None
                xs, outs = stage.forward()
                grads = stage.grad_outputs(outs)
                if name == "B":
                    with scope("B"):
                        torch.autograd.backward(outs, [torch.ones_like(o) if g is None else g
                                                       for o, g in zip(outs, grads)])
                    continue
                with scope("I"):
                    _, work = this_split.backward_input(outs, grads, xs, stage.params, cache)
                with scope("W"):
                    this_split.backward_weight(work)
    spent: dict[tuple[str, str], float] = {}
    for event in prof.events():
        if event.name != "aten::mm":
            continue
        top = event
        while top.cpu_parent is not None:
            top = top.cpu_parent
        if top.name not in ("B", "I", "W"):
            continue  # the forward's
        key = (top.name, " x ".join(str(tuple(s)) for s in event.input_shapes[:2]))
        spent[key] = spent.get(key, 0.0) + event.self_cpu_time_total / repeats / 1e3
    lines = [f"--- aten::mm self CPU ms per micro-batch (torch.profiler, {repeats} rounds of B then I, W), by shape:"]
    for shape in sorted({k[1] for k in spent}):
        lines.append(f"  {shape:28s} " + "  ".join(f"{p} {spent[(p, shape)]:6.3f}" for p in "BIW" if (p, shape) in spent))
    total = {p: sum(v for (q, _), v in spent.items() if q == p) for p in "BIW"}
    lines.append(f"  total: B {total['B']:.3f}, I {total['I']:.3f} + W {total['W']:.3f} = "
                 f"{total['I'] + total['W']:.3f} ({(total['I'] + total['W']) / total['B']:.3f} of B's)")
    return "\n".join(lines) + "\n"


def parts(stage: Stage, repeats: int) -> list[str]:
    """Where I + W's time goes, by segment, interleaved with B and with I-alone (autograd.grad to the inputs,
    nothing captured): this tree's split with its helpers wrapped in timers (walk, structure_key, the engine
    calls, the weight-side rules), plus the rules run a second time straight after W on the same tensors
    ("hot": the cost of the matmuls on data in cache). Thread CPU time, medians of `repeats`."""
    clock, spent = time.thread_time, {}
    saved = {name: getattr(this_split, name) for name in ("walk", "structure_key", "_run_grad", "_run_backward")}
    saved_rules = dict(this_split._WEIGHT_SIDE_RULES)

    def timed(label, fn):
        def run(*args, **kw):
            start = clock()
            try:
                return fn(*args, **kw)
            finally:
                spent[label] = spent.get(label, 0.0) + clock() - start
        return run

    for name, label in (("walk", "walk"), ("structure_key", "key"), ("_run_grad", "I engine"),
                        ("_run_backward", "W engine")):
        setattr(this_split, name, timed(label, saved[name]))
    for name, rule in saved_rules.items():
        this_split._WEIGHT_SIDE_RULES[name] = timed("W rules", rule)
    cache, runs = this_plan.SplitPlanCache(), {}  # a fresh cache: its layouts hold the wrapped rules

    def fused():
        xs, outs = stage.forward()
        grads = [torch.ones_like(o) if g is None else g for o, g in zip(outs, stage.grad_outputs(outs))]
        start = clock()
        torch.autograd.backward(outs, grads)
        return {"B": clock() - start}

    def inputs_only():
        xs, outs = stage.forward()
        grads = [torch.ones_like(o) if g is None else g for o, g in zip(outs, stage.grad_outputs(outs))]
        start = clock()
        torch.autograd.grad(outs, xs, grads, retain_graph=True)
        return {"I-alone": clock() - start}

    def split():
        xs, outs = stage.forward()
        spent.clear()
        start = clock()
        _, work = this_split.backward_input(outs, stage.grad_outputs(outs), xs, stage.params, cache)
        middle = clock()
        items = [(item, g) for item, g in zip(work.layout.items, work.kept) if item.rule is not None]
        this_split.backward_weight(work)
        end = clock()
        row = {**spent, "I": middle - start, "W": end - middle}
        again = clock()
        for item, g in items:
            saved_rules[type(work.nodes[item.node]).__name__](work.nodes[item.node], g, item.edges)
        row["W rules, hot"] = clock() - again
        row["I other Python"] = row["I"] - row["walk"] - row["key"] - row["I engine"]
        row["W other Python"] = row["W"] - row.get("W rules", 0.0) - row["W engine"]
        return row

    try:
        variants = [fused, inputs_only, split]
        for i in range(3 + repeats):
            for fn in variants[i % 3:] + variants[:i % 3]:
                for p in stage.params:
                    p.grad = None
                row = fn()
                if i >= 3:
                    for k, v in row.items():
                        runs.setdefault(k, []).append(v)
    finally:
        for name, fn in saved.items():
            setattr(this_split, name, fn)
        this_split._WEIGHT_SIDE_RULES.update(saved_rules)
    med = {k: statistics.median(v) * 1e3 for k, v in runs.items()}
    order = ["B", "I-alone", "I", "walk", "key", "I engine", "I other Python", "W", "W rules", "W rules, hot",
             "W engine", "W other Python"]
    return [f"  by segment, thread CPU ms, medians of {repeats} (B, I-alone and I + W interleaved):",
            "    " + ", ".join(f"{k} {med[k]:.3f}" for k in order[:3]),
            "    I: " + ", ".join(f"{k} {med[k]:.3f}" for k in order[3:7]),
            "    W: " + ", ".join(f"{k} {med[k]:.3f}" for k in order[7:])]


def grouped(stage: Stage, repeats: int) -> list[str]:
    """W's weight matmuls that read the same saved input (q, k and v read one layer norm's output): one per item
    (as W issues them) against one matmul over the items' gradients concatenated, on the gradients I kept;
    the grouped result checked against the per-item one. Medians of `repeats`, interleaved."""
    cache = this_plan.SplitPlanCache()
    xs, outs = stage.forward()
    _, work = this_split.backward_input(outs, stage.grad_outputs(outs), xs, stage.params, cache)
    by_input: dict[int, list] = {}
    for item, g in zip(work.layout.items, work.kept):
        node = work.nodes[item.node]
        if type(node).__name__ == "AddmmBackward0" and g is not None and item.edges == (2,):
            by_input.setdefault(node._saved_mat1.data_ptr(), []).append((node._saved_mat1, g, node._saved_mat2))
    groups = [v for v in by_input.values() if len(v) > 1]
    if not groups:
        return ["  no weight matmuls share an input"]

    def apart():
        return [this_split._weight_grad(x, g, w) for group in groups for x, g, w in group]

    def together():
        out = []
        for group in groups:
            x, sizes = group[0][0], [g.shape[-1] for _, g, _ in group]
            out += list(torch.cat([g for _, g, _ in group], dim=-1).mH.__matmul__(x).split(sizes))
        return out

    times = {"apart": [], "together": []}
    for i in range(3 + repeats):
        for name, fn in (("apart", apart), ("together", together))[::1 if i % 2 else -1]:
            start = time.thread_time()
            got = fn()
            if i >= 3:
                times[name].append(time.thread_time() - start)
            if name == "together":
                want = [w.mH for w in apart()]
                assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(want, got))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    shapes = ", ".join(f"{len(g)} x {tuple(g[0][1].shape)}" for g in groups)
    return [f"  weight matmuls sharing an input ({len(groups)} groups: {shapes}), thread CPU ms, medians of {repeats}:",
            f"    one matmul per item {med['apart']:.2f}, one per group over concatenated gradients "
            f"{med['together']:.2f} ({med['together'] / med['apart']:.3f})"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=["last", "middle", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=41, help="timed repeats per variant (default 41)")
    parser.add_argument("--layers", type=int, default=6, help="gpt-mini n_layer, at least 4 (default 6)")
    parser.add_argument("--d-model", type=int, default=None, help="gpt-mini d_model (default 128)")
    parser.add_argument("--mb", type=int, default=4, help="sequences per micro-batch (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--other", default=None, help="another tree's src folder, measured beside this one")
    parser.add_argument("--profile", action="store_true", help="cProfile and torch.profiler of this tree's I, W")
    parser.add_argument("--parts", action="store_true",
                        help="time I and W by segment (walk, key, engine calls, rules) beside B and I-alone")
    parser.add_argument("--grouped", action="store_true",
                        help="time W's matmuls sharing an input one by one against one matmul per group")
    parser.add_argument("--glibc-default", action="store_true",
                        help="leave glibc's heap trimming on (the loop then takes page faults the pipeline does not)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 4 layers, d_model 16, 1 x 8 tokens, "
                        "3 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.seq, args.mb, args.repeats = 4, 16, 8, 1, 3
    if args.layers < 4 or args.repeats < 1:
        parser.error(f"need --layers >= 4 (4 stages) and --repeats >= 1; got {args.layers}, {args.repeats}")
    torch.set_num_threads(1)
    heap = "glibc defaults" if args.glibc_default else ("heap kept (mallopt)" if keep_heap() else
                                                         "glibc defaults (mallopt unavailable)")
    args.vocab, args.m = 320, 8
    args.model_args = {"n_layer": args.layers, **({"d_model": args.d_model} if args.d_model else {})}
    setup = Setup.__new__(Setup)
    _local_setup(setup, args)
    other = load_other(args.other) if args.other else None
    print(f"$ python benchmarks/split_overhead.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"torch {torch.__version__}, 1 thread, {os.cpu_count()} cores, {heap} | load average (1 min) at start "
          f"{os.getloadavg()[0]:.2f}")
    begin = time.perf_counter()
    cases = {"last": ("zb-h1's stage 1 of 2 (loss inside)", 1, 2), "middle": ("zbv's stage 2 of 4", 2, 4)}
    for key in (["last", "middle"] if args.stage == "both" else [args.stage]):
        label, index, num_stages = cases[key]
        stage = Stage(setup, index, num_stages)
        variants = {"B": fused(stage), "I, W (this tree)": split(stage, this_split, this_plan)}
        if other is not None:
            variants["I, W (--other)"] = split(stage, *other)
        print("\n".join(report(label, measure(stage, variants, args.repeats), args.repeats)))
        if args.parts:
            print("\n".join(parts(stage, args.repeats)))
        if args.grouped:
            print("\n".join(grouped(stage, args.repeats)))
        if args.profile:
            print(profile(stage, args.repeats))
    print(f"load average (1 min) at end {os.getloadavg()[0]:.2f}; wall time {time.perf_counter() - begin:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
