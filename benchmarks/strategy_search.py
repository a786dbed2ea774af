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
  one timed step;
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
import dataclasses
import itertools
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


def search_in_ranks(spec: dict) -> tuple[dict, object]:
    """Measure the blocks on rank 0 (the others wait in a barrier, idle), then the cores this job gets now, as
    `autopar calibrate` does (calibrate_ranks.sharing_probe: a workload on rank 0 alone, then on every rank at
    once, timed to the last rank's end; about 1.8 for 4-8 ranks on a quiet 2-core machine, near the rank count
    when other jobs hold the cores, since then every process gets the same slice whether or not our other ranks
    run), so that the profile and the runs see the same load. Rank 0 then profiles the model,
    searches with the measured blocks and those cores, and picks the configurations to run. Returns what every
    rank gets, and on rank 0 a function that scores the chosen configurations again with given background cores
    (Cluster.background_cores, measured once their trainers exist)."""
    import torch.distributed as dist

    from autopar.search.calibrate_ranks import sharing_probe
    from autopar.search.cluster import load_cluster
    from autopar.search.cost import StepModel
    from autopar.search.measure_profile import measure_blocks, with_measured_blocks
    from autopar.search.profile import profile_model
    from autopar.search.search import SearchSpace, exhaustive
    from autopar.search.step_probe import reference_candidate

    rank, world = dist.get_rank(), dist.get_world_size()
    cluster = load_cluster(spec["cluster"])
    margs = spec["model_args"]

    alone, began = None, time.perf_counter()
    if spec["measure"]:
        dist.barrier()
        if rank == 0:
            alone = measure_blocks(spec["model"], seq_len=SEQ_LEN, model_args=margs)
        cores = sharing_probe()
    measured_s = time.perf_counter() - began
    block = None
    if rank == 0:
        began = time.perf_counter()
        profile = profile_model(spec["model"], seq_len=SEQ_LEN, model_args=margs,
                                tp_degrees=tuple(d for d in (1, 2, 4, 8) if world % d == 0))
        if spec["measure"]:
            from autopar.search.ring_cost import CP_DEGREES, with_ring_seconds  # a ring cp rank's attention, timed
            profile = with_ring_seconds(with_measured_blocks(profile, alone),
                                        degrees=tuple(d for d in CP_DEGREES if world % d == 0))
            cluster = cluster.replace(cores_per_node=cores)
        step_model = StepModel(profile, cluster.replace(memory_headroom=1.0), global_batch_size=GLOBAL_BATCH)
        # the `time` cut is left out of the space here: the runtime measures block times for it, so its cut would
        # follow the noise of that measurement rather than the model's (uniform and parameters cut identically)
        space = SearchSpace(nproc=world, partitions=("uniform", "parameters"))
        if spec.get("schedules"):
            space = dataclasses.replace(space, schedules=tuple(spec["schedules"].split(",")))
        result = exhaustive(step_model, space)
        search_s = time.perf_counter() - began
        # the reference step (search/step_probe.py) calibrates the level; it is run beside the others, not scored
        reference = step_model.evaluate(reference_candidate(world, GLOBAL_BATCH))
        others = [e for e in result.ranked if e.candidate.describe() != reference.candidate.describe()]
        chosen = pick_configs(others, spec["limit"], by_schedule=bool(spec.get("schedules"))) + [reference]
        pick = result.ranked[0]
        block = {"search_s": search_s, "evaluated": result.evaluated, "fitting": len(result.ranked),
                 "pick": pick.candidate.describe(), "pick_runnable": runnable(pick), "blocks_measured_s": measured_s,
                 "effective_cores": cluster.cores_per_node, "cluster_source": cluster.source,
                 "configs": [{"strategy": strategy_of(e.candidate), "micro_batch_size": e.candidate.micro_batch_size,
                              "describe": e.candidate.describe(), "predicted_s": e.step_time_s,
                              "predicted_bytes_per_pp_rank": e.memory_per_rank, "bounds": list(e.bounds),
                              "predicted_memory_terms": [m.to_dict() for m in e.memory_per_stage],
                              "parts": e.parts, "reference": e is reference} for e in chosen]}
    box = [block]
    dist.broadcast_object_list(box, src=0)
    if rank != 0:
        return box[0], None

    def rescore(background: float, scale: float = 1.0) -> list:
        """The chosen configurations scored again with `background` cores taken by idle threads and the level
        `scale` a reference step measured (Cluster.time_shared_scale)."""
        again = StepModel(profile, cluster.replace(memory_headroom=1.0, background_cores=background,
                                                   time_shared_scale=scale), global_batch_size=GLOBAL_BATCH)
        return [again.evaluate(e.candidate) for e in chosen]
    return box[0], rescore


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


# ------------------------------------------------------------------------------ the ranks


def calibrate_level(block: dict, rescore) -> None:
    """Score every configuration again with the level the reference step measured (search/step_probe.py)."""
    from autopar.search.step_probe import time_shared_scale
    index = next((i for i, c in enumerate(block["configs"]) if c.get("reference")), None)
    background = block.get("background_cores", 0.0)
    unscaled = rescore(background)
    if index is None or not block["configs"][index].get("measured_s"):
        block["time_shared_scale"] = 1.0
        return
    scale = time_shared_scale(block["configs"][index]["measured_s"], unscaled[index])
    block["time_shared_scale"] = scale
    for c, before, after in zip(block["configs"], unscaled, rescore(background, scale)):
        c.update(predicted_unscaled_s=before.step_time_s, predicted_s=after.step_time_s, parts=after.parts)


TERMS = ("step", "forward_backward", "busy", "clip_gradients", "optimizer", "zero_grad", "cpu")


def time_phases(trainer) -> dict[str, float]:
    """Wrap the step's phases (engine forward+backward, gradient clipping, optimizer step, zero_grad) with
    timers on this trainer's objects only; returns the dict each step's seconds are written into."""
    seconds: dict[str, float] = {}

    def timed(owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - began
        setattr(owner, attr, wrapper)

    timed(trainer.engine, "forward_backward", "forward_backward")
    timed(trainer.engine, "clip_gradients", "clip_gradients")
    timed(trainer.engine, "zero_grad", "zero_grad")
    timed(trainer.optimizer, "step", "optimizer")
    return seconds


def worker(spec_path: Path) -> None:
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.confirm_ranks import alone
    from autopar.data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
    from autopar.models import build_model
    from autopar.search.calibrate_ranks import background_cores

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # a driver that chose and scored the configurations itself (strategy_user_jobs.py) passes them as `block`
    block, rescore = (spec["block"], None) if "block" in spec else search_in_ranks(spec)
    spec["configs"] = block["configs"]
    corpus = load_corpus("stdlib")
    tokenizer = build_tokenizer("byte")
    vocab = padded_vocab_size(tokenizer.vocab_size)
    data: dict = {}
    visits = itertools.count()  # each visit's own run folder

    def build(cfg: dict):
        """A fresh Trainer of one configuration (the model on meta, materialised from the seed: alike every visit)."""
        model, info = build_model(spec["model"], spec["model_args"], vocab_size=vocab, device="meta")
        if "train" not in data:
            data["train"], _ = build_datasets(corpus, tokenizer, seq_len=spec.get("seq_len", SEQ_LEN), task=info.task,
                                              seed=0)
        config = autopar.TrainConfig(steps=10_000, global_batch_size=spec.get("global_batch", GLOBAL_BATCH),
                                     micro_batch_size=cfg["micro_batch_size"], progress=False,
                                     out=f"{spec['runs']}/{next(visits)}", warmup_steps=1,
                                     compile=cfg["strategy"].get("compile", False))
        fields = {k: v for k, v in cfg["strategy"].items() if k != "compile"}  # (a TrainConfig field)
        return autopar.Trainer(model, data["train"], strategy=autopar.Strategy(**fields), config=config)

    results: list[dict] = [{} for _ in spec["configs"]]
    samples: dict[int, list[float]] = {i: [] for i in range(len(results))}
    phases: dict[int, list[list[float]]] = {i: [] for i in range(len(results))}
    # the reference step sets every prediction's level, so it is timed twice a round, first and last
    reference = [i for i, c in enumerate(spec["configs"]) if c.get("reference")]
    others = [i for i, c in enumerate(spec["configs"]) if not c.get("reference")]
    for _ in range(spec["repeats"]):
        for i in reference + others + reference:
            if "error" in results[i]:
                continue
            with alone(lambda: build(spec["configs"][i])) as trainer:  # no other configuration's trainer alive
                if not set_up(trainer, results[i]):
                    results[i].setdefault("error", "another rank could not set this configuration up")
                    continue
                if "background_cores" not in block:
                    # one trainer's process groups alive, as in a run of it alone, each with a gloo thread that polls
                    # every 10 ms: what they burn while the ranks idle scores the configurations again
                    block["background_cores"] = background_cores()
                samples[i].append(timed_step(trainer, 2, phases[i]))
    for i, times in samples.items():
        if times:
            results[i]["measured_s"] = statistics.median(times)
            results[i]["samples_s"] = times
            results[i]["measured_terms_s"] = {name: statistics.median(p[k] for p in phases[i])
                                              for k, name in enumerate(TERMS)}
    if rank == 0:
        if rescore:
            for c, e in zip(block["configs"], rescore(block.get("background_cores", 0.0))):
                c.update(predicted_s=e.step_time_s, parts=e.parts, searched_s=c["predicted_s"])
        for c, m in zip(block["configs"], results):
            c.update(m)
        if rescore:
            calibrate_level(block, rescore)
        Path(spec["out"]).write_text(json.dumps(block))
    dist.barrier()
    dist.destroy_process_group()


def set_up(trainer, record: dict) -> bool:
    """Set a configuration's trainer up and run its first two steps, untimed (allocations: gradient buffers,
    optimizer states); on its first visit the second one counts the peak live tensor bytes per rank. False on all
    ranks when any failed."""
    import torch.distributed as dist

    from autopar.confirm_ranks import all_ranks_ok
    from autopar.search.live_memory import step_peak_bytes
    began = time.perf_counter()
    try:
        trainer._setup()
        trainer.train_step(0)
        if "measured_bytes_per_rank" in record:
            trainer.train_step(1)
        else:
            peaks, terms = [None] * dist.get_world_size(), {}
            dist.all_gather_object(peaks, (step_peak_bytes(trainer, 1, breakdown=terms), terms))
            record["measured_bytes_per_rank"] = [p for p, _ in peaks]
            record["measured_memory_terms"] = [t for _, t in peaks]  # resident + bytes at the peak by making op
            record["setup_s"] = time.perf_counter() - began
        ok = True
    except Exception as exc:  # noqa: BLE001 - reported per configuration, the others still run
        record["error"] = f"{type(exc).__name__}: {exc}"
        ok = False
    return all_ranks_ok(ok)


def timed_step(trainer, step: int, phases: list) -> float:
    """One step from a common start: the slowest rank's seconds; its terms (each the slowest rank's) and the CPU
    seconds of every thread summed over the ranks are appended to `phases`."""
    import torch
    import torch.distributed as dist
    seconds = time_phases(trainer)
    dist.barrier()
    began, used = time.perf_counter(), time.process_time()
    trainer.train_step(step)
    elapsed, cpu = time.perf_counter() - began, time.process_time() - used
    busy = sum(end - start for start, end, action in getattr(trainer.engine, "last_events", [])
               if action.op.is_compute)
    mine = torch.tensor([elapsed, seconds.get("forward_backward", 0.0), busy, seconds.get("clip_gradients", 0.0),
                         seconds.get("optimizer", 0.0), seconds.get("zero_grad", 0.0)], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # each term: the slowest rank's
    summed = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(summed)  # CPU seconds of the step (every thread), summed over the ranks
    phases.append(mine.tolist() + [float(summed)])
    return float(mine[0])


if __name__ == "__main__":
    sys.exit(main())
