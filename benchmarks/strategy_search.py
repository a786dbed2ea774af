"""Validation of the strategy search: predicted vs measured step time and memory.

For each model and world size: profile the model, run the search (timed), take the configurations
that fit (distinct after deduplication; see CONFIGS below for which), then run every one of them
with the real runtime and compare.

How it measures (one launch per model and world size, by the project's launcher):
- every rank loads the data once; then, round after round, every configuration in turn is set up (a
  Trainer with its own process groups), stepped and released (its groups destroyed): one Trainer is
  alive at a time, so no configuration is timed beside the others' idle gloo threads, tensors and
  allocator churn (with all of them alive, a pipeline row of hf:gpt2 at 4 ranks measured 101 ms
  against 73-81 ms alone); each visit runs two untimed steps (allocations, optimizer states), then
  three timed steps (strategy_search_ranks.TIMED_STEPS), the median of every visit's kept;
- memory: the second untimed step of a configuration's first visit, counted by search/live_memory.py:
  peak bytes of live tensors = resident storages (parameters, gradient buffers, optimizer states, module buffers)
  + the most bytes of tensors created during the step alive at once (activations, gradients of
  activations, communication buffers, temporaries). NOT the resident set size: that holds the
  Python/torch/gloo runtime too. The memory model is compared with headroom 1 (the same quantity);
  the JSON keeps the model's terms per stage and, per rank, the bytes at the peak by the op that made them;
- time: REPEATS rounds, each timing one step of every configuration in turn (interleaved, so load
  drift hits all alike); a step's time is the slowest rank's (barrier before); the median is kept;
  set-ups are paid once per configuration per round;
- the level: a reference configuration (search/step_probe.py: replicated dp over every rank, one
  micro-batch) is set up and timed beside them, first and last in every round; its measured step over
  its predicted time-shared bound is Cluster.time_shared_scale, with which every configuration is
  scored again. It is not one of the checked configurations: the time statistics leave it out (the
  error without the scale is printed beside them); pick / best counts it as a configuration of the space.

Printed per world size: a table (config, predicted ms, measured ms, predicted and measured MiB per
rank) and the Spearman rank correlation of predicted vs measured step time, the measured time of
the search's pick over the measured best, the median relative time error, the largest per-rank
memory error, and the search's own run time.

    PYTHONPATH=src python benchmarks/strategy_search.py [--quick] [--world 4,8] [--out results.json]
        [--cluster FILE.toml]   (default: `autopar calibrate` is run first, ~15 s)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODELS = {  # name -> model arguments (small enough that 8 ranks on 2 cores take well under a second per step)
    "gpt-mini": {},
    "hf:llama": {"num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 4,
                 "num_key_value_heads": 2},
}
SEQ_LEN = 128
GLOBAL_BATCH = 16
REPEATS = 3
QUICK_CONFIGS = 6
MAX_CONFIGS = 22  # per model and world size, to keep the full run near 12 minutes (see pick_configs)


# ------------------------------------------------------------------------------ driver (no ranks)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def runnable(e) -> bool:
    """What the runtime can run exactly as the model scored it.

    Whole-stage recompute needs a pipeline. Stage-aware recomputation that recomputes nothing is `none` (deduplicated).
    """
    c = e.candidate
    if c.recompute == "all" and c.pp == 1:
        return False
    return not (c.recompute == "stage-aware" and any(e.recompute_blocks))


def pick_configs(ranked: list, limit: int, by_schedule: bool = False) -> list:
    """All runnable fitting configurations if they are few. Else the search's pick, then the best-predicted
    configuration of every other layout (dp, tp, pp, micro-batch size, recompute: schedules barely differ at
    one micro-batch; `by_schedule`: the schedule too, so each schedule asked for gets rows), then an even
    spread over the rest of the ranking; reported in predicted order."""
    runs = [e for e in ranked if runnable(e)]
    if len(runs) <= limit:
        return runs
    chosen, layouts = [runs[0]], set()
    for e in runs:
        c = e.candidate
        layout = (c.dp, c.tp, c.pp, c.micro_batch_size, c.recompute) + ((c.schedule,) if by_schedule else ())
        if layout not in layouts:
            layouts.add(layout)
            if e is not runs[0]:
                chosen.append(e)
    if len(chosen) >= limit:  # more layouts than room: an even spread of them, the pick first
        step = (len(chosen) - 1) / (limit - 1)
        chosen = [chosen[0]] + [chosen[1 + int(i * step)] for i in range(limit - 1)]
    else:
        rest = [e for e in runs if not any(e is x for x in chosen)]
        step = len(rest) / (limit - len(chosen))
        chosen += [rest[int(i * step)] for i in range(limit - len(chosen))]
    return sorted(chosen, key=lambda e: e.step_time_s)


def strategy_of(c) -> dict:
    return {"dp": c.dp, "tp": c.tp, "pp": c.pp, "schedule": c.schedule, "chunks": c.chunks,
            "partition": c.partition if c.pp > 1 else "uniform", "recompute": "all" if c.recompute == "all" else "none",
            "zero": c.zero, "sp": c.sp, "ep": c.ep, "cp": c.cp, "cp_mode": c.cp_mode, "compile": c.compile}


def calibrated_cluster(path: str | None, world: int):
    from autopar.search.calibrate import calibrate
    from autopar.search.cluster import resolve_cluster
    if path:
        return resolve_cluster(path, nproc=world)
    return calibrate(world)


def run_world(model_name: str, world: int, cluster, args) -> dict:
    """One launch: the ranks measure the blocks and this job's share of the cores, rank 0 searches, then every
    rank runs the chosen configurations (so the profile and the runs see the same load on a shared machine)."""
    from autopar.launch import launch
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "measured.json"
        cluster_file = Path(tmp) / "cluster.toml"
        cluster_file.write_text(cluster.to_toml())
        spec.write_text(json.dumps({"model": model_name, "model_args": MODELS[model_name], "world": world,
                                    "cluster": str(cluster_file), "measure": args.measure,
                                    "limit": args.configs or (QUICK_CONFIGS if args.quick else MAX_CONFIGS),
                                    "schedules": args.schedules,
                                    "repeats": args.repeats, "runs": str(Path(tmp) / "runs"), "out": str(out)}))
        launched, load = time.perf_counter(), os.getloadavg()[0]
        code = launch([sys.executable, __file__, "--worker", str(spec)], world)
        if code != 0 or not out.exists():
            raise SystemExit(f"{model_name} at {world} ranks: the measuring ranks failed (exit code {code})")
        block = json.loads(out.read_text())
        block.update(model=model_name, world=world, measure_s=time.perf_counter() - launched,
                     load_average=[load, os.getloadavg()[0]])
    return block


def summarise(block: dict) -> dict:
    """Time statistics over the checked configurations (the reference step calibrated the level, so it is left
    out of them); pick / best over every measured one (the reference is a configuration of the space too);
    memory over all (the reference step does not touch the memory model)."""
    measured = [c for c in block["configs"] if c.get("measured_s")]
    rows = [c for c in measured if not c.get("reference")]
    if not rows:
        return {"n": 0}
    pred = [c["predicted_s"] for c in rows]
    meas = [c["measured_s"] for c in rows]
    best = min(c["measured_s"] for c in measured)
    pick = min(measured, key=lambda c: c.get("searched_s", c["predicted_s"]))  # as the search ranked them
    time_err = [abs(p - m) / m for p, m in zip(pred, meas)]
    unscaled = [abs(c.get("predicted_unscaled_s", c["predicted_s"]) - c["measured_s"]) / c["measured_s"] for c in rows]
    mem_err = []
    for c in measured:
        pp = c["strategy"]["pp"]
        world = len(c["measured_bytes_per_rank"])
        for rank, got in enumerate(c["measured_bytes_per_rank"]):
            want = c["predicted_bytes_per_pp_rank"][rank // (world // pp)]  # ranks are (pp, dp, tp), tp innermost
            mem_err.append((want - got) / got)
    # one factor fitted over all rows (geometric mean of measured / predicted): what is left is the error of
    # the model's shape, separate from its absolute calibration (which a loaded machine skews)
    scale = statistics.geometric_mean([m / p for p, m in zip(pred, meas)])
    return {"n": len(rows), "spearman": spearman(pred, meas), "pick_over_best": pick["measured_s"] / best,
            "median_time_error": statistics.median(time_err), "fitted_scale": scale,
            "median_time_error_unscaled": statistics.median(unscaled), "pick": pick["describe"],
            "median_time_error_after_scale": statistics.median(abs(p * scale - m) / m for p, m in zip(pred, meas)), "max_memory_error": max(mem_err, key=abs),
            "median_memory_error": statistics.median(abs(e) for e in mem_err)}


def print_block(block: dict, summary: dict, args_terms: bool = True) -> None:
    print(f"\n== {block['model']} at {block['world']} ranks: blocks measured on rank 0 and cores probed (alone vs "
          f"every rank at once) in {block['blocks_measured_s']:.1f} s, this job's effective cores "
          f"{block['effective_cores'] or 0:.2f}, of which idle gloo threads take "
          f"{block.get('background_cores', 0):.2f} with one configuration set up (predictions below count it); "
          f"search scored {block['evaluated']} configurations "
          f"({block['fitting']} distinct fitting) in {block['search_s']:.2f} s; measured {summary['n']} in "
          f"{block['measure_s']:.0f} s (load average {block['load_average'][0]:.1f} -> {block['load_average'][1]:.1f})")
    print(f"{'predicted ms':>12} {'measured ms':>11} {'err':>6}  {'pred MiB/pp rank':<22} {'measured MiB/rank':<40} config")
    reference = next((c for c in block["configs"] if c.get("reference")), None)
    if reference and reference.get("measured_s"):
        print(f"reference step (calibrates the level, left out of the time statistics): {reference['describe']} "
              f"measured {reference['measured_s'] * 1e3:.1f} ms, predicted bound "
              f"{reference.get('predicted_unscaled_s', 0) * 1e3:.1f} ms: time_shared_scale "
              f"{block.get('time_shared_scale', 1.0):.3f}")
    for c in sorted(block["configs"], key=lambda c: c["predicted_s"]):
        if not c.get("measured_s"):
            print(f"{c['predicted_s'] * 1e3:12.1f} {'failed':>11}  {c.get('error', '')[:80]}  {c['describe']}")
            continue
        pm = ",".join(f"{v / 2**20:.1f}" for v in c["predicted_bytes_per_pp_rank"])
        mm = ",".join(f"{v / 2**20:.1f}" for v in c["measured_bytes_per_rank"])
        err = (c["predicted_s"] - c["measured_s"]) / c["measured_s"]
        print(f"{c['predicted_s'] * 1e3:12.1f} {c['measured_s'] * 1e3:11.1f} {err:+6.0%}  {pm:<22} {mm:<40} "
              f"{c['describe']}{'  (reference)' if c.get('reference') else ''}")
        if args_terms:
            p, m = c["parts"], c["measured_terms_s"]
            print(f"{'':12}   terms ms, predicted / measured (slowest rank): pipeline busy {p['busy_s'] * 1e3:.1f} / "
                  f"{m['busy'] * 1e3:.1f}; pipeline {p['pipeline_s'] * 1e3:.1f} (+dp {p['dp_exposed_s'] * 1e3:.1f})"
                  f" / forward_backward {m['forward_backward'] * 1e3:.1f}; optimizer {p['optimizer_s'] * 1e3:.1f}"
                  f" / {m['optimizer'] * 1e3:.1f}; clip {m['clip_gradients'] * 1e3:.1f}, zero_grad "
                  f"{m['zero_grad'] * 1e3:.1f}; timeline {p['timeline_step_s'] * 1e3:.1f}, time-shared bound "
                  f"{p['time_shared_s'] * 1e3:.1f}; CPU summed over ranks {p.get('cpu_s', 0) * 1e3:.0f} / "
                  f"{m.get('cpu', 0) * 1e3:.0f}")
    setup = [c["setup_s"] for c in block["configs"] if "setup_s" in c]
    print(f"set-up (trace, partition, 2 steps) per configuration: median {statistics.median(setup):.1f} s")
    print(f"Spearman {summary['spearman']:.3f} (target >= 0.8); pick / measured best {summary['pick_over_best']:.3f} "
          f"(target <= 1.10); median |time error| {summary['median_time_error']:.1%} (target <= 15%; "
          f"{summary['median_time_error_unscaled']:.1%} without the reference step's scale; "
          f"{summary['median_time_error_after_scale']:.1%} after one factor fitted to all rows, x"
          f"{summary['fitted_scale']:.2f}, shown only to separate shape from calibration); memory error "
          f"(live tensor bytes, per rank) worst {summary['max_memory_error']:+.1%}, median "
          f"{summary['median_memory_error']:.1%} (target <= 20%)")
    if not block["pick_runnable"]:
        print(f"note: the search's own pick ({block['pick']}) uses a cut this benchmark does not run; "
              f"the pick above is the best predicted among those measured")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_CONFIGS} configurations per world size")
    parser.add_argument("--world", default="4,8", help="comma-separated world sizes")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from " + ", ".join(MODELS))
    parser.add_argument("--configs", type=int, default=0,
                        help=f"configurations per model and world size (default {MAX_CONFIGS}, {QUICK_CONFIGS} quick)")
    parser.add_argument("--schedules", default="",
                        help="comma-separated: search only these schedules, each counted as its own layout when "
                             "configurations are chosen (a development aid, e.g. zb-h1,1f1b; not the validation)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed rounds (median kept)")
    parser.add_argument("--cluster", help="calibrated cluster TOML (default: calibrate now)")
    parser.add_argument("--no-measure", dest="measure", action="store_false",
                        help="score from traced FLOPs at the calibrated rate instead of measured block costs")
    parser.add_argument("--out", help="write every measurement and summary as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from strategy_search_ranks import worker  # (imports this file: the driver's helpers)
        return worker(Path(args.worker))
    from autopar.search.search import SearchSpace
    known = SearchSpace(nproc=1).schedules
    unknown = [s for s in args.schedules.split(",") if s and s not in known]
    if unknown:
        parser.error(f"--schedules: {', '.join(unknown)} not among the searched schedules {', '.join(known)}")
    began = time.perf_counter()
    load = os.getloadavg()
    worlds = [int(w) for w in args.world.split(",")]
    report = {"load_average_at_start": load, "cores": os.cpu_count(), "seq_len": SEQ_LEN,
              "global_batch": GLOBAL_BATCH, "repeats": args.repeats, "quick": args.quick, "blocks": []}
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores; "
          f"seq_len {SEQ_LEN}, global batch {GLOBAL_BATCH}; memory = peak live tensor bytes per rank")
    for world in worlds:
        cluster = calibrated_cluster(args.cluster, world)
        print(f"cluster for {world} ranks: {cluster.source}; {cluster.cores_per_node or 'a core per rank'} cores")
        for model_name in args.models.split(","):
            block = run_world(model_name, world, cluster, args)
            block["summary"] = summarise(block)
            if block["summary"]["n"]:
                print_block(block, block["summary"])
            else:
                print(f"{model_name} at {world} ranks: every configuration failed: "
                      + "; ".join(sorted({c.get('error', '?') for c in block['configs']})))
            report["blocks"].append(block)
    report["load_average_at_end"] = os.getloadavg()
    report["total_s"] = time.perf_counter() - began
    print(f"\ntotal {report['total_s']:.0f} s; load average at end {report['load_average_at_end'][0]:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
