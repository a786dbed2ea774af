"""Reproductions of the papers' experiments: `autopar reproduce NAME [options]`.

Each study is a module with `main(argv: list[str]) -> int` that runs its experiment in one
go (spawning ranks itself where it needs several), prints a table, writes a plot and a
JSON record into its output folder. Studies are imported only when asked for, so a study's
optional dependencies never slow down or break the rest of the command line.
"""

from __future__ import annotations

import importlib

from ..errors import ConfigError, choices

STUDIES = {
    "embrace": ("autopar.reproduce.embrace", "EmbRace: dense vs sparse all-gather vs sharded AlltoAll embeddings"),
    "dpsgd": ("autopar.reproduce.dpsgd", "D-PSGD: all-reduce vs ring gossip vs parameter server under latency"),
    "delayed-sgd": ("autopar.reproduce.delayed_sgd", "delayed SGD: generalization gap against staleness tau"),
    "merak": ("autopar.reproduce.merak", "Merak: 64-GPU speedups of scp, stage-aware recompute, sub-pipelined TP "
              "(simulated)"),
    "hetero": ("autopar.reproduce.hetero", "decentralised training (Yuan et al.): placement on geo-distributed "
               "networks (predicted)"),
}


def run_study(name: str, argv: list[str]) -> int:
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}; available: {choices(STUDIES)}")
    module_name, _ = STUDIES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise ConfigError(f"study {name!r} is not part of this version of autopar") from None
    return int(module.main(argv) or 0)
