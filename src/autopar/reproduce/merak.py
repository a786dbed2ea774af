"""`autopar reproduce merak`: Merak's 64-GPU results, and autopar's own plans, by simulation.

Merak (Lai et al., TPDS 2023) reports, on 64 GPUs, up to 1.42x, 1.39x, 1.43x and 1.61x over
Megatron-LM / DeepSpeed 3D parallelism for GPT models of 1.5B, 2.5B, 8.3B and 20B parameters.
No GPU cluster is at hand, so this study prices every configuration with the strategy search's
step model (search/cost.py: per-block costs from one meta trace of the model, the project's
pipeline simulator, alpha-beta collectives, a per-stage memory model) plus Merak's three
runtime terms (reproduce/merak_model.py), on two 64-GPU clusters from datasheet figures:

  per model, per cluster   Megatron-style and DeepSpeed-style baselines, each at the best of its
                           own degrees and micro-batch sizes that fit memory;
                           Merak's techniques added one at a time at each baseline's degrees;
                           autopar's search pick on the same cluster and batch.

Every number is a prediction of the model, not a measurement; the assumptions are printed.

    autopar reproduce merak                                     # both clusters, four models
    autopar reproduce merak --clusters rtx3090 --models gpt-2.5b  # one of each (the test's size)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import datetime
from pathlib import Path

from ..errors import ConfigError, choices
from ..search.cluster import resolve_cluster
from ..search.cost import Estimate, StepModel
from ..search.profile import ModelProfile, profile_model
from ..search.search import SearchSpace, enumerate_candidates, exhaustive
from .merak_model import (ABLATION, KERNEL_OVERHEAD_S, MAX_MBS, MAX_PP, MERAK_ROW, Degrees, MerakStepModel, best_of,
                          candidate, deepspeed_candidates, degree_choices, megatron_candidates)

CLUSTERS = {
    "rtx3090": ("rtx3090-24gb-pcie", "16 nodes x 4 RTX 3090 24GB, PCIe inside a node, 100 Gb/s between nodes"),
    "v100": ("v100-32gb-nvlink", "8 nodes x 8 V100 32GB, NVLink inside a node, 100 Gb/s InfiniBand between nodes"),
}
MODELS = ("gpt-1.5b", "gpt-2.5b", "gpt-8.3b", "gpt-20b")
HIDDEN = {"gpt-1.5b": 1600, "gpt-2.5b": 1920, "gpt-8.3b": 3072, "gpt-20b": 6144}
LAYERS = {"gpt-1.5b": 48, "gpt-2.5b": 54, "gpt-8.3b": 72, "gpt-20b": 44}
PAPER_SPEEDUP = {"gpt-1.5b": 1.42, "gpt-2.5b": 1.39, "gpt-8.3b": 1.43, "gpt-20b": 1.61}
"""The abstract's 'up to' speedups over the better of Megatron-LM and DeepSpeed (the only figures we have)."""
VOCAB = 50304  # GPT-2's 50257 tokens padded to a multiple of 128, as Megatron-LM does


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="autopar reproduce merak", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS), help=f"of {choices(CLUSTERS)}")
    parser.add_argument("--models", nargs="+", default=list(MODELS), help=f"of {choices(MODELS)}")
    parser.add_argument("--nproc", type=int, default=64, help="GPUs")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--global-batch", type=int, default=256, help="sequences per step")
    parser.add_argument("--dtype", default="bf16", help="compute dtype: bf16 = 16-bit mixed precision (fp16 on V100)")
    parser.add_argument("--max-pp", type=int, default=MAX_PP, help="deepest pipeline priced (baselines and search)")
    parser.add_argument("--max-mbs", type=int, default=MAX_MBS, help="largest micro-batch priced")
    parser.add_argument("--min-mbs", type=int, default=1,
                        help="smallest micro-batch priced (e.g. 4: the regime where GPUs need bigger matmuls)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--no-search", action="store_true", help="skip autopar's own search")
    parser.add_argument("--out", default=None, help="output folder (default runs/reproduce-merak-<time>)")
    args = parser.parse_args(argv)
    bad = [c for c in args.clusters if c not in CLUSTERS] + [m for m in args.models if m not in MODELS]
    if bad:
        raise ConfigError(f"unknown cluster or model {bad}; clusters: {choices(CLUSTERS)}, models: {choices(MODELS)}")
    for name in ("nproc", "seq_len", "global_batch", "max_pp", "max_mbs", "min_mbs", "jobs"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.min_mbs > args.max_mbs:
        raise ConfigError(f"--min-mbs {args.min_mbs} is larger than --max-mbs {args.max_mbs}; use min <= max")
    return args


# ----------------------------------------------------------------------------- one model on one cluster


def model_tflops(profile: ModelProfile, batch: int, step_s: float, nproc: int) -> float:
    """Model FLOPs (forward + 2x backward, recomputation not counted) per second per GPU, in TFLOPS."""
    return 3 * sum(profile.flops) * batch / step_s / nproc / 1e12


def study_one(profile: ModelProfile, cluster, args, model_name: str) -> dict:
    """Baselines, the ablation at each baseline's degrees, and autopar's pick for one model on one cluster."""
    hidden = HIDDEN[model_name]
    base = StepModel(profile, cluster, global_batch_size=args.global_batch, dtype=args.dtype)
    degrees = degree_choices(base, args.nproc, args.max_pp, args.max_mbs, args.min_mbs)
    if not degrees:
        raise ConfigError(f"no (dp, tp, pp) on {args.nproc} GPUs divides the global batch {args.global_batch}; use a "
                          f"multiple of {args.nproc}")
    megatron = best_of(base, (c for d in degrees for c in megatron_candidates(d)))
    deepspeed = best_of(base, (c for d in degrees for c in deepspeed_candidates(d)))
    models = [MerakStepModel(profile, cluster, global_batch_size=args.global_batch, dtype=args.dtype,
                             techniques=t, hidden=hidden) for *_, t in ABLATION]
    ablations = {}
    for label, baseline in (("megatron", megatron), ("deepspeed", deepspeed)):
        if baseline is None:
            continue
        c = baseline.candidate
        d = Degrees(c.dp, c.tp, c.pp, c.micro_batch_size, c.num_microbatches)
        rows = []
        for (name, schedule, recompute, partition, _), model in zip(ABLATION, models):
            e = model.evaluate(candidate(d, schedule=schedule, recompute=recompute, partition=partition))
            rows.append((name, e))
        ablations[label] = rows
    pick, searched, search_s = None, 0, 0.0
    if not args.no_search:
        began = time.perf_counter()
        space = SearchSpace(nproc=args.nproc, partitions=("time",))
        priced = [c for c in enumerate_candidates(base, space)
                  if c.pp <= args.max_pp and args.min_mbs <= c.micro_batch_size <= args.max_mbs]
        result = exhaustive(base, space, priced)
        search_s, searched = time.perf_counter() - began, result.evaluated
        pick = result.ranked[0] if result.ranked else None
    return {"megatron": megatron, "deepspeed": deepspeed, "ablations": ablations, "pick": pick,
            "searched": searched, "search_s": search_s}


# ----------------------------------------------------------------------------- output


def _timed_study(profile: ModelProfile, cluster, args, model_name: str) -> tuple[dict, float]:
    began = time.perf_counter()
    return study_one(profile, cluster, args, model_name), time.perf_counter() - began


def _speedup(e: Estimate | None, baseline: Estimate | None) -> float | None:
    if e is None or baseline is None or not e.fits:
        return None
    return baseline.step_time_s / e.step_time_s


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "x") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def describe(e: Estimate | None) -> str:
    if e is None:
        return "nothing fits"
    c = e.candidate
    sched = c.schedule + (f"x{c.chunks}" if c.chunks > 1 else "")
    rc = c.recompute if c.recompute != "stage-aware" else f"stage-aware {list(e.recompute_blocks)}"
    if len(rc) > 40:
        rc = rc[:37] + "...]"
    return (f"dp{c.dp} tp{c.tp} pp{c.pp} mbs{c.micro_batch_size} m{c.num_microbatches} {sched} "
            f"{c.partition} rc={rc} peak {e.peak_memory / 2**30:.1f}G")


def cluster_table(name: str, results: dict, profiles: dict, args) -> tuple[str, list[dict]]:
    """The per-cluster table and its JSON records."""
    lines = [f"== {name}: {CLUSTERS[name][1]} | {args.nproc} GPUs | global batch {args.global_batch} x "
             f"{args.seq_len} tokens | {args.dtype} | micro-batch {args.min_mbs}-{args.max_mbs}, pp <= {args.max_pp}",
             f"{'model':9} {'baseline':9} {'samples/s':>9} {'TFLOPS/GPU':>10} {'Merak':>7} {'autopar':>8} "
             f"{'paper':>9}  baseline configuration"]
    records = []
    for model_name, r in results.items():
        prof = profiles[model_name]
        for label in ("megatron", "deepspeed"):
            b = r[label]
            merak = r["ablations"][label][MERAK_ROW][1] if label in r["ablations"] else None
            samples = args.global_batch / b.step_time_s if b else None
            tflops = model_tflops(prof, args.global_batch, b.step_time_s, args.nproc) if b else None
            lines.append(f"{model_name:9} {label:9} {_fmt(samples, '.1f', ''):>9} {_fmt(tflops, '.1f', ''):>10} "
                         f"{_fmt(_speedup(merak, b)):>7} {_fmt(_speedup(r['pick'], b)):>8} "
                         f"{'up to ' + format(PAPER_SPEEDUP[model_name], '.2f'):>9}  {describe(b)}")
            records.append({"model": model_name, "baseline": label, "samples_per_s": samples,
                            "tflops_per_gpu": tflops, "merak_speedup": _speedup(merak, b),
                            "autopar_speedup": _speedup(r["pick"], b), "paper_up_to": PAPER_SPEEDUP[model_name],
                            "baseline_config": describe(b), "merak_config": describe(merak)})
    lines.append("ablation at each baseline's degrees (predicted speedup over that baseline; n/a: does not fit):")
    for model_name, r in results.items():
        for label, rows in r["ablations"].items():
            b = r[label]
            cells = "  ".join(f"{_fmt(_speedup(e, b))}" for _, e in rows)
            lines.append(f"  {model_name:9} {label:9} {cells}")
    lines.append("  columns: " + " | ".join(f"{i}: {n.strip()}" for i, (n, *_) in enumerate(ABLATION)))
    lines.append("configurations chosen:")
    for model_name, r in results.items():
        for label in r["ablations"]:
            lines.append(f"  {model_name:9} Merak at {label:9} degrees: "
                         f"{describe(r['ablations'][label][MERAK_ROW][1])}")
        if r["pick"] is not None or not args.no_search:
            lines.append(f"  {model_name:9} autopar pick: {describe(r['pick'])} "
                         f"({r['searched']} configurations in {r['search_s']:.1f} s)")
    for rec in records:
        r = results[rec["model"]]
        rec["autopar_pick"] = describe(r["pick"])
        rows = r["ablations"].get(rec["baseline"], [])
        rec["ablation"] = {n.strip(): _speedup(e, r[rec["baseline"]]) for n, e in rows}
    return "\n".join(lines), records


def assumptions(args, clusters: dict) -> str:
    lines = ["assumptions (every figure below is a model prediction, not a measurement):",
             f"  models: {', '.join(f'{m} ({LAYERS[m]} layers, hidden {HIDDEN[m]})' for m in args.models)}; heads as "
             f"the public configs (1.5b: 25, so the TP planner refuses tp>1); vocabulary {VOCAB}; tied embedding; "
             f"sequence {args.seq_len}; global batch {args.global_batch} sequences",
             f"  precision: {args.dtype} compute at the preset's 16-bit tensor-core rate x compute_efficiency; "
             "activations 2 bytes; weights, gradients and AdamW moments fp32 (16 bytes per parameter)",
             "  baselines: Megatron-style = uniform layer split, 1F1B or interleaved (2 chunks), recomputation of "
             "whole stages only if no-recompute does not fit (both priced, the faster fitting one kept), no TP "
             "overlap; DeepSpeed-style = 1F1B, parameter-count split, full activation checkpointing; each at the "
             "best of its own (dp, tp, pp, micro-batch size) with tp inside a node",
             "  Merak config: the baseline's degrees and micro-batching; scp schedule; stage-aware recomputation "
             "(fewest leading blocks per stage that fit) as R before the gradient wait; time-balanced cut; "
             f"sub-pipelined TP with K=2 sub-batches (only where the micro-batch splits in 2 and tp > 1), forward "
             "overlap across layers (autopar's runtime), "
             f"{KERNEL_OVERHEAD_S * 1e6:g} us extra launch per sub-batch segment; the last ablation row also "
             "overlaps the backward as Merak's hand-written GPT-2 blocks do",
             "  autopar pick: the exhaustive search (search/search.py) over every degree, micro-batch, schedule "
             "except scp, and recomputation, with the time-balanced cut",
             "  TFLOPS/GPU: model FLOPs (3 x forward, recomputation not counted) per second per GPU",
             "  paper: the abstract's 'up to' figures over the better of Megatron-LM and DeepSpeed; its per-setting "
             "throughputs, configurations and clusters are not available to us"]
    for name, cluster in clusters.items():
        intra, inter = cluster.intra_node, cluster.inter_node
        lines.append(f"  cluster {name} = preset {cluster.name}: {cluster.num_devices} GPUs, "
                     f"{cluster.devices_per_node} per node, {cluster.memory_per_device_gb:g} GiB, 16-bit peak "
                     f"{cluster.flops_per_s.get('bf16', 0) / 1e12:g} TFLOPS x efficiency "
                     f"{cluster.compute_efficiency:g}, intra-node {intra.bandwidth_bytes_per_s / 1e9:g} GB/s + "
                     f"{intra.latency_s * 1e6:g} us, inter-node {inter.bandwidth_bytes_per_s / 1e9:.3g} "
                     f"GB/s per GPU + {inter.latency_s * 1e6:g} us, per-action overhead "
                     f"{cluster.per_action_overhead_s * 1e6:g} us, memory headroom x{cluster.memory_headroom:g}")
        lines.append(f"    source: {cluster.source}")
    lines += [
        "calibration: the datasheet presets above; no GPU run calibrated them (none was available).",
        "grounding (measured on 2 CPU cores, docs/benchmarks.md; not re-run here):",
        "  pipeline simulator vs measured step time, six schedules, pp=2: 0.93-1.00 "
        "(benchmarks/pipeline_schedules.py)",
        "  memory model vs measured peak, gpt-tiny pp=2: stage 0 +73%, stage 1 -29% before the search's "
        "accuracy work (benchmarks/strategy_memory_check.py; benchmarks/strategy_search.py validates step time and "
        "memory across configurations)",
        "  sub-pipelined TP: K=2 measured 1.09x slower than K=1 on CPU gloo (compute and all-reduce share the "
        "cores), while the same overlap rule predicts 0.64-0.91x on GPUs (benchmarks/tp_subpipeline.py)"]
    return "\n".join(lines)


def chart(path: Path, tables: dict[str, list[dict]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(6.5 * len(tables), 4.2), squeeze=False)
    for ax, (name, records) in zip(axes[0], tables.items()):
        models = list(dict.fromkeys(r["model"] for r in records))
        series = [("Merak vs Megatron", "megatron", "merak_speedup", "#4c72b0"),
                  ("Merak vs DeepSpeed", "deepspeed", "merak_speedup", "#55a868"),
                  ("autopar vs Megatron", "megatron", "autopar_speedup", "#c44e52"),
                  ("autopar vs DeepSpeed", "deepspeed", "autopar_speedup", "#c9a227")]
        width = 0.8 / (len(series) + 1)
        for i, (label, base, key, colour) in enumerate(series):
            values = [next((r[key] or 0.0 for r in records if r["model"] == m and r["baseline"] == base), 0.0)
                      for m in models]
            ax.bar([x + i * width for x in range(len(models))], values, width, label=label, color=colour)
        ax.bar([x + len(series) * width for x in range(len(models))], [PAPER_SPEEDUP[m] for m in models], width,
               label="paper (up to)", color="#999999", hatch="//")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + 2 * width for x in range(len(models))], models)
        ax.set_ylabel("speedup over baseline (predicted)")
        ax.set_title(f"{name}: {CLUSTERS[name][0]} x 64")
        ax.set_ylim(0, 2.1)
        ax.legend(fontsize=7, loc="upper left", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    out = Path(args.out or f"runs/reproduce-merak-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    clusters = {name: resolve_cluster(CLUSTERS[name][0], nproc=args.nproc) for name in args.clusters}
    tps = tuple(sorted({t for c in clusters.values() for t in (1, 2, 4, 8) if t <= c.devices_per_node}))
    profiles = {}
    for m in args.models:
        t0 = time.perf_counter()
        profiles[m] = profile_model(m, seq_len=args.seq_len, tp_degrees=tps, vocab_size=VOCAB, layers=LAYERS[m])
        print(f"profiled {m} on meta ({profiles[m].num_params / 1e9:.2f}B parameters, tp {sorted(profiles[m].tp)}"
              + (f"; refused tp {sorted(profiles[m].tp_refused)}: {next(iter(profiles[m].tp_refused.values()))}"
                 if profiles[m].tp_refused else "") + f") in {time.perf_counter() - t0:.1f} s", flush=True)
    print(assumptions(args, clusters))
    jobs = [(name, m) for name in clusters for m in args.models]
    done = {}
    if args.jobs > 1 and len(jobs) > 1:
        context = multiprocessing.get_context("fork")  # the profiles are inherited, not pickled
        with ProcessPoolExecutor(max_workers=min(args.jobs, len(jobs)), mp_context=context) as pool:
            futures = {pool.submit(_timed_study, profiles[m], clusters[name], args, m): (name, m) for name, m in jobs}
            for future in as_completed(futures):
                done[futures[future]] = future.result()
                print(f"  priced {' '.join(futures[future])} in {done[futures[future]][1]:.1f} s", flush=True)
    else:
        for name, m in jobs:
            done[(name, m)] = _timed_study(profiles[m], clusters[name], args, m)
            print(f"  priced {name} {m} in {done[(name, m)][1]:.1f} s", flush=True)
    tables, texts = {}, []
    for name in clusters:
        results = {m: done[(name, m)][0] for m in args.models}
        text, records = cluster_table(name, results, profiles, args)
        print(text, flush=True)
        texts.append(text)
        tables[name] = records
    chart(out / "merak.png", tables)
    (out / "table.md").write_text(assumptions(args, clusters) + "\n\n" + "\n\n".join(texts) + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "tables": tables}, indent=2, default=str))
    print(f"wrote {out / 'merak.png'}, {out / 'table.md'}, {out / 'results.json'} in "
          f"{time.perf_counter() - began:.1f} s")
    return 0
