"""Pipeline schedules: autopar's runtime against torch.distributed.pipelining, memory, recomputation, simulator.

One command, four parts, all on the same model, the same 2-stage partition and the same data
(pp=2: two ranks, gloo, CPU, one thread per rank):

  1. ours vs torch   our `gpipe` and `1f1b` (autopar.pipeline.build_local_pipeline, the set-up
                     PipelineEngine runs) against torch's ScheduleGPipe / Schedule1F1B driving a
                     PipelineStage built on the very same StageModule (fresh copy per variant,
                     identical initial weights). Steps interleaved, medians; then a check that
                     losses, gradients and parameters agree to 1e-5.
  2. peak memory     every variant in a fresh run of its own: peak RSS per rank minus a
                     baseline run that only builds the stage, and the peak bytes autograd keeps
                     during a step (saved-tensor hooks).
  3. recomputation   1f1b recomputing every stage against scp with stage-aware block
                     recomputation chosen by autopar.pipeline.recompute.plan_pipeline_recompute for a
                     budget equal to what 1f1b-with-full-recomputation needs.
  4. simulator       per-(stage, op) compute times measured from the runtime's recorded events
                     fed into autopar.pipeline.simulate.simulate: predicted makespan against
                     the measured step time, for gpipe, 1f1b, eager-1f1b, zb-h1, scp and
                     interleaved-1f1b (chunks=2, 4-stage partition).
  5. zero bubble     the I/W split (B against I + W in one process, bytes held between them), then
                     at pp 2 and 4 (own worlds of pp ranks): our 1f1b, zb-h1 and zbv against torch's
                     Schedule1F1B, ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble on the
                     same StageModules, with bubble fractions and the simulator's prediction.

    python benchmarks/pipeline_schedules.py            # default run (~1.5 min on 2 idle cores, ~3 when busy)
    python benchmarks/pipeline_schedules.py --quick    # smoke test (< 45 s)
    python benchmarks/pipeline_schedules.py --parts 5  # the zero-bubble study alone

Each study lives in benchmarks/pipeline/ (ours_vs_torch, memory, recomputation, simulator; common
holds what they share); this file parses the options, starts the processes and prints the report.
Processes start from a forkserver that has imported torch and autopar once (a fresh process
per run, without paying the import every time); every process group has a 120 s timeout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.launch import free_port
from pipeline.common import MEMORY, PP, PRELOAD, TIMEOUT, Setup, report_header
from pipeline.memory import memory_run, report_part2
from pipeline.ours_vs_torch import part1, report_part1
from pipeline.recomputation import part3, report_part3
from pipeline.simulator import part4, report_part4
from pipeline.zero_bubble import part5, report_part5


# ----------------------------------------------------------------------------- processes


def worker(rank: int, port: int, args, job: str, out_dir: str, blocks: dict | None = None) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=PP, timeout=TIMEOUT)
    try:
        setup = Setup(args)
        if job == "main":
            result = {"params": sum(setup.graph.param_numel.values()),
                      "partition": setup.part(PP).table(), "partition4": setup.part(2 * PP).table()}
            for name, fn in (("part1", part1), ("part3", part3), ("part4", part4)):
                if name in args.parts:
                    begin = time.perf_counter()
                    result[name] = fn(setup)
                    result[name]["wall"] = time.perf_counter() - begin
                    if rank == 0:
                        print(f"  [{name} done in {result[name]['wall']:.0f} s]", file=sys.stderr, flush=True)
            if rank == 0:
                Path(out_dir, "main.json").write_text(json.dumps(result, default=str))
        else:
            result = memory_run(setup, job, blocks)
            gathered = [None] * PP
            dist.all_gather_object(gathered, result)
            if rank == 0:
                Path(out_dir, "memory.json").write_text(json.dumps(gathered, default=str))
        dist.barrier()  # no rank tears down while its peer still has gloo work in flight
    finally:
        dist.destroy_process_group()


def launch(args, job: str, blocks: dict | None = None) -> dict | list:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(free_port(), args, job, out, blocks), nprocs=PP, join=True,
                           start_method="forkserver")
        name = "main.json" if job == "main" else "memory.json"
        return json.loads(Path(out, name).read_text())


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Pipeline schedules on CPU/gloo with pp=2: autopar's runtime vs torch.distributed.pipelining "
                    "(time and gradients), peak memory per rank, scp + stage-aware recomputation vs 1f1b + full "
                    "recomputation, and simulated vs measured step times. Prints tables with ratios.")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, few steps, part 5 at pp 2 only")
    parser.add_argument("--layers", type=int, default=4, help="gpt-mini n_layer (default 4)")
    parser.add_argument("--d-model", type=int, default=None, help="gpt-mini d_model (default: gpt-mini's 128)")
    parser.add_argument("--mb", type=int, default=4, help="sequences per micro-batch (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant in part 1 (default 40)")
    parser.add_argument("--steps3", type=int, default=20, help="timed steps per variant in part 3 (default 20)")
    parser.add_argument("--steps4", type=int, default=15, help="timed steps per schedule in part 4 (default 15)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps in parts 1 and 3 (default 3)")
    parser.add_argument("--parts", default="1,2,3,4,5", help="which parts to run (default 1,2,3,4,5)")
    parser.add_argument("--steps5", type=int, default=10, help="timed steps per variant in part 5 (default 10)")
    parser.add_argument("--pp5", default="2,4", help="pipeline sizes of part 5 (default 2,4)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    args = parser.parse_args(argv)
    args.vocab, args.warmup4, args.mem_steps = 320, 2, 2
    if args.quick:
        args.layers, args.d_model, args.mb, args.seq, args.m = 2, 64, 2, 32, 4
        args.steps, args.steps3, args.steps4, args.warmup, args.warmup4, args.mem_steps = 4, 3, 3, 1, 1, 1
        args.steps5, args.pp5 = 3, "2"
    args.model_args = {"n_layer": args.layers, **({"d_model": args.d_model} if args.d_model else {})}
    args.parts = {f"part{p.strip()}" for p in args.parts.split(",") if p.strip()}
    args.pp5 = [int(p) for p in args.pp5.split(",") if p.strip()]
    if any(p < 2 for p in args.pp5):
        parser.error(f"--pp5 takes pipeline sizes >= 2, got {args.pp5}; use e.g. --pp5 2,4")
    if args.m < PP or args.m % PP:
        parser.error(f"--m must be a positive multiple of {PP} (interleaved-1f1b runs micro-batches in groups of pp)")
    if min(args.steps, args.steps3, args.steps4) < 1 or args.warmup < 0:
        parser.error("--steps/--steps3/--steps4 must be >= 1 and --warmup >= 0")
    return args


def planned_blocks(main_result: dict, label: str) -> dict | None:
    """The block plan part 3 chose for `label` (stage -> blocks), so that memory runs need not plan."""
    if "part3" not in main_result:
        return None
    blocks = {}
    for rank_part in main_result["part3"]["ranks"]:
        for s, k in rank_part["plans"].get(label, {}).get("blocks", {}).items():
            blocks[int(s)] = k
    return blocks or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.load = os.getloadavg()
    print(f"$ python {' '.join(['benchmarks/pipeline_schedules.py', *(sys.argv[1:] if argv is None else argv)])}")
    begin = time.perf_counter()
    multiprocessing.set_forkserver_preload(PRELOAD)
    main_result = launch(args, "main") if args.parts - {"part5"} else {"params": 0, "partition": "", "partition4": ""}
    memory = {}
    if "part2" in args.parts:
        labels = MEMORY if not args.quick else ["baseline", "ours 1f1b", "torch 1f1b", "scp, no R + plan"]
        for label in labels:
            memory[label] = launch(args, label, planned_blocks(main_result, label))
            print(f"  [memory run '{label}' done]", file=sys.stderr, flush=True)
    print(report_header(args, main_result))
    ok = True
    if "part1" in main_result:
        print(report_part1(main_result["part1"]))
        ok &= main_result["part1"]["ok"]
    if memory:
        print(report_part2(memory, args))
    if "part3" in main_result:
        print(report_part3(main_result["part3"], args, memory))
        ok &= main_result["part3"]["ok"]
    if "part4" in main_result:
        print(report_part4(main_result["part4"], args, main_result))
        ok &= main_result["part4"]["ok"]
    if "part5" in args.parts:
        print(report_part5(part5(args), args))
    print(f"total wall time {time.perf_counter() - begin:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
