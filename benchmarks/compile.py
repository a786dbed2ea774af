"""What --compile buys: step time eager against compiled, per model and layout, and dropout's cost under both.

Part 1, layouts: for each model and layout, the ranks build two trainers of the same job, one eager
and one with TrainConfig(compile=True), and time their steps interleaved (the order alternates
round by round, so drift on a shared machine hits both alike); the slowest rank's time counts, the
table gives medians and the ratio compiled / eager. Compile time is reported apart: the seconds
torch.compile spent (its own account, as summary.json gives it) and the wall time of the compiled
trainer's warm-up steps. A model with dropout is timed as its own case. `--profile N` then profiles N more steps of each trainer
(interleaved) and prints rank 0's operations side by side: each one's self CPU time, the least over the N
steps (a step slowed by the machine's other work inflates every op; the least is the op's own cost),
to see where compiled and eager steps differ (docs/features/compile.md quotes it).

Part 2, dropout: one process, gpt-tiny with dropout 0.1, four variants (torch's dropout or the
layout-free one, eager or compiled blocks), alternating; the layout-free overhead over torch's
dropout, eager against compiled (the hash is ~10 int64 element-wise passes that inductor fuses).

    PYTHONPATH=src python benchmarks/compile.py                     # gpt-small + hf:llama, dp1 dp2 pp2 tp2
    PYTHONPATH=src python benchmarks/compile.py --models gpt-small --layouts dp1,pp2 --rounds 5
    PYTHONPATH=src python benchmarks/compile.py --models gpt-small --layouts dp1 --profile 4 --no-dropout-part
    PYTHONPATH=src python benchmarks/compile.py --quick              # smoke test: gpt-tiny dp1, aot_eager

Compiled kernels are cached (autopar's cache folder, or TORCHINDUCTOR_CACHE_DIR): a second run
compiles from the cache, which the compile column shows.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch
import torch.multiprocessing as mp

LAYOUTS = {"dp1": (1, {}), "dp2": (2, {"dp": 2}), "pp2": (2, {"pp": 2, "schedule": "1f1b"}), "tp2": (2, {"tp": 2})}
MODEL_ARGS = {"gpt-small": {},
              "gpt-tiny": {"n_layer": 2, "d_model": 32, "n_head": 2, "dropout": 0.1},  # tests/test_compile.py's model
              "hf:llama": {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 704,
                           "num_attention_heads": 8, "num_key_value_heads": 4}}


def _rank(rank: int, world: int, port: int, job: dict, results) -> None:
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    import autopar
    from autopar.data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
    from autopar.models import build_model

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*optimizer.step.*overridden")  # our timer around optimizer.step
    dist.init_process_group("gloo")
    tokenizer = build_tokenizer("byte")
    train_data = None
    trainers = {}
    for variant in ("eager", "compiled"):
        model, info = build_model(job["model"], job["model_args"], vocab_size=padded_vocab_size(tokenizer.vocab_size),
                                  device="meta")
        if train_data is None:
            train_data, _ = build_datasets(load_corpus("stdlib"), tokenizer, seq_len=job["seq"], task=info.task, seed=0)
        config = autopar.TrainConfig(steps=10_000, global_batch_size=job["batch"], micro_batch_size=job["micro"],
                                     progress=False, warmup_steps=1, out=f"{job['runs']}/{variant}",
                                     compile=variant == "compiled", compile_backend=job["backend"])
        trainer = autopar.Trainer(model, train_data, strategy=autopar.Strategy(**job["strategy"]), config=config)
        trainer._setup()
        trainers[variant] = trainer
    optimizer_s = {variant: [0.0, 0.0] for variant in trainers}  # (wall, CPU) seconds in optimizer.step, timed rounds
    for variant, trainer in trainers.items():
        _time_optimizer_steps(trainer.optimizer, optimizer_s[variant])
    warm: dict[str, float] = {}
    for variant, trainer in trainers.items():  # the first steps: a whole model's first is eager (its dropout
        began = time.perf_counter()  # check), the compiled trainer compiles in the others
        for step in range(3):
            trainer.train_step(step)
        warm[variant] = time.perf_counter() - began
        optimizer_s[variant][:] = [0.0, 0.0]
    times = {variant: [] for variant in trainers}
    cpu_times = {variant: [] for variant in trainers}
    order = list(trainers)
    for r in range(job["rounds"]):
        for variant in (order if r % 2 == 0 else order[::-1]):
            dist.barrier()
            began, began_cpu = time.perf_counter(), time.process_time()
            trainers[variant].train_step(3 + r)
            elapsed = torch.tensor([time.perf_counter() - began, time.process_time() - began_cpu], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's wall time, the busiest rank's CPU
            times[variant].append(float(elapsed[0]))
            cpu_times[variant].append(float(elapsed[1]))
    profile = _profile_steps(trainers, 3 + job["rounds"], job["profile"]) if job["profile"] else []
    if rank == 0:
        account = trainers["compiled"].account.compiled.summary()
        results.put({"profile": profile, "median": {v: statistics.median(t) for v, t in times.items()},
                     "cpu": {v: statistics.median(t) for v, t in cpu_times.items()},
                     "optimizer": {v: [s / job["rounds"] for s in wc] for v, wc in optimizer_s.items()}, "warm": warm,
                     "optimizer_kernel": account["optimizer_kernel"],
                     "compile_s": account["compile_s"], "cache_hits": account["cache_hits"],
                     "cache_misses": account["cache_misses"], "recompiles": account["recompiles"],
                     "graph_breaks": sum(account["graph_breaks"].values())})
    dist.barrier()
    dist.destroy_process_group()


def _profile_steps(trainers: dict, first_step: int, count: int) -> list[tuple[str, float, int, float, int]]:
    """This rank's operations in `count` profiled steps of each trainer (interleaved): (name, eager ms, eager calls,
    compiled ms, compiled calls), self CPU time, the least over the steps; the largest first."""
    from torch.profiler import ProfilerActivity, profile
    import torch.distributed as dist
    seen: dict[str, dict[str, list[tuple[float, int]]]] = {variant: {} for variant in trainers}
    step, order = first_step, list(trainers)
    for r in range(count):
        for variant in (order if r % 2 == 0 else order[::-1]):
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainers[variant].train_step(step)
            step += 1
            for event in prof.key_averages():
                seen[variant].setdefault(event.key, []).append((event.self_cpu_time_total / 1e3, event.count))
    least = {variant: {op: (min(ms for ms, _ in runs), runs[0][1]) for op, runs in ops.items()}
             for variant, ops in seen.items()}
    eager, compiled = least["eager"], least["compiled"]
    rows = [(op, *eager.get(op, (0.0, 0)), *compiled.get(op, (0.0, 0))) for op in set(eager) | set(compiled)]
    return sorted(rows, key=lambda row: -max(row[1], row[3]))


def _print_profile(rows: list, top: int = 30) -> None:
    print(f"    rank 0's operations, self CPU ms (the least of the profiled steps) and calls per step; the {top} largest:")
    print(f"    {'operation':<64} {'eager ms':>9} {'calls':>6} {'compiled ms':>12} {'calls':>6}")
    for op, eager_ms, eager_n, compiled_ms, compiled_n in rows[:top]:
        print(f"    {op[:64]:<64} {eager_ms:9.1f} {eager_n:6d} {compiled_ms:12.1f} {compiled_n:6d}")
    print(f"    {'all operations (sum)':<64} {sum(r[1] for r in rows):9.1f} {'':>6} {sum(r[3] for r in rows):12.1f}")


def _time_optimizer_steps(optimizer, total: list[float]) -> None:
    """Add each optimizer.step's wall and CPU seconds to `total` (this rank's): how much of a step the update is."""
    step = optimizer.step

    def timed(*args, **kwargs):
        began, began_cpu = time.perf_counter(), time.process_time()
        out = step(*args, **kwargs)
        total[0] += time.perf_counter() - began
        total[1] += time.process_time() - began_cpu
        return out
    optimizer.step = timed


def time_layout(job: dict, world: int) -> dict:
    from autopar.launch import free_port
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, free_port(), job, results), nprocs=world, start_method="spawn", join=True)
    return results.get()


def dropout_overhead(batch: int, seq: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Median step time (wall, process CPU) of gpt-tiny with dropout 0.1: torch's or layout-free dropout, eager or
    compiled blocks."""
    from autopar.dropout import dropout_step, eager_micro_batch
    from autopar.models.gpt import GPT, GPTConfig
    from autopar.train.compile import compile_regions, repeated_blocks, use_inductor_cache

    use_inductor_cache()
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=4, d_model=64, max_seq_len=256, vocab_size=512, dropout=0.1)
    eager, compiled = GPT(config), GPT(config)
    compiled.load_state_dict(eager.state_dict())
    compile_regions(repeated_blocks(compiled))
    ids = torch.randint(0, 512, (batch, seq))

    @contextlib.contextmanager
    def layout_free():
        with dropout_step(0, 1, [list(range(batch))]), eager_micro_batch(0):
            yield

    def step(model, scope) -> tuple[float, float]:
        began, began_cpu = time.perf_counter(), time.process_time()
        with scope():
            logits = model(ids)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - began, time.process_time() - began_cpu

    variants = {"eager, torch dropout": (eager, contextlib.nullcontext), "eager, layout-free": (eager, layout_free),
                "compiled, torch dropout": (compiled, contextlib.nullcontext),
                "compiled, layout-free": (compiled, layout_free)}
    for model, scope in variants.values():  # warm-up: compiles
        step(model, scope), step(model, scope)
    times = {name: [] for name in variants}
    for r in range(rounds):
        names = list(variants)
        for name in names[r % 4:] + names[:r % 4]:
            times[name].append(step(*variants[name]))
    return {name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for name, t in times.items()}


def _load() -> str:
    import os
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-small,hf:llama")
    parser.add_argument("--layouts", default="dp1,dp2,pp2,tp2")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dropout-model", default="gpt-small", help="the model timed again with dropout 0.1 (dp1)")
    parser.add_argument("--no-dropout-part", action="store_true", help="skip part 2")
    parser.add_argument("--backend", default="inductor", help="TrainConfig.compile_backend: inductor | aot_eager")
    parser.add_argument("--quick", action="store_true", help="smoke test of the script: gpt-tiny (dropout 0.1) at dp1, "
                                                             "2 rounds of 2 x 16, aot_eager (no kernels built)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N steps of each trainer (after the timed ones) and print rank 0's operations")
    parser.add_argument("--runs", default="runs/bench-compile", help="run folders of the timed trainers")
    args = parser.parse_args()
    if args.quick:
        args.models, args.layouts, args.seq, args.batch, args.rounds = "gpt-tiny", "dp1", 16, 2, 2
        args.dropout_model, args.no_dropout_part, args.backend = "", True, "aot_eager"
        args.profile = args.profile or 1
    cases = [(m, layout, {}) for m in args.models.split(",") for layout in args.layouts.split(",")]
    if args.dropout_model:
        dropout_arg = {"attention_dropout": 0.1} if args.dropout_model.startswith("hf:") else {"dropout": 0.1}
        cases.append((args.dropout_model, "dp1", dropout_arg))
    print(f"eager vs --compile (backend {args.backend}), CPU, one thread per rank, global batch {args.batch} x "
          f"{args.seq} tokens, median of {args.rounds} interleaved steps; wall: the slowest rank, CPU: the busiest "
          f"rank's process CPU time (less sensitive to other jobs on the machine); compile apart; load average "
          f"{_load()}")
    print(f"  {'model':<10} {'layout':<6} {'dropout':<8} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6} "
          f"{'CPU ms e/c':>13} {'CPU ratio':>9} {'optim CPU ms e/c':>17} {'compile s':>10} {'warm-up s e/c':>14} "
          f"{'cache hit/miss':>15} {'recompiles':>10} {'breaks':>6}")
    for model, layout, extra in cases:
        world, strategy = LAYOUTS[layout]
        micro = args.batch // (strategy.get("dp", 1) * (2 if strategy.get("pp", 1) > 1 else 1))
        job = {"model": model, "model_args": {**MODEL_ARGS.get(model, {}), **extra}, "strategy": strategy,
               "seq": args.seq, "batch": args.batch, "micro": micro, "rounds": args.rounds, "backend": args.backend,
               "profile": args.profile,
               "runs": f"{args.runs}/{model.replace(':', '-')}-{layout}"}
        r = time_layout(job, world)
        eager, compiled = r["median"]["eager"], r["median"]["compiled"]
        cpu_e, cpu_c = r["cpu"]["eager"], r["cpu"]["compiled"]
        optim_e, optim_c = r["optimizer"]["eager"][1], r["optimizer"]["compiled"][1]
        dropout = str(job["model_args"].get("dropout") or job["model_args"].get("attention_dropout") or "off")
        print(f"  {model:<10} {layout:<6} {dropout:<8} {eager * 1e3:9.1f} {compiled * 1e3:12.1f} "
              f"{compiled / eager:6.2f} {f'{cpu_e * 1e3:.0f}/{cpu_c * 1e3:.0f}':>13} {cpu_c / cpu_e:9.2f} "
              f"{f'{optim_e * 1e3:.0f}/{optim_c * 1e3:.0f}':>17} "
              f"{r['compile_s']:10.1f} {r['warm']['eager']:6.1f}/{r['warm']['compiled']:<7.1f} "
              f"{r['cache_hits']:>7}/{r['cache_misses']:<7} {r['recompiles']:>10} {r['graph_breaks']:>6}", flush=True)
        if r["profile"]:
            _print_profile(r["profile"])
    print(f"  (compiled optimizer update: {r['optimizer_kernel']}; load average at the end {_load()})")
    if not args.no_dropout_part:
        torch.set_num_threads(1)
        batch, seq = (2, 32) if args.quick else (8, 128)
        median = dropout_overhead(batch, seq, max(args.rounds, 8))
        print(f"dropout 0.1 on gpt-tiny (2 layers, d_model 64), batch {batch} x {seq}, one thread, median of "
              f"{max(args.rounds, 8)} alternating forward+backward passes")
        for name, (wall, cpu) in median.items():
            base_wall, base_cpu = median[name.split(",")[0] + ", torch dropout"]
            print(f"  {name:<26} {wall * 1e3:8.2f} ms ({cpu * 1e3:.2f} CPU ms)   layout-free overhead "
                  f"x{wall / base_wall:.2f} (CPU x{cpu / base_cpu:.2f})")


if __name__ == "__main__":
    main()
