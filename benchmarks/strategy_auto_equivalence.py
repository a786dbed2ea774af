"""`autopar train --strategy auto` at 4 and 8 ranks against one process: the same losses.

Runs the CLI three ways on gpt-tiny (2 layers, global batch 8, 3 steps): one process with
dp=1, then `--strategy auto` at each world size (the search picks dp/tp/pp, schedule and
micro-batches), and prints each pick and the largest relative loss difference per step. The
tests run the 4-rank case through the rank pools (tests/test_search_auto.py); 8 ranks live here.

    PYTHONPATH=src python benchmarks/strategy_auto_equivalence.py [--worlds 4,8] [--fix-pp 2]
    PYTHONPATH=src python benchmarks/strategy_auto_equivalence.py --quick    # smoke test: 2 ranks
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["--model", "gpt-tiny", "--model-arg", "n_layer=2", "--seq-len", "32", "--global-batch-size", "8",
          "--steps", "3", "--lr", "1e-3", "--warmup-steps", "3", "--eval-batches", "1", "--no-progress"]


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--fix-pp", type=int, default=None, help="also fix --pp (the search picks the rest)")
    parser.add_argument("--quick", action="store_true", help="smoke test: --worlds 2")
    args = parser.parse_args()
    if args.quick:
        args.worlds = "2"
    root = Path(tempfile.mkdtemp(prefix="autopar-auto-eq-"))
    run = lambda *extra: subprocess.run([sys.executable, "-m", "autopar", "train", *COMMON, *extra],  # noqa: E731
                                        check=True, capture_output=True, text=True)
    run("--nproc", "1", "--micro-batch-size", "8", "--out", str(root / "one"))
    reference = losses(root / "one")
    print(f"one process: losses {reference}")
    for world in (int(w) for w in args.worlds.split(",")):
        extra = ["--pp", str(args.fix_pp)] if args.fix_pp else []
        # --confirm 0: the pick as predicted (measuring the close ones first would only add minutes here)
        done = run("--strategy", "auto", "--confirm", "0", "--nproc", str(world), *extra, "--out",
                   str(root / f"auto{world}"))
        picked = next(line for line in done.stdout.splitlines() if line.startswith("auto: "))
        got = losses(root / f"auto{world}")
        worst = max(abs(a - b) / abs(a) for a, b in zip(reference, got))
        print(f"{world} ranks: {picked}\n  losses {got}; max relative difference {worst:.2e} "
              f"({'within' if worst < 1e-5 else 'OUTSIDE'} 1e-5)")


if __name__ == "__main__":
    main()
