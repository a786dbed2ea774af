"""Replay a saved strategy_search.py run's configurations through the current step model (a development tool).

Why: the quiet machine is rare; a replay scores the configurations a quiet run measured with the model as it is
now, to see its ranking and level against those measurements. The blocks are measured now, on this machine, and
converted to CPU seconds (their times x the CPU share of the timing), so that a replay on a loaded machine
approximates a quiet one's blocks (roughly: the CPU of a block also grows under load, with cold caches). Links and
the CPU of collectives and waits come from a calibrated cluster file; the effective cores are given. The ZeRO level
is taken as 0 unless --zero: runs before the `search` branch ran every candidate replicated.

    PYTHONPATH=src python benchmarks/strategy_search_replay.py RUN.json CLUSTER.toml CORES_AT_4 CORES_AT_8 [--zero] [-v]
    PYTHONPATH=src python benchmarks/strategy_search_replay.py --quick   # smoke test: the small saved run below

--quick replays benchmarks/data/strategy_search_quick_2ranks.json (gpt-mini at 2 ranks, 2 configurations, made by
`strategy_search.py --quick --world 2 --models gpt-mini --configs 2 --repeats 1 --cluster cpu-local --out ...`)
with benchmarks/data/calibrated_2ranks.toml (`autopar calibrate --nproc 2`) and the run's own effective cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from strategy_search import GLOBAL_BATCH, MODELS, SEQ_LEN, spearman  # noqa: E402

DATA = Path(__file__).parent / "data"
QUICK_RUN, QUICK_CLUSTER = DATA / "strategy_search_quick_2ranks.json", DATA / "calibrated_2ranks.toml"


def cpu_blocks(name: str) -> list:
    """The model's blocks measured now, their seconds turned into CPU seconds."""
    from autopar.search.measure_profile import measure_blocks
    blocks = measure_blocks(name, seq_len=SEQ_LEN, model_args=MODELS[name])
    share = blocks[0].cpu_per_wall
    print(f"{name}: blocks measured at {share:.2f} CPU seconds per wall second")
    return [dataclasses.replace(b, forward_fixed_s=b.forward_fixed_s * share,
                                forward_per_seq_s=b.forward_per_seq_s * share,
                                backward_fixed_s=b.backward_fixed_s * share,
                                backward_per_seq_s=b.backward_per_seq_s * share, update_s=b.update_s * share,
                                cpu_per_wall=1.0) for b in blocks]


def candidate(config: dict, zero: bool):
    from autopar.search.cost import Candidate
    s = config["strategy"]
    mbs = config["micro_batch_size"]
    return Candidate(dp=s["dp"], tp=s["tp"], pp=s["pp"], micro_batch_size=mbs,
                     num_microbatches=GLOBAL_BATCH // s["dp"] // mbs, schedule=s["schedule"], chunks=s["chunks"],
                     recompute=s["recompute"], partition=s["partition"], bounds=tuple(config["bounds"]),
                     zero=s.get("zero", 0) if zero else 0)


def main() -> None:
    from autopar.search.cluster import load_cluster
    from autopar.search.cost import StepModel
    from autopar.search.measure_profile import with_measured_blocks
    from autopar.search.profile import profile_model
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="a JSON written by strategy_search.py --out")
    parser.add_argument("cluster", nargs="?", help="a calibrated cluster TOML")
    parser.add_argument("cores_at_4", nargs="?", type=float, help="effective cores of 4 ranks")
    parser.add_argument("cores_at_8", nargs="?", type=float, help="effective cores of 8 ranks")
    parser.add_argument("--zero", action="store_true", help="score each configuration at its ZeRO level")
    parser.add_argument("-v", dest="verbose", action="store_true", help="print every configuration")
    parser.add_argument("--quick", action="store_true", help="smoke test: replay the small saved run (see above)")
    args = parser.parse_args()
    if args.quick:
        run, cluster = json.loads(QUICK_RUN.read_text()), load_cluster(str(QUICK_CLUSTER))
        cores = {block["world"]: block["effective_cores"] for block in run["blocks"]}
    elif args.cores_at_8 is not None:
        run, cluster = json.loads(Path(args.run).read_text()), load_cluster(args.cluster)
        cores = {4: args.cores_at_4, 8: args.cores_at_8}
    else:
        parser.error("give RUN.json CLUSTER.toml CORES_AT_4 CORES_AT_8, or --quick")
    zero, verbose = args.zero, args.verbose
    measured_blocks: dict[str, list] = {}
    for block in run["blocks"]:
        name, world = block["model"], block["world"]
        if name not in measured_blocks:
            measured_blocks[name] = cpu_blocks(name)
        degrees = tuple(d for d in (1, 2, 4, 8) if world % d == 0)
        profile = with_measured_blocks(profile_model(name, seq_len=SEQ_LEN, model_args=MODELS[name],
                                                     tp_degrees=degrees), measured_blocks[name])
        here = cluster.replace(num_devices=world, devices_per_node=world, cores_per_node=cores[world],
                               memory_headroom=1.0,
                               allreduce_table={n: v for n, v in cluster.allreduce_table.items() if n <= world},
                               allreduce_cpu_table={n: v for n, v in cluster.allreduce_cpu_table.items() if n <= world})
        model = StepModel(profile, here, global_batch_size=GLOBAL_BATCH)
        pred, meas = [], []
        for config in block["configs"]:
            if "measured_s" not in config:
                continue
            estimate = model.evaluate(candidate(config, zero))
            pred.append(estimate.step_time_s)
            meas.append(config["measured_s"])
            if verbose:
                print(f"  {pred[-1] * 1e3:8.1f} {meas[-1] * 1e3:8.1f} {(pred[-1] - meas[-1]) / meas[-1]:+5.0%}  "
                      f"{estimate.candidate.describe()}")
        errors = [(p - m) / m for p, m in zip(pred, meas)]
        scale = statistics.geometric_mean([m / p for p, m in zip(pred, meas)])
        shape = statistics.median(abs(p * scale - m) / m for p, m in zip(pred, meas))
        pick = meas[min(range(len(pred)), key=pred.__getitem__)] / min(meas)
        print(f"{name} at {world} ranks, {len(pred)} configurations: Spearman {spearman(pred, meas):.3f}, pick / best "
              f"{pick:.3f}, median |time error| {statistics.median(abs(e) for e in errors):.1%} (signed "
              f"{statistics.median(errors):+.1%}); {shape:.1%} after one fitted factor x{scale:.2f}")


if __name__ == "__main__":
    main()
