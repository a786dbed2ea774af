"""Where zbv's step time goes at pp=2: our 1f1b, zb-h1 and zbv against torch's Schedule1F1B and
ScheduleZBVZeroBubble on the same StageModules, in one run, with each rank's work taken apart.

Two ranks (gloo, CPU, one thread each), gpt-mini (6 layers by default, as part 5 of pipeline_schedules.py),
m micro-batches of 4 x 64 tokens. Steps interleaved across the five variants (order rotating), a barrier
before each, the slower rank's wall time, medians. For each rank and variant:

  cpu      the main thread's CPU time per step (time.thread_time): the work a core must do. On a machine
           with more runnable threads than cores the wall time follows this, not the schedule's bubble.
  compute  for ours, the CPU time inside compute actions (the runtime's record=True, clock set to the
           thread's CPU clock), by stage and op; post = CPU time posting communication groups;
           wait = wall time blocked in receive waits.

Then the simulator (pipeline/simulate.py) plays our lowered schedules with the per-(stage, op) mean CPU
costs: what the step would take with a core per rank and free transfers (a prediction), and for zbv two
counterfactuals that say which part of the gap is which: the two chunks of each rank given equal costs
(the same total), and I + W of every stage but the first costing B (the split's overhead removed, by
the ratio (I + W) / B measured on zb-h1's and 1f1b's second stage in this run).

    PYTHONPATH=src python benchmarks/zbv_breakdown.py [--steps 10] [--layers 6] [--m 8]
    PYTHONPATH=src python benchmarks/zbv_breakdown.py --quick    # smoke test: 2 layers, m 4, 2 timed steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

from autopar.launch import free_port
from autopar.pipeline.actions import Action, Op, stage_to_rank
from autopar.pipeline.build import build_local_pipeline
from autopar.pipeline.p2p import P2P
from autopar.pipeline.simulate import simulate
from pipeline.common import TIMEOUT, Setup

OURS = [("ours 1f1b", "1f1b", 1), ("ours zb-h1", "zb-h1", 1), ("ours zbv", "zbv", 2)]
TORCH = [("torch 1F1B", Schedule1F1B, 1), ("torch ZBV", ScheduleZBVZeroBubble, 2)]


class _Waited:
    def __init__(self, inner, log: dict):
        self.inner, self.log = inner, log

    def wait(self):
        start = time.perf_counter()
        result = self.inner.wait()
        self.log["wait"] += time.perf_counter() - start
        return result


class _LoggedP2P(P2P):
    """P2P that logs the CPU time of posting each group and the wall time of each receive wait."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.log: dict[str, float] = defaultdict(float)

    def exchange(self, sends, recvs):
        start = time.thread_time()
        out = super().exchange(sends, recvs)
        self.log["post"] += time.thread_time() - start
        return [_Waited(p, self.log) for p in out]


def _worker(rank: int, port: int, args, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=TIMEOUT)
    try:
        setup, runs = Setup(args), {}
        for label, schedule, chunks in OURS:
            group = dist.new_group([0, 1], timeout=TIMEOUT)
            p2p = _LoggedP2P(group, torch.device("cpu"), 2 * chunks, args.m)
            pipe = build_local_pipeline(setup.model, pp=2, pp_rank=rank, pp_group=group, device="cpu", seed=0,
                                        example_batch=setup.batches(0)[0], num_microbatches=args.m,
                                        schedule=schedule, chunks=chunks, partition=setup.part(2 * chunks), p2p=p2p)
            pipe.runtime.clock.mark = time.thread_time  # recorded action times = this thread's CPU time
            runs[label] = pipe
        for label, cls, chunks in TORCH:
            group, n = dist.new_group([0, 1], timeout=TIMEOUT), 2 * chunks
            mine = [s for s in range(n) if stage_to_rank(s, 2, n, "v" if chunks == 2 else "loop") == rank]
            modules = [setup.stage(s, n) for s in mine]
            stages = [PipelineStage(m, s, n, torch.device("cpu"), group=group) for m, s in zip(modules, mine)]
            runs[label] = (cls(stages if chunks > 1 else stages[0], args.m, loss_fn=setup.loss, scale_grads=False),
                           modules, 0 in mine, n - 1 in mine)
        labels, wall, stats = list(runs), defaultdict(list), defaultdict(list)
        for step in range(args.warmup + args.steps):
            batches = setup.batches(step)
            shift = step % len(labels)
            for label in labels[shift:] + labels[:shift]:
                run = runs[label]
                dist.barrier()
                cpu0, t0 = time.thread_time(), time.perf_counter()
                row: dict = {}
                if isinstance(run, tuple):
                    schedule, modules, first, last = run
                    kw = {"target": torch.cat([b["labels"] for b in batches]), "losses": []} if last else {}
                    schedule.step(*((torch.cat([b["input_ids"] for b in batches]),) if first else ()),
                                  return_outputs=False, **kw)
                    params = [p for m in modules for p in m.parameters()]
                else:
                    run.runtime.p2p.log.clear()
                    record = run.runtime.run(run.actions, batches, record=True,
                                             loss_fn=lambda o, b: setup.loss(o, b["labels"]))
                    by = defaultdict(float)
                    for begin, end, action in record.events:
                        by[f"{action.stage}{action.op.value}"] += end - begin
                    row = {"by": dict(by), **run.runtime.p2p.log}
                    params = [p for s in run.stages.values() for p in s.parameters()]
                row["cpu"], elapsed = time.thread_time() - cpu0, time.perf_counter() - t0
                for p in params:
                    p.grad = None
                slowest = torch.tensor([elapsed])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if step >= args.warmup:
                    wall[label].append(float(slowest))
                    stats[label].append(row)
        mine = {"wall": wall, "stats": stats}
        if rank == 0:
            mine["schedules"] = {label: {r: [[a.stage, a.op.value, a.microbatch, a.peer, a.step] for a in acts]
                                         for r, acts in runs[label].schedule.items()} for label, _, _ in OURS}
        gathered = [None, None]
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _simulate(schedule: dict, chunks: int, m: int, cost: dict) -> float:
    lists = {int(r): [Action(s, Op(op), mb, peer=peer, step=step) for s, op, mb, peer, step in acts]
             for r, acts in schedule.items()}
    return simulate(lists, pp=2, num_stages=2 * chunks, num_microbatches=m, style="v" if chunks == 2 else "loop",
                    cost=lambda a: cost[f"{a.stage}{a.op.value}"]).makespan


def report(ranks: list, args) -> str:
    med = statistics.median
    wall = ranks[0]["wall"]
    base = med(wall["ours 1f1b"])
    lines = [f"pp=2, m={args.m}, gpt-mini n_layer={args.layers}, {args.steps} timed steps after {args.warmup} "
             f"warm-up, 2 ranks on {os.cpu_count()} cores; medians",
             f"  {'variant':12s} {'wall ms':>8s} {'/ours 1f1b':>10s} | {'cpu r0':>7s} {'cpu r1':>7s} | "
             f"{'post r0/r1':>11s} {'wait r0/r1':>12s}"]
    for label in wall:
        s0, s1 = ranks[0]["stats"][label], ranks[1]["stats"][label]
        post = " / ".join(f"{med(x.get('post', 0) for x in s) * 1e3:.1f}" for s in (s0, s1)) if "by" in s0[0] else "-"
        wait = " / ".join(f"{med(x.get('wait', 0) for x in s) * 1e3:.1f}" for s in (s0, s1)) if "by" in s0[0] else "-"
        lines.append(f"  {label:12s} {med(wall[label]) * 1e3:8.1f} {med(wall[label]) / base:10.3f} | "
                     f"{med(x['cpu'] for x in s0) * 1e3:7.1f} {med(x['cpu'] for x in s1) * 1e3:7.1f} | "
                     f"{post:>11s} {wait:>12s}")
    cpu = lambda r, label: med(x["cpu"] for x in ranks[r]["stats"][label])
    lines.append(f"  zbv / torch ZBV {med(wall['ours zbv']) / med(wall['torch ZBV']):.3f}; ours 1f1b / torch 1F1B "
                 f"{base / med(wall['torch 1F1B']):.3f}; main-thread CPU per step, zbv / 1f1b: "
                 + ", ".join(f"r{r} {cpu(r, 'ours zbv') / cpu(r, 'ours 1f1b'):.3f}" for r in (0, 1)))
    costs = {}
    lines.append("  per-action CPU cost (ms, mean per micro-batch), stage+op:")
    for label, _, _ in OURS:
        cost = {k: statistics.fmean(x["by"][k] for x in r["stats"][label]) / args.m
                for r in ranks for k in r["stats"][label][0]["by"]}
        costs[label] = cost
        per_rank = [sum(statistics.fmean(x["by"][k] for x in r["stats"][label]) for k in r["stats"][label][0]["by"])
                    for r in ranks]
        lines.append(f"    {label:12s} " + " ".join(f"{k}={v * 1e3:.2f}" for k, v in sorted(costs[label].items()))
                     + f"  | compute per step r0 {per_rank[0] * 1e3:.1f}, r1 {per_rank[1] * 1e3:.1f}")
    schedules = ranks[0]["schedules"]
    predicted = {label: _simulate(schedules[label], chunks, args.m, costs[label]) for label, _, chunks in OURS}
    zbv = costs["ours zbv"]
    equal = dict(zbv)
    for op in "FIW":
        for a, b in ((0, 3), (1, 2)):  # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
            equal[f"{a}{op}"] = equal[f"{b}{op}"] = (zbv[f"{a}{op}"] + zbv[f"{b}{op}"]) / 2
    split = (costs["ours zb-h1"]["1I"] + costs["ours zb-h1"]["1W"]) / costs["ours 1f1b"]["1B"]
    unsplit = {k: v / split if k[-1] in "IW" and k[0] != "0" else v for k, v in zbv.items()}
    both = {k: v / split if k[-1] in "IW" and k[0] != "0" else v for k, v in equal.items()}
    p1 = predicted["ours 1f1b"]
    lines.append("  simulator with these CPU costs, a core per rank, free transfers (predictions; ratio to 1f1b's):")
    lines.append("    " + ", ".join(f"{label.split()[1]} {v * 1e3:.1f} ({v / p1:.3f})"
                                      for label, v in predicted.items()))
    for name, table in (("zbv, each rank's two chunks at equal cost", equal),
                        (f"zbv, I + W of stages 1-3 / {split:.3f} (the split's overhead on zb-h1 removed)", unsplit),
                        ("zbv, both", both)):
        t = _simulate(schedules["ours zbv"], 2, args.m, table)
        lines.append(f"    {name}: {t * 1e3:.1f} ({t / p1:.3f})")
    lines.append(_pp4_prediction(zbv, split, args.m))
    return "\n".join(lines)


def _pp4_prediction(zbv: dict, split: float, m: int) -> str:
    """zb-h1 faster than 1f1b at pp=4 needs four cores or devices to be measured: predict it from
    this run's four zbv stages run one per rank (a prediction: costs measured with two ranks on this
    machine, transfers free). 1f1b's B is I + W over the split's overhead (stage 0's I + W is its B)."""
    from autopar.pipeline.schedules import build_schedule
    from autopar.pipeline.simulate import simulate as play

    def makespan(schedule: str, cost: dict) -> float:
        lists = build_schedule(schedule, pp=4, num_microbatches=m)
        return play(lists, pp=4, num_stages=4, num_microbatches=m,
                    cost=lambda a: cost[f"{a.stage}{a.op.value}"]).makespan

    cost = dict(zbv)
    for s in range(4):
        cost[f"{s}B"] = (zbv[f"{s}I"] + zbv[f"{s}W"]) / (split if s else 1.0)
    unsplit = {k: v / split if k[-1] in "IW" and k[0] != "0" else v for k, v in cost.items()}
    one, zb, zb_free = makespan("1f1b", cost), makespan("zb-h1", cost), makespan("zb-h1", unsplit)
    return (f"  pp=4, the four zbv stages one per rank, a core per rank, free transfers (predictions): 1f1b "
            f"{one * 1e3:.1f}, zb-h1 {zb * 1e3:.1f} ({zb / one:.3f}), zb-h1 with the split's overhead removed "
            f"{zb_free * 1e3:.1f} ({zb_free / one:.3f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    parser.add_argument("--layers", type=int, default=6, help="gpt-mini n_layer, at least 2 (default 6)")
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step, at least 4 (default 8)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 layers, 4 micro-batches of 2 x 32 tokens, 1 warm-up and 2 timed steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.m, args.warmup, args.steps = 2, 4, 1, 2
    if args.layers < 2 or args.m < 4 or args.steps < 1:
        parser.error(f"need --layers >= 2 (4 stages), --m >= 4, --steps >= 1; got {args.layers}, {args.m}, "
                     f"{args.steps}")
    args.vocab, args.mb, args.seq, args.model_args = 320, 4, 64, {"n_layer": args.layers}
    if args.quick:
        args.mb, args.seq = 2, 32
    print(f"$ python benchmarks/zbv_breakdown.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"torch {torch.__version__} | load average (1 min) at start {os.getloadavg()[0]:.2f}")
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "out.json"))
        mp.start_processes(_worker, args=(free_port(), args, out), nprocs=2, join=True, start_method="spawn")
        ranks = json.loads(Path(out).read_text())
    print(report(ranks, args))
    print(f"load average (1 min) at end {os.getloadavg()[0]:.2f}; wall time {time.perf_counter() - begin:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
