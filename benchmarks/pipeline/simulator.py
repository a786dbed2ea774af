"""Study 4: the simulator's predicted step time, fed with per-action times measured from the runtime's
recorded events, against the measured step time, for six schedules."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from autopar.pipeline.actions import Op
from autopar.pipeline.simulate import simulate
from pipeline.common import PART4, PP, TOLERANCE, Ours, Setup, ms, time_variants

def one_way_transfer(setup: Setup, shape: tuple, repeats: int) -> float:
    """Median one-way time of one boundary tensor over gloo (ping-pong / 2)."""
    group = setup.new_group()
    x = torch.zeros(shape)
    times = []
    for i in range(repeats + 3):
        dist.barrier(group)
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(x, 1, group=group)
            dist.recv(x, 1, group=group)
        else:
            dist.recv(x, 0, group=group)
            dist.send(x, 0, group=group)
        if i >= 3:
            times.append((time.perf_counter() - start) / 2)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.broadcast(t, src=0, group=setup.world)
    return float(t)


def compute_durations(events: list, waits: list) -> list[tuple[int, Op, float]]:
    """(stage, op, seconds) per compute event, minus the receive waits that happened inside it."""
    out = []
    for start, end, action in events:
        waited = sum(max(0.0, min(end, we) - max(start, ws)) for ws, we in waits)
        out.append((action.stage, action.op, end - start - waited))
    return out


def simulated_idle(timeline) -> list[float]:
    """Per rank: time between its first action's start (0) and its last compute's end not spent computing."""
    idle = []
    for r in range(PP):
        mine = [(start, end) for rank, start, end, action in timeline.compute_events() if rank == r]
        idle.append(max(end for _, end in mine) - sum(end - start for start, end in mine))
    return idle


def part4(setup: Setup) -> dict:
    a = setup.args
    variants = {label: Ours(setup, schedule, chunks=chunks, recompute=recompute, timed=True)
                for label, schedule, chunks, recompute in PART4}
    boundary = setup.part(PP).boundaries[0][0].shape
    transfer = one_way_transfer(setup, tuple(boundary), 20)
    run = time_variants(setup, variants, warmup=a.warmup4, steps=a.steps4, record=True, step_offset=2000)
    mine, waits_total, other = {}, {}, {}
    for name, per_step in run["events"].items():
        durations = defaultdict(list)
        waited, rest = [], []
        for events, waits, elapsed in per_step:
            computed = compute_durations(events, waits)
            for s, op, d in computed:
                durations[(s, op.value)].append(d)
            waited.append(sum(we - ws for ws, we in waits))
            rest.append(elapsed - waited[-1] - sum(d for _, _, d in computed))
        mine[name] = dict(durations)
        waits_total[name] = statistics.median(waited)
        other[name] = statistics.median(rest)
    gathered = [None] * PP
    dist.all_gather_object(gathered, {"durations": mine, "waits": waits_total, "other": other})
    result = {"times": run["times"], "transfer": transfer, "rows": {}}
    for label, schedule, chunks, recompute in PART4:
        v = variants[label]
        pooled = {key: values for part in gathered for key, values in part["durations"][label].items()}
        medians = {key: statistics.median(values) for key, values in pooled.items()}
        means = {key: statistics.fmean(values) for key, values in pooled.items()}

        def predict(table: dict, transfer_s: float = 0.0):
            return simulate(v.schedule, pp=PP, num_stages=v.num_stages, num_microbatches=a.m,
                            cost=lambda action: table[(action.stage, action.op.value)],
                            comm_cost=lambda action: transfer_s)

        by_median, by_mean, by_mean_comm = predict(medians), predict(means), predict(means, transfer)
        result["rows"][label] = {
            "medians": {f"{s}{op}": m for (s, op), m in sorted(medians.items())},
            "pred_median": by_median.makespan, "pred_mean": by_mean.makespan, "pred_mean_comm": by_mean_comm.makespan,
            "sim_idle": simulated_idle(by_mean_comm),
            "waits": [p["waits"][label] for p in gathered], "other": [p["other"][label] for p in gathered],
            "measured": statistics.median(run["times"][label]), "num_stages": v.num_stages}
    losses = run["losses"]
    ref = losses[PART4[1][0]]
    result["loss_rel"] = max(abs(x - y) / abs(y) for n in losses for x, y in zip(losses[n], ref))
    return result


def report_part4(r: dict, args, main: dict) -> str:
    lines = ["== 4. simulated vs measured (our schedules) ==",
             "cost of each compute action = median over timed steps and micro-batches of its recorded duration "
             "(PipelineRuntime.run(record=True)) minus the time it spent waiting for a receive inside it; "
             f"transfer = measured one-way gloo time of one boundary tensor: {r['transfer'] * 1e6:.0f} us",
             "interleaved-1f1b runs 4 stages (2 chunks per rank) on this partition:", main["partition4"], ""]
    header = (f"{'schedule':<20} | {'measured':>8} | {'pred':>6} {'ratio':>5} | {'mean':>6} {'ratio':>5} | "
              f"{'+comm':>6} {'ratio':>5} | {'idle r0/r1 meas':>15} {'sim':>11} | {'other r0/r1':>11}")
    lines += [header, "-" * len(header)]
    for label, _, _, _ in PART4:
        row = r["rows"][label]
        meas = row["measured"]
        idle = " / ".join(ms(w) for w in row["waits"])
        sim_idle = " / ".join(ms(w) for w in row["sim_idle"])
        lines.append(f"{label:<20} | {ms(meas):>8} | {ms(row['pred_median']):>6} {row['pred_median'] / meas:>5.2f} | "
                     f"{ms(row['pred_mean']):>6} {row['pred_mean'] / meas:>5.2f} | {ms(row['pred_mean_comm']):>6} "
                     f"{row['pred_mean_comm'] / meas:>5.2f} | {idle:>15} {sim_idle:>11} | "
                     f"{' / '.join(ms(o) for o in row['other']):>11}")
    lines += ["(ms. measured = median step time, slower rank; pred = simulate(schedule, cost=per-(stage, op) medians), "
              "transfers free; ratio = pred/measured; mean = the same with per-(stage, op) means; +comm = means and "
              "every transfer taking the measured one-way time; idle meas = median per step of the time a rank "
              "spent blocked in receive waits; idle sim = the +comm simulation's time per rank not computing before "
              "its last compute ends; other = median "
              "per step of the rank's step time minus its compute minus its receive waits: posting sends and "
              "receives, waiting for sends at the end, Python between actions, and time the OS gave to others)",
              "", "measured per-action compute medians (ms), stage+op:"]
    for label, _, _, _ in PART4:
        medians = r["rows"][label]["medians"]
        lines.append(f"  {label:<20} " + " ".join(f"{k}={v * 1e3:.1f}" for k, v in medians.items()))
    ok = r["loss_rel"] <= TOLERANCE
    lines += [f"all six schedules trained identically: {'PASS' if ok else 'FAIL'} -- max relative difference of "
              f"per-step losses vs 1f1b {r['loss_rel']:.1e} (tol {TOLERANCE:g})", ""]
    r["ok"] = ok
    return "\n".join(lines)
