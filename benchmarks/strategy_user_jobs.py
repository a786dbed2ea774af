"""`--strategy auto` on the jobs users run, on a machine never calibrated: is it ever worse than not using it?

For each job (model, world size, batch shape) the driver does what `autopar train --strategy auto` does
with no --cluster and no prior `autopar calibrate`: it builds the job from the same flags and calls
`autoplan.plan_auto`, which prices on this machine's calibration, measured on first use and cached
(search/calibration_cache.py). The cache lives in a fresh temporary folder for the whole run (unless
--keep-cache), so the first search per world size pays the calibration, as a new user's would, and the
later ones read it. $AUTOPAR_CLUSTER is cleared for the same reason.

Then, as the CLI does next, autoplan.confirm_when_unsure: when the decision says to measure (the pick is
not the default layout, or plans are within the model's error of each other), the plans are run for a few
steps in one launch and the measured winner becomes auto's pick (unless it beats the measured default by
no more than the measurement's noise); the plans measured, their times and what the measuring cost are
printed per job. Then, in one launch per job (strategy_search.py's worker, strategy_search_ranks.py: REPEATS
rounds, in each every configuration's Trainer set up, stepped and released in turn, one alive at a time; memory
as peak live tensor bytes per rank, time as the slowest rank's step, median kept), it runs:
- auto's pick, as the confirmed Plan's record says (what `autopar train --strategy auto` would run);
- the default layout, what a user gets without --strategy auto: dp = nproc, tp = pp = 1, zero 0, the
  default micro-batch size (config.default_micro_batch_size: the per-replica batch, up to 8);
- the distinct fitting configurations of the same search space, priced by the same model on the same
  calibration (up to --configs of them, chosen as strategy_search.py's pick_configs does).

Printed per job: every configuration (predicted and measured ms and MiB per rank), then one line: auto /
default, auto / measured best, the job's median time error and worst memory error. The summary gives the
median time error and the worst per-rank memory error over the whole set, and the thresholds of the
validation, each met or not met, then PASS or FAIL: auto / default <= 1.00 and auto / best <= 1.05 on every
job, median time error <= 10%, worst memory error <= 10%.

The full set (4 models x 4 and 8 ranks x 2 batch shapes: 16 jobs) with the defaults (REPEATS rounds,
MAX_CONFIGS others per job) takes about 30 minutes on a quiet 2-core machine (a calibration per world
size, then per job a search, auto's own measuring launch where it measures first (20-50 s), and one launch
of at most MAX_CONFIGS + 2 configurations); `--jobs` runs a part:

    PYTHONPATH=src python benchmarks/strategy_user_jobs.py [--quick] [--jobs gpt-mini/4,hf:llama/8/32x128]
        [--world 4,8] [--models ...] [--shapes 8x128] [--repeats 2] [--configs 5] [--confirm K] [--keep-cache]
        [--out r.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from strategy_search import pick_configs, runnable, strategy_of, summarise  # noqa: E402

# name -> (model arguments, batch shapes as (global batch, sequence length)); sizes that run on a CPU in seconds
JOBS = {
    "gpt-mini": ({}, ((8, 128), (32, 128))),
    # gpt-small's width and heads (768, 12) at 2 of its 12 layers, shorter sequences: 14M parameters
    "gpt-small": ({"n_layer": 2}, ((8, 64), (16, 64))),
    "hf:llama": ({"num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 4,
                  "num_key_value_heads": 2}, ((8, 128), (32, 128))),
    "hf:gpt2": ({"n_layer": 4, "n_embd": 128, "n_head": 4}, ((8, 128), (32, 128))),
}
QUICK = ("gpt-tiny", {}, (8, 32), 2)  # model, args, shape, world
REPEATS = 2  # interleaved rounds; the median of 2 is their mean (a loaded machine wants --repeats 3 or more)
MAX_CONFIGS = 5  # besides the pick and the default layout, per job (each set up once per round)
QUICK_CONFIGS = 2
QUICK_CONFIRM = 0  # the smoke test's 20 s leave no room for the measuring launch; `--quick --confirm 1` runs it
THRESHOLDS = {"auto_over_default": 1.00, "auto_over_best": 1.05, "median_time_error": 0.10,
              "worst_memory_error": 0.10}


# ------------------------------------------------------------------------------ choosing, as auto does


def build(model: str, model_args: dict, world: int, global_batch: int, seq_len: int, confirm: int | None = None):
    """The job `autopar train --model M --model-arg ... --nproc N --global-batch-size B --seq-len S --strategy auto
    [--confirm K]`, its parts and that argv."""
    from autopar.cli import build_parser, resolve_job
    from autopar.job import build_job
    argv = ["train", "--model", model, "--nproc", str(world), "--global-batch-size", str(global_batch),
            "--seq-len", str(seq_len), "--strategy", "auto"] + ([] if confirm is None else ["--confirm", str(confirm)])
    for key, value in model_args.items():
        argv += ["--model-arg", f"{key}={value}"]
    job = resolve_job(build_parser().parse_args(argv))
    return job, build_job(job), argv


def key_of(strategy: dict, micro_batch_size: int) -> tuple:
    """Configurations that execute alike get one key (the schedule, chunks and cut only matter with a pipeline)."""
    pp = strategy.get("pp", 1)
    piped = (strategy.get("schedule"), strategy.get("chunks", 1), strategy.get("partition")) if pp > 1 else ()
    return (strategy["dp"], strategy.get("tp", 1), pp, micro_batch_size, strategy.get("recompute", "none"),
            strategy.get("zero", 0), strategy.get("memory_budget_mb"), strategy.get("sp", False), strategy.get("ep", 1),
            strategy.get("cp", 1), strategy.get("cp_mode", "ring") if strategy.get("cp", 1) > 1 else None,
            strategy.get("compile", False)) + piped


def row(e, memory) -> dict:
    """A configuration to run: strategy, micro-batch size, predicted time (as auto prices it) and memory (headroom 1)."""
    return {"strategy": strategy_of(e.candidate), "micro_batch_size": e.candidate.micro_batch_size,
            "describe": e.candidate.describe(), "predicted_s": e.step_time_s,
            "predicted_bytes_per_pp_rank": [round(m) for m in memory.memory_per_rank]}


@contextlib.contextmanager
def recording_block_costs(seen: list):
    """Keep what search/auto.py's block measurement returns (measured once per search) in `seen`."""
    from autopar.search import auto
    inner = auto._measure

    def kept(*args, **kwargs):
        seen[:] = [inner(*args, **kwargs)]
        return seen[0]
    auto._measure = kept
    try:
        yield
    finally:
        auto._measure = inner


def choose(job, parts, argv: list[str], world: int, limit: int) -> dict:
    """auto's Plan as `autopar train --strategy auto` makes it (the search, then the measuring the CLI does when
    unsure: autoplan.confirm_when_unsure, on the same `argv`), then the rows to run: auto's pick, the default
    layout, and the other distinct fitting ones.

    The other rows are priced by the model auto used, on the calibration it used (now cached): the same
    profile and cost-model steps as search/auto.py's plan_auto, on the block costs it measured."""
    from autopar.autoplan import confirm_when_unsure, plan_auto
    from autopar.search.auto import _measure
    from autopar.search.calibration_cache import search_cluster
    from autopar.search.cost import StepModel
    from autopar.search.measure_profile import with_cost_model
    from autopar.search.profile import profile_graph
    from autopar.search.search import SearchSpace, divisors, exhaustive
    from autopar.config import default_micro_batch_size
    from autopar.search.step_probe import reference_candidate
    from autopar.trace import trace
    from autopar.train.fields import example_call

    gb, seq_len = job.train.global_batch_size, job.data.seq_len
    seen: list = []  # the block costs auto measured, so the other rows are priced on the very same profile
    began = time.perf_counter()
    with recording_block_costs(seen):
        plan = plan_auto(parts.model, parts.train_data, world, strategy=job.strategy, config=job.train)
    plan_s = time.perf_counter() - began
    searched = plan.record
    plan = confirm_when_unsure(plan, job.strategy.planning.confirm, argv, world)  # what the CLI runs next
    picked = plan.record

    cluster, calibration = search_cluster(None, nproc=world)
    args, kwargs = example_call(parts.model, parts.train_data)
    tps = tuple(d for d in divisors(world) if d <= cluster.devices_per_node)
    profile = profile_graph(trace(parts.model, args, kwargs), name=parts.name, seq_len=seq_len, tp_degrees=tps)
    profile, costs = with_cost_model(profile, cluster, "auto",
                                     lambda: seen[0] if seen else _measure(parts.model, args, kwargs, seq_len))
    timing = StepModel(profile, cluster, global_batch_size=gb)
    memory = StepModel(profile, cluster.replace(memory_headroom=1.0), global_batch_size=gb)
    ranked = exhaustive(timing, SearchSpace(nproc=world)).ranked
    by_key = {key_of(strategy_of(e.candidate), e.candidate.micro_batch_size): e for e in ranked}

    pick_key = key_of(picked["strategy"], picked["train"]["micro_batch_size"])
    found = by_key.get(pick_key)
    pick = {"strategy": picked["strategy"], "micro_batch_size": picked["train"]["micro_batch_size"],
            "describe": found.candidate.describe() if found else plan.configuration(), "predicted_s": picked["prediction"]["step_time_s"],
            "predicted_bytes_per_pp_rank": (row(found, memory.evaluate(found.candidate))["predicted_bytes_per_pp_rank"]
                                            if found else picked["prediction"]["peak_memory_bytes_per_rank"]),
            "auto": True}
    default = reference_candidate(world, gb)
    micro = default_micro_batch_size(gb, world)  # what `autopar train` runs without --micro-batch-size
    default = dataclasses.replace(default, micro_batch_size=micro, num_microbatches=gb // (world * micro))
    default_row = {**row(timing.evaluate(default), memory.evaluate(default)), "default": True}
    default_key = key_of(default_row["strategy"], default_row["micro_batch_size"])
    if default_key == pick_key:
        pick["default"] = True
    rows = [pick] + ([] if default_key == pick_key else [default_row])
    others = [e for e in ranked if key_of(strategy_of(e.candidate), e.candidate.micro_batch_size)
              not in (pick_key, default_key) and (e.candidate.pp == 1 or e.candidate.partition != "time")]
    rows += [row(e, memory.evaluate(e.candidate)) for e in pick_configs(others, limit) if runnable(e)]
    return {"configs": rows, "plan": picked, "plan_s": plan_s, "banner": plan.describe(),
            "searched": {k: searched[k] for k in ("strategy", "train", "prediction")},
            "confirmed": picked.get("confirm", []), "confirm_s": picked.get("confirm_s", 0.0),
            "calibration": picked.get("search", {}).get("calibration") or calibration, "costs": costs,
            "fitting": len(ranked)}


# ------------------------------------------------------------------------------ measuring, one launch per job


def measure(model: str, model_args: dict, world: int, gb: int, seq_len: int, block: dict, repeats: int) -> dict:
    """strategy_search.py's worker runs `block`'s configurations interleaved and fills in what it measured."""
    from autopar.launch import launch
    worker = Path(__file__).with_name("strategy_search.py")
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "measured.json"
        spec.write_text(json.dumps({"model": model, "model_args": model_args, "world": world, "global_batch": gb,
                                    "seq_len": seq_len, "repeats": repeats, "runs": str(Path(tmp) / "runs"),
                                    "out": str(out), "block": block}))
        began = time.perf_counter()
        code = launch([sys.executable, str(worker), "--worker", str(spec)], world)
        if code != 0 or not out.exists():
            raise SystemExit(f"{model} at {world} ranks: the measuring ranks failed (exit code {code})")
        measured = json.loads(out.read_text())
    measured["measure_s"] = time.perf_counter() - began
    return measured


def judge(block: dict) -> dict:
    """auto / default and auto / measured best, with strategy_search's error statistics over every row."""
    ran = [c for c in block["configs"] if c.get("measured_s")]
    auto = next((c for c in ran if c.get("auto")), None)
    default = next((c for c in ran if c.get("default")), None)
    out = summarise(block)
    if auto:
        out["auto_over_best"] = auto["measured_s"] / min(c["measured_s"] for c in ran)
        if default:
            out["auto_over_default"] = auto["measured_s"] / default["measured_s"]
    out["time_errors"] = [abs(c["predicted_s"] - c["measured_s"]) / c["measured_s"] for c in ran]
    return out


def print_job(title: str, block: dict, verdict: dict) -> None:
    print(f"\n== {title}: {block['fitting']} distinct fitting configurations; search (as --strategy auto) "
          f"{block['plan_s']:.1f} s; measured {len(block['configs'])} in {block['measure_s']:.0f} s")
    print(f"   {block['banner']}")
    print("   " + confirmed_line(block))
    print(f"{'predicted ms':>12} {'measured ms':>11} {'err':>6}  {'pred MiB/pp rank':<22} {'measured MiB/rank':<36} config")
    for c in sorted(block["configs"], key=lambda c: c.get("measured_s") or float("inf")):
        tag = "  <- auto" * bool(c.get("auto")) + "  <- default" * bool(c.get("default"))
        if not c.get("measured_s"):
            print(f"{c['predicted_s'] * 1e3:12.1f} {'failed':>11}  {c.get('error', '')[:80]}  {c['describe']}{tag}")
            continue
        pm = ",".join(f"{v / 2**20:.1f}" for v in c["predicted_bytes_per_pp_rank"])
        mm = ",".join(f"{v / 2**20:.1f}" for v in c["measured_bytes_per_rank"])
        err = (c["predicted_s"] - c["measured_s"]) / c["measured_s"]
        print(f"{c['predicted_s'] * 1e3:12.1f} {c['measured_s'] * 1e3:11.1f} {err:+6.0%}  {pm:<22} {mm:<36} "
              f"{c['describe']}{tag}")
    parts = [f"{name} {verdict[name]:.3f} (<= {THRESHOLDS[name]:.2f}: {mark(verdict[name] <= THRESHOLDS[name])})"
             for name in ("auto_over_default", "auto_over_best") if name in verdict]
    if verdict.get("n", 0) > 1:
        parts.append(f"Spearman {verdict['spearman']:.3f}")
    if verdict.get("n"):
        parts.append(f"median time error {verdict['median_time_error']:.1%}, worst memory error "
                     f"{verdict['max_memory_error']:+.1%}")
    print("   " + "; ".join(parts) if parts else "   every configuration failed")
    auto = next((c for c in block["configs"] if c.get("auto") and c.get("measured_s")), None)
    if auto is not None:
        print(f"   job: auto/default {verdict.get('auto_over_default', float('nan')):.3f}, auto/best "
              f"{verdict['auto_over_best']:.3f}, auto's time error {auto['predicted_s'] / auto['measured_s'] - 1:+.1%}, "
              f"median time error {verdict.get('median_time_error', float('nan')):.1%}, worst memory error "
              f"{verdict.get('max_memory_error', float('nan')):+.1%}")


def confirmed_line(block: dict) -> str:
    """What auto measured before choosing, as `autopar train --strategy auto` would have: each plan's measured and
    predicted ms, and what the measuring cost; or that it trusted the prediction."""
    from autopar.search.plan_text import configuration
    confirmed = block.get("confirmed") or []
    if not confirmed:
        return "measured first: nothing (the prediction was trusted, as the CLI would)"
    runs = []
    for c in confirmed:
        got = f"{c['measured_step_time_s'] * 1e3:.1f} ms" if "measured_step_time_s" in c else \
            f"failed ({c.get('error', 'exit code ' + str(c.get('exit_code')))[:60]})"
        runs.append(f"{configuration(c)}{' [default]' if c.get('default_layout') else ''} {got} "
                    f"(predicted {c['predicted_step_time_s'] * 1e3:.1f}, noise {c.get('noise', 0):.0%})")
    return (f"measured first, as the CLI does, {len(confirmed)} plans in {block['confirm_s']:.0f} s: "
            + "; ".join(runs))


def mark(ok: bool) -> str:
    return "met" if ok else "NOT met"


def summary_line(blocks: list[dict]) -> tuple[str, bool]:
    """The validation's thresholds over the whole set, each marked met or not met."""
    verdicts = [b["verdict"] for b in blocks]
    over_default = [v["auto_over_default"] for v in verdicts if "auto_over_default" in v]
    over_best = [v["auto_over_best"] for v in verdicts if "auto_over_best" in v]
    errors = [e for v in verdicts for e in v.get("time_errors", [])]
    memory = [v["max_memory_error"] for v in verdicts if "max_memory_error" in v]
    checks = []
    complete = len(over_default) == len(blocks) and len(over_best) == len(blocks)
    if over_default:
        checks.append((f"auto/default worst {max(over_default):.3f} <= 1.00 on every job",
                       complete and max(over_default) <= THRESHOLDS["auto_over_default"]))
    if over_best:
        checks.append((f"auto/best worst {max(over_best):.3f} <= 1.05 on every job",
                       complete and max(over_best) <= THRESHOLDS["auto_over_best"]))
    if errors:
        median = statistics.median(errors)
        checks.append((f"median time error {median:.1%} <= 10%", median <= THRESHOLDS["median_time_error"]))
    if memory:
        worst = max(memory, key=abs)
        checks.append((f"worst memory error {worst:+.1%} within 10%", abs(worst) <= THRESHOLDS["worst_memory_error"]))
    if not complete:
        checks.append((f"auto or the default layout failed to run on {len(blocks) - min(len(over_default), len(over_best))}"
                       f" of {len(blocks)} jobs", False))
    ok = bool(checks) and all(good for _, good in checks)
    return "; ".join(f"{text}: {mark(good)}" for text, good in checks), ok


def selected(spec: str, model: str, world: int, gb: int, seq_len: int) -> bool:
    """Whether a job matches one of `spec`'s MODEL[/WORLD[/GBxSEQ]] entries."""
    for entry in spec.split(","):
        parts = entry.strip().split("/")
        if parts[0] == model and (len(parts) < 2 or parts[1] == str(world)) and \
                (len(parts) < 3 or parts[2] == f"{gb}x{seq_len}"):
            return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"one tiny job ({QUICK[0]} at {QUICK[3]} ranks), {QUICK_CONFIGS} other configurations, "
                             f"1 repeat")
    parser.add_argument("--world", default="4,8", help="comma-separated world sizes")
    parser.add_argument("--models", default=",".join(JOBS), help="comma-separated, from " + ", ".join(JOBS))
    parser.add_argument("--shapes", default="", help="only these batch shapes, e.g. 8x128 (global batch x seq len)")
    parser.add_argument("--jobs", default="", help="only these jobs: comma-separated MODEL[/WORLD[/GBxSEQ]], e.g. "
                        "gpt-mini/4/8x128,hf:llama/8 (within --world, --models and --shapes)")
    parser.add_argument("--configs", type=int, default=0,
                        help=f"other configurations per job besides auto's pick and the default layout "
                             f"(default {MAX_CONFIGS}, {QUICK_CONFIGS} quick)")
    parser.add_argument("--repeats", type=int, default=0, help=f"timed rounds, median kept (default {REPEATS}, 1 quick)")
    parser.add_argument("--confirm", type=int, default=None,
                        help="as `autopar train --confirm K` (default: unset, measure when unsure, as the CLI; "
                             f"{QUICK_CONFIRM} quick; `--quick --confirm 1` measures the fastest predicted and the "
                             "default layout first)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use the user's calibration cache instead of a fresh one (not a first run then)")
    parser.add_argument("--out", help="write every measurement and summary as JSON here")
    args = parser.parse_args()
    unknown = [m for m in args.models.split(",") if m not in JOBS]
    if unknown:
        parser.error(f"--models: {', '.join(unknown)} not among {', '.join(JOBS)}")
    repeats = args.repeats or (1 if args.quick else REPEATS)
    limit = args.configs or (QUICK_CONFIGS if args.quick else MAX_CONFIGS)
    confirm = args.confirm if args.confirm is not None else (QUICK_CONFIRM if args.quick else None)
    if args.quick:
        model, margs, shape, world = QUICK
        jobs = [(model, margs, world, *shape)]
    else:
        wanted = set(args.shapes.split(",")) - {""}
        jobs = [(m, JOBS[m][0], int(w), gb, s) for w in args.world.split(",") for m in args.models.split(",")
                for gb, s in JOBS[m][1] if not wanted or f"{gb}x{s}" in wanted]
        if args.jobs:
            jobs = [j for j in jobs if selected(args.jobs, j[0], j[2], j[3], j[4])]
            if not jobs:
                parser.error(f"--jobs {args.jobs}: no job of the set matches (models {', '.join(JOBS)}; worlds "
                             f"{args.world}; shapes {', '.join(sorted({f'{g}x{q}' for m in JOBS for g, q in JOBS[m][1]}))})")
    os.environ.pop("AUTOPAR_CLUSTER", None)  # as a user who never set it
    cache = None if args.keep_cache else tempfile.TemporaryDirectory(prefix="autopar-cache-")
    if cache:
        os.environ["AUTOPAR_CACHE_DIR"] = cache.name  # never calibrated: the first search per world measures
    began, load = time.perf_counter(), os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores; {len(jobs)} jobs, "
          f"{repeats} interleaved rounds each; calibration cache {'of this user' if args.keep_cache else 'fresh'}")
    report = {"load_average_at_start": load, "cores": os.cpu_count(), "repeats": repeats, "quick": args.quick,
              "blocks": []}
    try:
        for model, margs, world, gb, seq_len in jobs:
            job, parts, argv = build(model, margs, world, gb, seq_len, confirm)
            block = choose(job, parts, argv, world, limit)
            block.update(measure(model, margs, world, gb, seq_len, block, repeats))
            block.update(model=model, model_args=margs, world=world, global_batch=gb, seq_len=seq_len)
            block["verdict"] = judge(block)
            print_job(f"{model} at {world} ranks, global batch {gb} x {seq_len} tokens", block, block["verdict"])
            report["blocks"].append(block)
    finally:
        if cache:
            cache.cleanup()
    line, ok = summary_line(report["blocks"])
    report.update(summary=line, thresholds_met=ok, total_s=time.perf_counter() - began,
                  load_average_at_end=os.getloadavg())
    print(f"\nsummary over {len(jobs)} jobs: {line}")
    print(f"{'PASS' if ok else 'FAIL'}: the validation's thresholds "
          f"{'are all met' if ok else 'are not all met'} on this set")
    print(f"total {report['total_s']:.0f} s; load average at end {report['load_average_at_end'][0]:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
