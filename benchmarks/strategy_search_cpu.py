"""Where a training step's CPU goes, beside the strategy search's model of it (the time-shared bound).

On a CPU host with more ranks than cores the step model bounds the step by the CPU of the whole step summed
over the ranks / the cores they get (search/cost.py, step_cpu_terms). This script runs a few configurations
in one launch as benchmarks/strategy_search.py does (blocks measured on rank 0, then one Trainer per
configuration, one warm-up step) and splits each rank's CPU over a step:

    main thread (time.thread_time) around the trainer's phases: the step's inputs, the engine's
    forward_backward (within it, the pipeline's compute actions, timed on the thread's CPU clock), the
    gradient clip, the optimizer step, the scheduler and zero_grad, and the rest (the trainer's host syncs);
    other threads = time.process_time (every thread) - the main thread's: gloo's send/receive threads, and
    any other thread torch started.

Printed per configuration: each measured part summed over the ranks (median of --steps), and the model's
terms for the same configuration. Every number is one run on a shared machine: quote it with the load.

    PYTHONPATH=src python benchmarks/strategy_search_cpu.py [--world 4] [--model gpt-mini] [--steps 5]
        [--cluster FILE.toml] [--config "dp=1 tp=1 pp=4 mbs=8 sched=zb-h1 recompute=none zero=0 cp=1 cpmode=ring" ...]
    PYTHONPATH=src python benchmarks/strategy_search_cpu.py --quick   # smoke test: 2 ranks, 2 configurations
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strategy_search import GLOBAL_BATCH, MODELS, SEQ_LEN, calibrated_cluster  # noqa: E402

DEFAULT_CONFIGS = (  # configurations of a quiet 4-rank validation run (docs/benchmarks.md)
    "dp=1 tp=1 pp=4 mbs=8 sched=zb-h1",
    "dp=4 tp=1 pp=1 mbs=4 zero=2",
    "dp=1 tp=1 pp=4 mbs=4 sched=1f1b",
    "dp=4 tp=1 pp=1 mbs=1 zero=1",
    "dp=2 tp=1 pp=2 mbs=2 sched=1f1b zero=1",
    "dp=1 tp=2 pp=2 mbs=4 sched=1f1b",
)
QUICK_CONFIGS = ("dp=1 tp=1 pp=2 mbs=8 sched=zb-h1", "dp=2 tp=1 pp=1 mbs=4 zero=1")
QUICK_CLUSTER = Path(__file__).resolve().parent / "data" / "calibrated_2ranks.toml"  # `autopar calibrate --nproc 2`
PARTS = ("inputs", "forward_backward", "compute", "clip", "optimizer", "scheduler_zero_grad", "main_rest",
         "other_threads", "process")


def parse_config(text: str) -> dict:
    """'dp=1 tp=1 pp=4 mbs=8 sched=zb-h1 recompute=none zero=0' -> the fields (defaults: 1f1b, none, 0)."""
    fields = dict(item.split("=", 1) for item in text.split())
    return {"dp": int(fields.get("dp", 1)), "tp": int(fields.get("tp", 1)), "pp": int(fields.get("pp", 1)),
            "mbs": int(fields["mbs"]), "schedule": fields.get("sched", "1f1b"),
            "recompute": fields.get("recompute", "none"), "zero": int(fields.get("zero", 0)),
            "cp": int(fields.get("cp", 1)), "cp_mode": fields.get("cpmode", "ring")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--model", default="gpt-mini", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cluster", help="calibrated cluster TOML (default: calibrate now)")
    parser.add_argument("--config", action="append", help="a configuration (repeatable); default: six of the log's")
    parser.add_argument("--block-clock", choices=("thread", "wall"), default="thread",
                        help="time the blocks on rank 0 by its thread's CPU clock (default; load-robust) or by wall "
                             "time x CPU share as the benchmark does")
    parser.add_argument("--extra", type=int, default=0,
                        help="then build this many more trainers (not stepped) and measure the same steps again")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke test: --world 2, 2 steps, 2 configurations, "
                        "the cluster file of benchmarks/data/ unless --cluster")
    args = parser.parse_args()
    if args.worker:
        return worker(Path(args.worker))
    if args.quick:
        args.world, args.steps, args.config = 2, 2, args.config or list(QUICK_CONFIGS)
        args.cluster = args.cluster or str(QUICK_CLUSTER)
    from autopar.launch import launch
    configs = [parse_config(c) for c in (args.config or DEFAULT_CONFIGS)]
    for c in configs:
        if c["dp"] * c["tp"] * c["pp"] * c["cp"] != args.world:
            raise SystemExit(f"config {c} needs dp x tp x pp x cp = --world {args.world}")
    print(f"uptime at start: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    cluster = calibrated_cluster(args.cluster, args.world)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "cluster.toml").write_text(cluster.to_toml())
        spec = {"extra": args.extra, "block_clock": args.block_clock, "model": args.model, "world": args.world,
                "steps": args.steps, "configs": configs,
                "cluster": str(Path(tmp) / "cluster.toml"), "runs": str(Path(tmp) / "runs"),
                "out": str(Path(tmp) / "out.json")}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        if launch([sys.executable, __file__, "--worker", str(Path(tmp) / "spec.json")], args.world) != 0:
            raise SystemExit("the ranks failed")
        result = json.loads(Path(spec["out"]).read_text())
    print(f"{args.model} at {args.world} ranks; effective cores {result['cores']:.2f}; blocks' CPU per wall "
          f"{result['cpu_per_wall']:.2f}; ms per step, summed over the ranks (median of {args.steps} steps)")
    for row in result["rows"]:
        m, p = row["measured"], row["model"]
        print(f"\n{row['describe']}: wall {row['wall'] * 1e3:.1f} ms (slowest rank), predicted "
              f"{row['predicted'] * 1e3:.1f}")
        print("  measured  " + "; ".join(f"{k} {m[k] * 1e3:.1f}" for k in PARTS))
        top = sorted(row["threads"].items(), key=lambda kv: -kv[1])[:4]
        print("  threads   " + "; ".join(f"{name} {sec * 1e3:.1f}" for name, sec in top) + " (other threads by name)")
        print("  model     " + "; ".join(f"{k} {v * 1e3:.1f}" for k, v in p.items()) +
              f"; total {sum(p.values()) * 1e3:.1f}")
    print(f"\nuptime at end: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


def thread_timed(owner, attr: str, name: str, seconds: dict) -> None:
    """Wrap owner.attr so that the main thread's CPU seconds inside it add up in seconds[name]."""
    inner = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        began = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.thread_time() - began
    setattr(owner, attr, wrapper)


def model_terms(spec: dict, cluster, blocks, cores: float) -> tuple[list, float]:
    """Rank 0: each configuration's predicted step and CPU terms (seconds summed over the ranks)."""
    from autopar.search.cost import Candidate, StepModel
    from autopar.search.measure_profile import with_measured_blocks
    from autopar.search.profile import profile_model
    from autopar.search.ring_cost import with_ring_seconds
    world = spec["world"]
    profile = profile_model(spec["model"], seq_len=SEQ_LEN, model_args=MODELS[spec["model"]],
                            tp_degrees=tuple(d for d in (1, 2, 4, 8) if world % d == 0))
    profile = with_ring_seconds(with_measured_blocks(profile, blocks),  # a ring cp rank's attention, timed here
                                degrees=tuple(sorted({c["cp"] for c in spec["configs"] if c["cp"] > 1})))
    model = StepModel(profile, cluster.replace(cores_per_node=cores, memory_headroom=1.0),
                      global_batch_size=GLOBAL_BATCH)
    out = []
    for c in spec["configs"]:
        m = GLOBAL_BATCH // (c["dp"] * c["mbs"])
        cand = Candidate(dp=c["dp"], tp=c["tp"], pp=c["pp"], micro_batch_size=c["mbs"], num_microbatches=m,
                         schedule=c["schedule"], recompute=c["recompute"], partition="uniform", zero=c["zero"],
                         cp=c["cp"], cp_mode=c["cp_mode"])
        e = model.evaluate(cand)
        out.append((cand.describe(), e.step_time_s, {k[4:-2]: v for k, v in e.parts.items()
                                                      if k.startswith("cpu_") and k != "cpu_s"}))
    return out, profile.measured[0].cpu_per_wall


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each thread of this process but the main one, summed by thread name
    (/proc/self/task/*/schedstat: nanoseconds on a CPU; {} where there is no /proc)."""
    out: dict[str, float] = {}
    main = os.getpid()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        if int(tid) == main:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + ns * 1e-9
    return out


def worker(spec_path: Path) -> None:
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
    from autopar.models import build_model
    from autopar.search.calibrate_ranks import background_cores, sharing_probe
    from autopar.search.cluster import load_cluster
    from autopar.search.measure_profile import measure_blocks

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    blocks = None
    if rank == 0:
        if spec["block_clock"] == "thread":  # the blocks' own CPU seconds: what load on the machine barely moves
            import types

            from autopar.search import measure_profile
            measure_profile.time = types.SimpleNamespace(perf_counter=time.thread_time, thread_time=time.thread_time)
        blocks = measure_blocks(spec["model"], seq_len=SEQ_LEN, model_args=MODELS[spec["model"]])
    cores = sharing_probe()
    predicted = model_terms(spec, load_cluster(spec["cluster"]), blocks, cores) if rank == 0 else None
    corpus, tokenizer = load_corpus("stdlib"), build_tokenizer("byte")
    vocab = padded_vocab_size(tokenizer.vocab_size)
    state: dict = {}

    def build(i: int, c: dict):
        model, info = build_model(spec["model"], MODELS[spec["model"]], vocab_size=vocab, device="meta")
        if "data" not in state:
            state["data"], _ = build_datasets(corpus, tokenizer, seq_len=SEQ_LEN, task=info.task, seed=0)
        strategy = autopar.Strategy(dp=c["dp"], tp=c["tp"], pp=c["pp"], schedule=c["schedule"],
                                    partition="uniform", recompute="all" if c["recompute"] == "all" else "none",
                                    zero=c["zero"], cp=c["cp"], cp_mode=c["cp_mode"])
        config = autopar.TrainConfig(steps=10_000, global_batch_size=GLOBAL_BATCH, micro_batch_size=c["mbs"],
                                     progress=False, out=f"{spec['runs']}/{i}", warmup_steps=1)
        trainer = autopar.Trainer(model, state["data"], strategy=strategy, config=config)
        trainer._setup()
        trainer.train_step(0)
        return trainer

    trainers = []
    for i, c in enumerate(spec["configs"]):
        trainer = build(i, c)
        seconds: dict = {}
        thread_timed(trainer.steps, "inputs", "inputs", seconds)  # the step's micro-batches (train/steps.py)
        thread_timed(trainer.engine, "forward_backward", "forward_backward", seconds)
        thread_timed(trainer.engine, "clip_gradients", "clip", seconds)
        thread_timed(trainer.optimizer, "step", "optimizer", seconds)
        thread_timed(trainer.scheduler, "step", "scheduler_zero_grad", seconds)
        thread_timed(trainer.engine, "zero_grad", "scheduler_zero_grad", seconds)
        runtime = getattr(trainer.engine, "runtime", None)
        if runtime is not None:  # the pipeline's action marks on this thread's CPU clock (CPU tensors only)
            runtime.clock.mark = time.thread_time
        trainers.append((trainer, seconds))

    def measure() -> tuple[list, list]:
        samples = [[] for _ in trainers]
        threads = [{} for _ in trainers]  # per configuration: other threads' CPU seconds over all steps, by name
        for step in range(spec["steps"]):
            for k, (trainer, seconds) in enumerate(trainers):  # interleaved, as the benchmark times them
                dist.barrier()
                seconds.clear()
                before = thread_cpu()
                wall, process, main = time.perf_counter(), time.process_time(), time.thread_time()
                trainer.train_step(1 + step)
                wall, process, main = (time.perf_counter() - wall, time.process_time() - process,
                                       time.thread_time() - main)
                events = getattr(trainer.engine, "last_events", []) if hasattr(trainer.engine, "runtime") else []
                compute = sum(end - start for start, end, action in events if action.op.is_compute)
                known = sum(seconds.get(k, 0.0) for k in ("inputs", "forward_backward", "clip", "optimizer",
                                                         "scheduler_zero_grad"))
                for name, used in thread_cpu().items():
                    threads[k][name] = threads[k].get(name, 0.0) + used - before.get(name, 0.0)
                mine = [seconds.get("inputs", 0.0), seconds.get("forward_backward", 0.0), compute,
                        seconds.get("clip", 0.0), seconds.get("optimizer", 0.0),
                        seconds.get("scheduler_zero_grad", 0.0), main - known, process - main, process]
                summed = torch.tensor(mine, dtype=torch.float64)
                dist.all_reduce(summed)
                slowest = torch.tensor([wall], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                samples[k].append((float(slowest), summed.tolist()))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, threads)
        return samples, gathered

    background = background_cores()
    rounds = [(f"[{len(trainers)} trainers alive, idle threads {background:.3f} cores] ", measure())]
    if spec["extra"]:  # the same steps again with more trainers alive (the benchmark keeps ~22 at once)
        idle = [build(len(trainers) + j, spec["configs"][j % len(spec["configs"])]) for j in range(spec["extra"])]
        background = background_cores()
        rounds.append((f"[{len(trainers) + len(idle)} trainers alive, idle threads {background:.3f} cores] ",
                       measure()))
        for trainer in idle:
            trainer.engine.close()
    for trainer, _ in trainers:
        trainer.engine.close()
    if rank == 0:
        rows = []
        (terms, cpu_per_wall) = predicted
        for label, (samples, gathered) in rounds:
            for k, ((describe, step_s, model_cpu), got) in enumerate(zip(terms, samples)):
                rows.append({"describe": label + describe, "predicted": step_s, "model": model_cpu,
                             "wall": statistics.median(w for w, _ in got),
                             "threads": {name: sum(g[k].get(name, 0.0) for g in gathered) / spec["steps"]
                                         for name in {n for g in gathered for n in g[k]}},
                             "measured": {name: statistics.median(p[j] for _, p in got)
                                          for j, name in enumerate(PARTS)}})
        Path(spec["out"]).write_text(json.dumps({"cores": cores, "cpu_per_wall": cpu_per_wall, "rows": rows}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
