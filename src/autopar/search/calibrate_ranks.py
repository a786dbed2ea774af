"""One rank of `autopar calibrate`'s link measurement: gloo point-to-point and the collectives per group size.

Started on N local ranks by the project's launcher (launch.py). Times each operation at a
small and a large size and fits latency plus bandwidth (alpha-beta) to the two points:
point-to-point t = a + S / B; ring all-reduce over n ranks t = 2(n-1) a + 2(n-1)/n S / B; ZeRO's
reduce-scatter and all-gather (reduce_scatter_single, all_gather_single: the calls zero/ and FSDP2 make)
t = (n-1) a + (n-1)/n S / B, each fitted on its own, since gloo's are not the ring's half an all-reduce
(benchmarks/gloo_collectives.py); and the
node's aggregate: every rank sends S to the next at once, t = a + N S / B_node (what all ranks of
this host move together; on one host it is near one pair's rate, not N times it).
Beside the wall time it fits the same form to the CPU seconds the operation costs, summed
over the ranks taking part (every thread of each process: gloo copies and wakes in its own
threads): where ranks time-share cores, that CPU is taken from the compute (cost.py's
time-shared bound), whether or not the wall time overlaps.

It also measures how well the ranks share the cores (`sharing_probe`): a fixed workload on
rank 0 alone, then on every rank at once, timed from a common start to the last rank's end;
effective cores = ranks x alone / together (about 1.8 for 4-8 ranks on a quiet 2-core
machine: the ideal 2, less what switching between processes costs; more when other jobs hold
the cores, since then each process gets its slice whether or not our other ranks run).
And what each blocking synchronisation costs a rank's CPU beyond that, once the ranks time-share the
cores (`sync_cost`: context switches, caches refilled after the wait). Last, one small GPT's data-parallel step on
every rank (reference_step.py), whose time over its prediction is the step model's level (step_probe.py).
Rank 0 writes the fits as JSON to the path given as the first argument. `--ranks N` starts the N ranks here,
forked from this one process after torch is imported (`run_forked`), instead of being one rank under a launcher:
N processes importing torch at once on a small machine took 20 s of the 25 a 4-rank calibration lasted. Run so
(calibrate.measure_links), this file is started by its path and imports nothing of autopar's: the package's
import (trainer, models, search) doubled the one process's start on a loaded machine.
`--groups 2,4` measures the collectives over those group sizes only (default every size 2..N).
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

SMALL, LARGE = 1024, 4 * 2**20  # bytes
# ZeRO's and FSDP2's two collectives, by the names torch gives them (2.13; their former names on 2.11, the GPU
# image's torch): distributed.py's all_gather_single / reduce_scatter_single, which this torch-only file cannot import
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
REPEATS = 8


def _time(fn, group=None) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (this process, all threads) of `fn`, after a warm-up."""
    fn()  # warm-up
    samples, cpu = [], []
    for _ in range(REPEATS):
        dist.barrier(group=group)
        began, used = time.perf_counter(), time.process_time()
        fn()
        samples.append(time.perf_counter() - began)
        cpu.append(time.process_time() - used)
    return statistics.median(samples), statistics.median(cpu)


def _summed(value: float, group=None) -> float:
    """`value` summed over the ranks of `group`."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t)


def _fit(t_small: float, t_large: float, steps: float, volume: float) -> dict:
    """alpha, beta from t = steps * alpha + volume * S / beta at S = SMALL and LARGE."""
    per_byte = max((t_large - t_small) / ((LARGE - SMALL) * volume), 1e-15)
    latency = max((t_small - volume * SMALL * per_byte) / steps, 0.0)
    return {"latency_s": latency, "bandwidth_bytes_per_s": 1.0 / per_byte}


def sharing_probe(rounds: int = 3, repeats: int = 48, report: dict | None = None) -> float:
    """Effective cores this job's ranks get: (the CPU seconds a fixed workload takes each rank alone, summed over
    the ranks) / (wall seconds from a common start until every rank has run it once at the same time), alternated
    `rounds` times: the median alone, the quickest together once each round is scaled to a quiet machine (the
    cores other jobs took during it given back to our ranks, machine_load.py; `report["others_cores"]`: those
    cores, on average). In units of each process's CPU time alone, so it also charges what switching
    between the ranks costs; CPU time, not wall, for the alone runs, so that other jobs on the machine count once
    (in the together run), as they slow the real step.

    Every rank runs the workload alone in turn, not rank 0 for all: one rank's state can make the same work twice
    as fast as on the others (seen: rank 0 right after measuring the model's blocks ran it in 37 ms where the
    other ranks took 75, and a rank-0-only reference read 1.1 cores for 4 ranks on a quiet 2-core machine where
    this reads 1.9).

    The workload is matmuls and elementwise ops on tensors of a few hundred KiB, like the blocks of the small
    models (48 matmuls of 512x128x512: 45-150 ms of one thread here, as this VM's speed varies; long beside the
    wake-ups at its edges on a loaded machine). Timing from the FIRST rank's start to the LAST rank's end
    (time.monotonic, one clock for the machine) matters: a rank that waits for a core starts late, so per-rank
    times would hide the sharing; and no collective sits inside the span (on a loaded machine a barrier's
    wake-ups take longer than the work). Every rank returns the same value."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = torch.randn(512, 128), torch.randn(128, 512)

    def work() -> None:
        for _ in range(repeats):
            y = torch.relu(a @ b)
            (y * y + y).sum()

    work()
    load = _sibling("machine_load")
    alone, together, others = [], [], []
    for _ in range(rounds):
        mine = 0.0
        for turn in range(world):
            dist.barrier()
            if rank == turn:
                began = time.thread_time()
                work()
                mine = time.thread_time() - began
        alone.append(mine)
        dist.barrier()
        busy, read_at = (load.busy_seconds() if rank == 0 else None), time.monotonic()
        span = torch.tensor([-time.monotonic(), 0.0, 0.0], dtype=torch.float64)  # the machine-wide clock
        used = time.process_time()
        work()
        span[1], span[2] = time.monotonic(), time.process_time() - used
        cpu = span[2:].clone()
        dist.all_reduce(span, op=dist.ReduceOp.MAX)  # the first start, the last end
        dist.all_reduce(cpu)
        wall = float(span[0] + span[1])
        after = load.busy_seconds() if busy is not None else None
        held = torch.tensor([load.others_cores(after - busy, float(cpu), time.monotonic() - read_at)
                             if after is not None else 0.0], dtype=torch.float64)
        dist.broadcast(held, 0)
        together.append(wall / load.quiet_factor(float(cpu), float(held), wall))
        others.append(float(held))
    summed = torch.tensor([statistics.median(alone)], dtype=torch.float64)
    dist.all_reduce(summed)  # every rank's own alone time, summed: the CPU the together run had to deliver
    if report is not None:
        report["others_cores"] = statistics.mean(others)
    return min(float(world), max(0.01, float(summed) / min(together)))


def other_threads_cpu_s() -> float:
    """CPU seconds so far of every thread of this process but the calling one (/proc/self/task/*/schedstat,
    nanoseconds on a CPU; 0 where there is no /proc)."""
    import os
    import threading
    me, total = threading.get_native_id(), 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0]) * 1e-9
        except (OSError, ValueError, IndexError):
            continue
    return total


def background_cores(seconds: float = 0.5) -> float:
    """Cores' worth of CPU this job's ranks burn while every rank sleeps (summed over the ranks): their other
    threads' CPU over `seconds` of idle wall. Mostly gloo: every process group keeps a thread that wakes every
    10 ms to poll (~1-2 ms of CPU per second each on this machine), so the figure grows with the groups alive.
    Cluster.background_cores; the time-shared bound takes it from the cores the steps get. Every rank returns
    the same value."""
    dist.barrier()
    began, used = time.monotonic(), other_threads_cpu_s()
    time.sleep(seconds)
    mine = torch.tensor([(other_threads_cpu_s() - used) / (time.monotonic() - began)], dtype=torch.float64)
    dist.all_reduce(mine)
    return float(mine)


def sync_cost(rounds: int = 3, pieces: int = 24, repeats: int = 48) -> float:
    """CPU seconds one rank pays per blocking synchronisation when the ranks time-share the cores, beyond the
    collective's own cost in a tight loop: every rank runs the probe's workload in `pieces` parts, once straight
    through and once with a 4-byte all-reduce with its neighbour (ranks 2k and 2k+1) between parts. The waits make
    the ranks give up their cores and come back to cold caches; the CPU difference per wait, less the tight-loop
    all-reduce's own CPU, is what every TP all-reduce, pipeline receive and per-step sync adds (cost.py).
    0 with fewer than 2 ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]
    mine = pairs[rank // 2] if rank // 2 < len(pairs) else None
    a, b = torch.randn(512, 128), torch.randn(128, 512)
    flag = torch.zeros(1)

    def run(sync: bool) -> float:
        began = time.process_time()
        for i in range(repeats):
            y = torch.relu(a @ b)
            (y * y + y).sum()
            if sync and mine is not None and i % (repeats // pieces) == 0:
                dist.all_reduce(flag, group=mine)
        return time.process_time() - began

    def tight() -> float:
        began = time.process_time()
        for _ in range(pieces):
            dist.all_reduce(flag, group=mine)
        return time.process_time() - began

    plain, synced, loop = [], [], []
    run(False), run(True)
    for _ in range(rounds):
        dist.barrier()
        plain.append(run(False))
        dist.barrier()
        synced.append(run(True))
        dist.barrier()
        if mine is not None:
            loop.append(tight())
    extra = (statistics.median(synced) - statistics.median(plain) - (statistics.median(loop) if loop else 0.0))
    value = torch.tensor([max(0.0, extra / pieces) if mine is not None else 0.0, float(mine is not None)],
                         dtype=torch.float64)
    dist.all_reduce(value)
    return float(value[0] / value[1]) if value[1] else 0.0


def wait_idle(cores: float, rounds: int = 2, pieces: int = 24, repeats: int = 48, nbytes: int = 64 * 1024) -> dict:
    """Seconds the cores idle per blocking all-reduce over g ranks, for every group size g that divides the
    world, while the ranks time-share the cores: every rank runs the probe's workload in `pieces` parts, once
    straight through and once with an all-reduce of `nbytes` (a small activation, as tensor parallelism sends)
    over its group of g consecutive ranks between parts. The wall time the collectives add beyond their CPU over
    the `cores` is idle: a group meets only when each member has been scheduled, and a member that arrives early
    sleeps. On 2 cores: 0.6 ms for g = 2 and 1.7 ms for g = 4 of 4 ranks, 0.3, 0.4 and 2.7 ms for g = 2, 4 and 8
    of 8: tensor parallelism's lock-step, which the CPU-over-cores bound does not see (hf:gpt2's tp=4 rows read
    33-47% under their measured step without it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = torch.randn(512, 128), torch.randn(128, 512)
    buf = torch.zeros(nbytes // 4)
    found = {}
    for g in [n for n in range(2, world + 1) if world % n == 0]:
        groups = [dist.new_group(list(range(start, start + g))) for start in range(0, world, g)]
        mine = groups[rank // g]

        def run(sync: bool) -> tuple[float, float]:
            dist.barrier()
            began, used = time.perf_counter(), time.process_time()
            for i in range(repeats):
                y = torch.relu(a @ b)
                (y * y + y).sum()
                if sync and i % (repeats // pieces) == 0:
                    dist.all_reduce(buf, group=mine)
            span = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(span, op=dist.ReduceOp.MAX)  # the slowest rank's
            return float(span), _summed(time.process_time() - used)

        run(False), run(True)
        plain, synced = [run(False) for _ in range(rounds)], [run(True) for _ in range(rounds)]
        wall = statistics.median(w for w, _ in synced) - statistics.median(w for w, _ in plain)
        cpu = statistics.median(c for _, c in synced) - statistics.median(c for _, c in plain)
        found[str(g)] = max(0.0, (wall - cpu / max(cores, 1e-9)) / pieces)
    return found


def per_rank_rates(repeats: int = 5) -> list[float]:
    """Each rank's own matmul rate (FLOP/s of one thread), one rank at a time while the others wait: on a
    mixed host (a slower core, a CPU quota, another job) the ranks' rates differ."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = torch.randn(512, 128), torch.randn(128, 512)
    rates = torch.zeros(world, dtype=torch.float64)
    for r in range(world):
        dist.barrier()
        if rank == r:
            a @ b  # warm-up
            samples = []
            for _ in range(repeats):
                began = time.perf_counter()
                a @ b
                samples.append(time.perf_counter() - began)
            rates[r] = 2 * 512 * 128 * 512 / statistics.median(samples)
    dist.all_reduce(rates)
    return rates.tolist()


def pair_links() -> dict[str, dict]:
    """Point-to-point latency and bandwidth between every pair of ranks ("i,j"), one pair at a time."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fits = {}
    for i in range(world):
        for j in range(i + 1, world):
            times = {}
            for size in (SMALL, LARGE):
                buf = torch.zeros(size // 4)

                def ping() -> None:
                    if rank == i:
                        dist.send(buf, j)
                        dist.recv(buf, j)
                    elif rank == j:
                        dist.recv(buf, i)
                        dist.send(buf, i)

                wall, _ = _time(ping)
                times[size] = _summed(wall / 2 if rank == i else 0.0)  # one way, as rank i saw it
            fits[f"{i},{j}"] = _fit(times[SMALL], times[LARGE], 1, 1)
    return fits


def measure(out: str, group_sizes: list[int] | None = None, per_rank: bool = False) -> None:
    """Every measurement, as one rank of the job; rank 0 writes them to `out`. `per_rank`: also each rank's
    own matmul rate and the link between every pair of ranks."""
    joining = time.perf_counter()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    joined = time.perf_counter() - joining
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"allreduce": {}, "allreduce_cpu": {}, "reduce_scatter": {}, "all_gather": {},
                    "reduce_scatter_cpu": {}, "all_gather_cpu": {}, "all_to_all": {}}
    began = joining
    seconds = {"join": joined}  # wall seconds of each phase on rank 0, to see where the time goes
    times, cpus = {}, {}
    for size in (SMALL, LARGE):
        buf = torch.zeros(size // 4)

        def ping() -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        wall, cpu = _time(ping)
        times[size] = wall / 2  # one way
        cpus[size] = _summed(cpu / 2 if rank < 2 else 0.0)  # sender's and receiver's CPU of one transfer
    result["p2p"] = _fit(times[SMALL], times[LARGE], 1, 1)
    result["p2p_cpu"] = _fit(cpus[SMALL], cpus[LARGE], 1, 1)
    for size in (SMALL, LARGE):
        outgoing, incoming = torch.zeros(size // 4), torch.zeros(size // 4)

        def shift() -> None:  # every rank at once: to the next, from the previous
            works = [dist.isend(outgoing, (rank + 1) % world), dist.irecv(incoming, (rank - 1) % world)]
            for work in works:
                work.wait()

        times[size], _ = _time(shift)
    result["aggregate"] = _fit(times[SMALL], times[LARGE], 1, world)
    seconds["p2p"] = time.perf_counter() - began - joined
    for n in sorted(set(group_sizes or range(2, world + 1))):
        group = dist.new_group(list(range(n)))
        times, cpus, scatters, gathers, scatter_walls, gather_walls, swaps = {}, {}, {}, {}, {}, {}, {}
        for size in (SMALL, LARGE):
            buf, shard = torch.zeros(size // 4), torch.zeros(size // 4 // n)
            whole = torch.zeros(shard.numel() * n)
            wall = cpu = scatter = gather = scatter_wall = gather_wall = 0.0
            if rank < n:
                wall, cpu = _time(lambda: dist.all_reduce(buf, group=group), group)
                # the ZeRO collectives as zero/grads.py and zero/optimizer.py call them (FSDP2 runs the same ones)
                scatter_wall, scatter = _time(lambda: _REDUCE_SCATTER(shard, whole, group=group), group)
                gather_wall, gather = _time(lambda: _ALL_GATHER(whole, shard, group=group), group)
                swap = torch.zeros_like(whole)  # expert parallelism's dispatch and combine (experts/dispatch.py)
                swaps[size], _ = _time(lambda: dist.all_to_all_single(swap, whole, group=group), group)
            times[size], cpus[size] = wall, _summed(cpu)
            scatters[size], gathers[size] = _summed(scatter), _summed(gather)
            scatter_walls[size], gather_walls[size] = scatter_wall, gather_wall
            dist.barrier()
        if rank == 0:
            result["allreduce"][str(n)] = _fit(times[SMALL], times[LARGE], 2 * (n - 1), 2 * (n - 1) / n)
            result["allreduce_cpu"][str(n)] = _fit(cpus[SMALL], cpus[LARGE], 2 * (n - 1), 2 * (n - 1) / n)
            result["reduce_scatter"][str(n)] = _fit(scatter_walls[SMALL], scatter_walls[LARGE], n - 1, (n - 1) / n)
            result["all_gather"][str(n)] = _fit(gather_walls[SMALL], gather_walls[LARGE], n - 1, (n - 1) / n)
            result["reduce_scatter_cpu"][str(n)] = _fit(scatters[SMALL], scatters[LARGE], n - 1, (n - 1) / n)
            result["all_gather_cpu"][str(n)] = _fit(gathers[SMALL], gathers[LARGE], n - 1, (n - 1) / n)
            result["all_to_all"][str(n)] = _fit(swaps[SMALL], swaps[LARGE], n - 1, (n - 1) / n)
    seconds["collectives"] = time.perf_counter() - began - sum(seconds.values())
    sharing: dict = {}
    result["effective_cores"] = sharing_probe(report=sharing)
    result["sharing_others_cores"] = sharing["others_cores"]
    seconds["sharing"] = time.perf_counter() - began - sum(seconds.values())
    result["sync_cpu_s"] = sync_cost() if world >= 2 else 0.0
    result["wait_idle"] = wait_idle(min(result["effective_cores"], world)) if world >= 2 else {}
    seconds["waits"] = time.perf_counter() - began - sum(seconds.values())
    result.update(reference_step())
    seconds["reference"] = time.perf_counter() - began - sum(seconds.values())
    if per_rank:
        result["rank_rates"], result["pair_links"] = per_rank_rates(), pair_links()
        seconds["per_rank"] = time.perf_counter() - began - sum(seconds.values())
    result["seconds"] = seconds
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _sibling(name: str):
    """This folder's module `name` (torch or standard library only): imported from the package, or, run as a
    script with the package not imported, loaded by its path."""
    if __package__:
        import importlib
        return importlib.import_module(f"{__package__}.{name}")
    import importlib.util
    import sys
    from pathlib import Path
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def reference_step() -> dict:
    """The reference model's data-parallel step on every rank (reference_step.py: the level of the step model),
    as a quiet machine would run it: each round's time scaled by the cores other jobs took from our ranks during
    it (machine_load.quiet_factor), the median round kept. Not the quickest: the rounds of a time-shared step
    differ by the ranks' own scheduling, which every step of a run meets too, and a run is judged by its median
    step (the trainer's line, the validation benchmark's); the quickest of three read 2-3% below the median and
    set every prediction that much low. Also the measured (uncorrected) median round and the cores other jobs
    held on average."""
    load = _sibling("machine_load")
    rounds = _sibling("reference_step").step_rounds(busy_seconds=load.busy_seconds)
    quiet, others = [], []
    for r in rounds:
        held = load.others_cores(r["busy_s"], r["cpu_s"], r["wall_s"])
        others.append(held)
        quiet.append(r["wall_s"] / load.quiet_factor(r["cpu_s"], held, r["wall_s"]))
    return {"reference_step_s": statistics.median(quiet),
            "reference_step_measured_s": statistics.median(r["wall_s"] for r in rounds),
            "reference_others_cores": statistics.mean(others), "reference_rounds": rounds}


def _forked_rank(rank: int, world: int, port: int, out: str, group_sizes: list[int] | None,
                 per_rank: bool = False) -> None:
    import os
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # what the launcher gives a rank
    torch.set_num_threads(1)  # one thread per rank, as the launcher's OMP_NUM_THREADS=1 gives real ranks
    measure(out, group_sizes, per_rank)


def run_forked(world: int, out: str, group_sizes: list[int] | None = None, per_rank: bool = False) -> None:
    """The `world` ranks as processes forked from this one: torch is imported once, not once per rank. Forked
    from a process that has run no torch op yet (this file run as a script), so no thread pool is copied half
    alive. A rank that fails stops the others and raises here with its traceback."""
    import socket

    import torch.multiprocessing as mp
    # the reference step's optimizer, built once here on an empty tensor (no op runs): its first construction
    # imports torch's compiler stack, about a second, which the forked ranks then inherit instead of each paying it
    _sibling("reference_step").optimizer([torch.nn.Parameter(torch.empty(0))])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_forked_rank, args=(world, port, out, group_sizes, per_rank), nprocs=world, join=True,
                       start_method="fork")


def main() -> None:
    import argparse
    import sys
    from pathlib import Path
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # this folder's profile.py would shadow the standard library's (which torch imports)
    parser = argparse.ArgumentParser(prog="python -m autopar.search.calibrate_ranks")
    parser.add_argument("out", help="where rank 0 writes the fits (JSON)")
    parser.add_argument("--ranks", type=int, default=None, help="fork this many ranks here (default: this "
                        "process is one rank under a launcher)")
    parser.add_argument("--groups", default=None, help="group sizes to measure the collectives over, e.g. 2,4")
    parser.add_argument("--per-rank", action="store_true", help="also each rank's matmul rate and every pair's link")
    args = parser.parse_args()
    sizes = [int(n) for n in args.groups.split(",")] if args.groups else None
    if args.ranks is not None:
        run_forked(args.ranks, args.out, sizes, args.per_rank)
    else:
        measure(args.out, sizes, args.per_rank)


if __name__ == "__main__":
    main()
