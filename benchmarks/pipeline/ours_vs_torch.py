"""Study 1: our gpipe and 1f1b against torch.distributed.pipelining's on the same stages: time, then
losses, gradients and parameters equal to 1e-5."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from pipeline.common import PART1, TOLERANCE, Setup, iqr, make_variant, max_diff, ms, time_variants

def part1(setup: Setup) -> dict:
    a = setup.args
    variants = {label: make_variant(setup, label) for label, _, _ in PART1}
    initial = variants["ours 1f1b"].params()
    run = time_variants(setup, variants, warmup=a.warmup, steps=a.steps)
    # identical training: parameters after the same SGD steps, then the raw gradients of one more step
    ref = variants["ours 1f1b"]
    param_diff = {n: max_diff(ref.params(), v.params(), setup.world) for n, v in variants.items()}
    moved = max_diff(ref.params(), initial, setup.world)
    check_batches = setup.batches(99_999)
    grads, check_loss = {}, {}
    for name, v in variants.items():
        dist.barrier(setup.world)
        loss, _ = v.step(check_batches)
        grads[name] = v.grads()
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(t, group=setup.world)
        check_loss[name] = float(t)
        v.opt.zero_grad(set_to_none=True)
    grad_diff = {n: max_diff(grads["ours 1f1b"], g, setup.world) for n, g in grads.items()}
    pairs = {"gpipe": ("ours gpipe", "torch gpipe"), "1f1b": ("ours 1f1b", "torch 1f1b")}
    paired_diff = {k: max_diff(grads[o], grads[t], setup.world) for k, (o, t) in pairs.items()}
    loss_rel = max(abs(l - check_loss["ours 1f1b"]) / abs(check_loss["ours 1f1b"]) for l in check_loss.values())
    reference = run["losses"]["ours 1f1b"]
    step_loss_rel = max(abs(x - y) / abs(y) for n in variants for x, y in zip(run["losses"][n], reference))
    return {"times": run["times"], "param_diff": param_diff, "grad_diff": grad_diff, "paired_grad_diff": paired_diff,
            "loss_rel": max(loss_rel, step_loss_rel), "moved": moved, "check_loss": check_loss}


def report_part1(r: dict) -> str:
    t = r["times"]
    med = {n: statistics.median(v) for n, v in t.items()}
    lines = ["== 1. ours vs torch.distributed.pipelining (same StageModules, same partition, same data) ==",
             "torch side: PipelineStage(submodule=stage, stage_index=rank, num_stages=2, device=cpu, group=...) + "
             "ScheduleGPipe / Schedule1F1B(n_microbatches=m, loss_fn, scale_grads=False), step(whole batch, "
             "return_outputs=False)",
             "ours: build_local_pipeline(model, pp=2, schedule=name, num_microbatches=m), PipelineEngine's set-up "
             "(prefetch on, recompute off), run by its PipelineRuntime", ""]
    header = (f"{'schedule':<8} | {'ours ms':>8} {'torch ms':>8} | {'IQR ours':>8} {'IQR torch':>9} | "
              f"{'ours/torch':>10} {'paired':>7}")
    lines += [header, "-" * len(header)]
    for sched in ("gpipe", "1f1b"):
        o, tt = t[f"ours {sched}"], t[f"torch {sched}"]
        paired = statistics.median(x / y for x, y in zip(o, tt))
        lines.append(f"{sched:<8} | {ms(med[f'ours {sched}']):>8} {ms(med[f'torch {sched}']):>8} | "
                     f"{ms(iqr(o)):>8} {ms(iqr(tt)):>9} | {med[f'ours {sched}'] / med[f'torch {sched}']:>10.3f} "
                     f"{paired:>7.3f}")
    lines.append(f"ours 1f1b / ours gpipe = {med['ours 1f1b'] / med['ours gpipe']:.3f}; "
                 f"torch 1f1b / torch gpipe = {med['torch 1f1b'] / med['torch gpipe']:.3f}")
    ok = (max(r["param_diff"].values()) <= TOLERANCE and max(r["grad_diff"].values()) <= TOLERANCE
          and r["loss_rel"] <= TOLERANCE and r["moved"] > 0)
    lines += ["",
              f"equality check (tol {TOLERANCE:g}): {'PASS' if ok else 'FAIL'} -- "
              f"gradients of one more step, ours vs torch: gpipe {r['paired_grad_diff']['gpipe']:.1e}, "
              f"1f1b {r['paired_grad_diff']['1f1b']:.1e}; all four vs ours 1f1b: max |dgrad| "
              f"{max(r['grad_diff'].values()):.1e}, max |dparam| after the same SGD steps "
              f"{max(r['param_diff'].values()):.1e}; max relative loss difference {r['loss_rel']:.1e}; "
              f"training moved the weights by up to {r['moved']:.1e}", ""]
    r["ok"] = ok
    return "\n".join(lines)
