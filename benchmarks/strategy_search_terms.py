"""Where the strategy search's step model is off, from a saved validation run, and what the memory model reads.

    PYTHONPATH=src python benchmarks/strategy_search_terms.py --fit runs/strategy_search.json  # written by strategy_search.py --out
    PYTHONPATH=src python benchmarks/strategy_search_terms.py --saved
    PYTHONPATH=src python benchmarks/strategy_search_terms.py --collectives CLUSTER.toml
    PYTHONPATH=src python benchmarks/strategy_search_terms.py --quick    # smoke test: all three on small inputs

--fit: per model and world size, a least-squares fit of each configuration's measured CPU (summed over the
ranks) on three groups of the model's CPU terms: blocking waits (Cluster.sync_cpu_s per wait), TP
collectives, everything else. A factor above the others says which term is under-priced. Also the median
measured / modelled CPU of the tp rows and of the others.

--saved: per block, the bytes autograd keeps per sequence as traced one-block stages (what pipelines and TP
run) and as the model itself (what data parallelism and ZeRO run): measure_profile.BlockCosts.

--collectives: from a calibrated cluster file, the CPU per byte of gloo's reduce-scatter and all-gather
against the fractions of an all-reduce the ZeRO costs used before the tables existed (one, and one half).

--quick: --fit and --collectives on the small saved run and cluster file that strategy_search_replay.py --quick
reads (benchmarks/data/), --saved at 32 tokens per sequence.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"


def fit(path: str) -> None:
    import numpy as np
    data = json.load(open(path))
    for block in data["blocks"]:
        rows = [c for c in block["configs"] if "measured_terms_s" in c]
        names = [k for k in rows[0]["parts"] if k.startswith("cpu_") and k != "cpu_s"]
        terms = np.array([[c["parts"][k] for k in names] for c in rows])
        measured = np.array([c["measured_terms_s"]["cpu"] for c in rows])
        waits, tp = terms[:, names.index("cpu_waits_s")], terms[:, names.index("cpu_tp_collectives_s")]
        rest = terms.sum(1) - waits - tp
        coef, *_ = np.linalg.lstsq(np.stack([rest, tp, waits], 1), measured, rcond=None)
        residual = np.median(np.abs(np.stack([rest, tp, waits], 1) @ coef - measured) / measured)
        ratio = measured / terms.sum(1)
        has_tp = np.array([c["strategy"]["tp"] > 1 for c in rows])
        print(f"{block['model']} at {block['world']} ranks ({len(rows)} configurations): factors rest {coef[0]:.2f}, "
              f"tp collectives {coef[1]:.2f}, waits {coef[2]:.2f} (median residual {residual:.1%}); measured / "
              f"modelled CPU, median: tp rows {np.median(ratio[has_tp]):.2f}, others {np.median(ratio[~has_tp]):.2f}")


def saved(seq_len: int = 128) -> None:
    from autopar.search.measure_profile import measure_blocks
    models = {"gpt-mini": {}, "hf:llama": {"num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 352,
                                          "num_attention_heads": 4, "num_key_value_heads": 2}}
    for name, args in models.items():
        blocks = measure_blocks(name, seq_len=seq_len, model_args=args, repeats=1)
        traced = sum(b.saved_per_seq for b in blocks)
        eager = sum(b.eager_saved_per_seq for b in blocks)
        print(f"{name}: bytes kept per sequence, traced stages {traced / 1e6:.2f} MB, the model itself "
              f"{eager / 1e6:.2f} MB ({eager / traced:.2f}x); per block traced "
              f"{[round(b.saved_per_seq) for b in blocks]}, eager {[round(b.eager_saved_per_seq) for b in blocks]}")


def collectives(path: str) -> None:
    from autopar.search.cluster import load_cluster
    cluster = load_cluster(path)
    nbytes = 4 * 2**20
    for n in sorted(cluster.reduce_scatter_cpu_table):
        ar = cluster.all_reduce_cpu(nbytes, n)
        print(f"{n} ranks, {nbytes >> 20} MiB: CPU summed over the ranks, all-reduce {ar * 1e3:.2f} ms, reduce-scatter "
              f"{cluster.reduce_scatter_cpu(nbytes, n) * 1e3:.2f} ms ({cluster.reduce_scatter_cpu(nbytes, n) / ar:.2f}x "
              f"an all-reduce), all-gather {cluster.all_gather_cpu(nbytes, n) * 1e3:.2f} ms "
              f"({cluster.all_gather_cpu(nbytes, n) / (ar / 2):.2f}x half an all-reduce)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", help="a JSON written by benchmarks/strategy_search.py --out")
    parser.add_argument("--saved", action="store_true")
    parser.add_argument("--collectives", help="a cluster TOML written by autopar calibrate")
    parser.add_argument("--quick", action="store_true", help="smoke test: all three on the small inputs of "
                        "benchmarks/data/, --saved at 32 tokens")
    args = parser.parse_args()
    if args.quick:
        fit(str(DATA / "strategy_search_quick_2ranks.json"))
        saved(seq_len=32)
        collectives(str(DATA / "calibrated_2ranks.toml"))
        return 0
    if not (args.fit or args.saved or args.collectives):
        parser.error("give --fit JSON, --saved or --collectives TOML")
    if args.fit:
        fit(args.fit)
    if args.saved:
        saved()
    if args.collectives:
        collectives(args.collectives)
    return 0


if __name__ == "__main__":
    sys.exit(main())
