"""Study 3: scp with stage-aware block recomputation (the engine's planner) against 1f1b recomputing
every stage, at the same memory budget."""

from __future__ import annotations

import statistics

import torch.distributed as dist

from autopar.pipeline.simulate import simulate
from pipeline.common import (PART3, PP, TOLERANCE, Setup, iqr, make_variant, max_diff, memory_model, mib, ms,
                             time_variants)

def part3(setup: Setup) -> dict:
    a = setup.args
    variants = {label: make_variant(setup, label) for label, _, _, _ in PART3}
    plans = {n: v.plan for n, v in variants.items() if v.plan is not None}
    recompute = {n: sorted(v.recompute) for n, v in variants.items()}
    # predicted memory of the reference (whole-stage recomputation everywhere): planner formula + stashed inputs
    ref = variants[PART3[0][0]]
    model = memory_model(setup, ref.schedule, ref.stages, ref.recompute)  # whole stages recomputed: k = 0
    predicted = {PART3[0][0]: {"memory": {s: model.memory(s, 0) for s in model.saved}, "in_flight": model.in_flight,
                               "saved_now": {s: model.saved[s][0] for s in model.saved}}}
    makespans = {}
    for n, v in variants.items():
        makespans[n] = simulate(v.schedule, pp=PP, num_stages=PP, num_microbatches=a.m).makespan
    run = time_variants(setup, variants, warmup=a.warmup, steps=a.steps3, step_offset=1000)
    ref_params = ref.params()
    param_diff = {n: max_diff(ref_params, v.params(), setup.world) for n, v in variants.items()}
    loss_rel = max(abs(x - y) / abs(y) for n in variants for x, y in zip(run["losses"][n], run["losses"][PART3[0][0]]))
    gathered = [None] * PP
    dist.all_gather_object(gathered, {"plans": plans, "predicted": predicted})
    return {"times": run["times"], "ranks": gathered, "recompute": recompute, "makespan_unit": makespans,
            "param_diff": param_diff, "loss_rel": loss_rel}


def report_part3(r: dict, args, memory: dict) -> str:
    t = r["times"]
    med = {n: statistics.median(v) for n, v in t.items()}
    ref = PART3[0][0]
    plans, predicted = {}, dict(r["ranks"][0]["predicted"])
    for rank_part in r["ranks"]:
        for n, p in rank_part["plans"].items():
            plans.setdefault(n, []).append(p)
        for n, p in rank_part["predicted"].items():
            for key in p:
                predicted[n][key] = {**predicted[n][key], **p[key]}
    budget = next(iter(plans.values()))[0]["budget"]
    lines = ["== 3. scp + stage-aware recomputation vs 1f1b + full recomputation, same memory budget ==",
             "predicted memory = the engine's planner (recompute.stage_memory_model, as --memory-budget-mb): "
             "4 x parameter bytes + in-flight micro-batches x saved bytes per micro-batch (measure_saved_bytes) + "
             "largest recomputed block; a stage recomputed whole: one live micro-batch plus its stashed inputs "
             "(simulator's stashed_inputs x input bytes)",
             f"budget = predicted per-rank memory of 1f1b with every stage recomputed, largest rank: {mib(budget)} MiB",
             ""]
    for n, per_rank in plans.items():
        for p in per_rank:
            lines.append(f"plan for '{n}': {p['describe']}")
    lines.append("")
    header = (f"{'variant':<26} {'R on':>6} | {'pred r0':>7} {'pred r1':>7} | {'act pred':>11} {'act meas':>11} | "
              f"{'in-flight':>9} | {'sim unit':>8} | {'median ms':>9} {'IQR':>6} | {'vs ref':>6}")
    lines += [header, "-" * len(header)]
    for label, _, _, _ in PART3:
        if label in plans:
            predicted_memory = {int(s): v for p in plans[label] for s, v in p["memory"].items()}
            flight = {int(s): v for p in plans[label] for s, v in p["in_flight"].items()}
            saved_now = {int(s): v for p in plans[label] for s, v in p["saved_now"].items()}
        else:
            predicted_memory = {int(s): v for s, v in predicted[label]["memory"].items()}
            flight = {int(s): v for s, v in predicted[label]["in_flight"].items()}
            saved_now = {int(s): v for s, v in predicted[label]["saved_now"].items()}
        act_pred = "/".join(mib(flight[s] * saved_now[s]) for s in range(PP))
        act_meas = "/".join(mib(memory[label][s]["saved"]) for s in range(PP)) if label in memory else "-"
        pred = [predicted_memory[s] for s in range(PP)]
        rc = "{" + ",".join(str(s) for s in r["recompute"][label]) + "}"
        lines.append(f"{label:<26} {rc:>6} | {mib(pred[0]):>7} {mib(pred[1]):>7} | {act_pred:>11} {act_meas:>11} | "
                     f"{'/'.join(str(flight[s]) for s in range(PP)):>9} | {r['makespan_unit'][label]:>8g} | "
                     f"{ms(med[label]):>9} {ms(iqr(t[label])):>6} | {med[label] / med[ref]:>6.3f}")
    ok = max(r["param_diff"].values()) <= TOLERANCE and r["loss_rel"] <= TOLERANCE
    lines += ["(MiB. R on = stages whose forwards keep only inputs and rerun before backward; pred = predicted memory "
              "per rank as above; act pred = its activation term, in-flight x saved bytes per micro-batch; act meas = "
              "part 2's saved peak; in-flight = simulator's peak live micro-batches per stage; sim unit = simulated "
              "makespan with F=1, B=2, R=1, which does not see block recomputation inside B)",
              f"equality check (tol {TOLERANCE:g}): {'PASS' if ok else 'FAIL'} -- max |dparam| vs '{ref}' "
              f"{max(r['param_diff'].values()):.1e}, max relative loss difference {r['loss_rel']:.1e}", ""]
    r["ok"] = ok
    return "\n".join(lines)
