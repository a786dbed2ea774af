"""`autopar reproduce dpsgd`: all-reduce vs D-PSGD ring gossip vs a parameter server, under an
injected network (Lian et al. 2017, §3.4 of the reference note: gossip wins on slow networks).

What runs: the same MLP classifier on the same synthetic data (labels from a random teacher
network), the same global batch split over W workers, plain SGD with the same step, for a
few epochs, with each data-parallel mode:
- allreduce: gradients averaged by one all-reduce after backward (no overlap with backward,
  a ring all-reduce in the delay model: 2(W-1) dependent messages of 1/W of the gradient);
- gossip: D-PSGD on a ring (Metropolis weights 1/3): each worker sends its model to its two
  neighbours while it computes, then mixes (gossip/runner.py);
- gossip-atc: the same ring in the adapt-then-combine order: update, then exchange and mix
  (no overlap, but the gradient is taken at the mixed model);
- ps: the parameter server of async_sgd (one extra server process, bounded staleness S):
  a push of the gradient and a pull of the parameters per worker per step.
Every message goes through `autopar.data_parallel.links.Links`, which delays it by the
setting's latency and bandwidth cap (per sender; see links.py). Reported per run: loss per
epoch (mean of the workers' batch losses, each at the model it trained), wall-clock per
epoch, wall-clock until the running mean of the loss first reaches a common target (the
worst final value over the runs of that worker count, +2%, so every run reaches it), bytes
sent, and the final loss of the resulting model (gossip: the workers' average) on all data.

All ranks share this machine's CPU cores; the injected delays are sleeps and cost no CPU,
so the delays' effect is faithful while the computation part is slowed by sharing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..data_parallel.links import LinkModel
from ..errors import ConfigError

SETTINGS = {  # name: (latency_s, bandwidth bytes/s)
    "fast": (0.0, float("inf")),
    "latency-2ms": (0.002, float("inf")),
    "latency-10ms": (0.010, float("inf")),
    "bandwidth-5MB/s": (0.0001, 5e6),
}
METHODS = ("allreduce", "gossip", "gossip-atc", "ps")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar reproduce dpsgd", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[4, 8], help="worker counts (the PS adds one server)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), help=f"network settings: {', '.join(SETTINGS)}, "
                   f"or LATENCY_MS:BANDWIDTH_MBPS (e.g. 5:inf)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), help=" ".join(METHODS))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=1536, help="training samples (one epoch)")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128, help="MLP hidden width (sets the message size)")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--staleness", type=int, default=2, help="parameter server staleness bound S")
    p.add_argument("--topology", default="ring", help="gossip graph (ring by default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/reproduce-dpsgd", help="folder for results.json, table.md, dpsgd.png")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per worker count, all runs")
    return p


def parse_setting(text: str) -> tuple[str, float, float]:
    if text in SETTINGS:
        return (text, *SETTINGS[text])
    try:
        latency_ms, bandwidth = text.split(":")
        latency = float(latency_ms) / 1000
        bandwidth_bytes = float(bandwidth) * 1e6
        LinkModel(latency, bandwidth_bytes)  # validates
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"network setting {text!r}: use one of {', '.join(SETTINGS)} or LATENCY_MS:BANDWIDTH_MBPS "
                          f"such as 5:inf or 0.1:10 ({exc})") from None
    return text, latency, bandwidth_bytes


# ------------------------------------------------------------------ the task (same on every rank)


def make_model(inputs: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


class Task:
    """Synthetic classification: Gaussian inputs, labels from a fixed random teacher MLP."""

    inputs, classes = 32, 10

    def __init__(self, samples: int, global_batch: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, self.inputs, generator=generator)
        teacher = nn.Sequential(nn.Linear(self.inputs, 64), nn.Tanh(), nn.Linear(64, self.classes))
        with torch.no_grad():
            for p in teacher.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))
            logits = teacher(self.x) * 3 + 0.5 * torch.randn(samples, self.classes, generator=generator)
        self.y = logits.argmax(1)
        self.global_batch, self.seed = global_batch, seed
        self.steps_per_epoch = samples // global_batch
        self._orders: dict[int, torch.Tensor] = {}

    def batch(self, step: int, worker: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch not in self._orders:
            self._orders[epoch] = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(
                self.seed * 1000 + epoch))
        share = self.global_batch // workers
        start = within * self.global_batch + worker * share
        index = self._orders[epoch][start:start + share]
        return self.x[index], self.y[index]

    @staticmethod
    def loss(module: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(module(x), y)

    def full_loss(self, model: nn.Module, flat: torch.Tensor) -> float:
        with torch.no_grad():
            offset = 0
            for p in model.parameters():
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            return float(F.cross_entropy(model(self.x), self.y))


# ------------------------------------------------------------------ one process


def _rank_main(rank: int, world: int, port: int, args: dict, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from ..async_sgd import train_with_parameter_server
    from ..gossip.runner import train_with_allreduce, train_with_gossip

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args["timeout_s"]))
        workers = world - 1
        worker_group = dist.new_group(list(range(workers)), timeout=timedelta(seconds=args["timeout_s"]))
        task = Task(args["samples"], args["global_batch"], args["seed"])
        steps = task.steps_per_epoch * args["epochs"]
        records = []
        for setting, latency, bandwidth in args["settings"]:
            link = LinkModel(latency, bandwidth)
            for method in args["methods"]:
                torch.manual_seed(args["seed"])
                model = make_model(Task.inputs, args["hidden"], Task.classes)
                common = dict(steps=steps, lr=args["lr"], link_model=link, timeout_s=args["timeout_s"])
                result = None
                if method == "ps":
                    result = train_with_parameter_server(model, Task.loss, task.batch, staleness=args["staleness"],
                                                         servers=1, **common)
                elif rank < workers:
                    if method in ("gossip", "gossip-atc"):
                        result = train_with_gossip(model, Task.loss, task.batch, topology=args["topology"],
                                                   order="atc" if method == "gossip-atc" else "dpsgd",
                                                   group=worker_group, **common)
                    else:
                        result = train_with_allreduce(model, Task.loss, task.batch, group=worker_group, **common)
                dist.barrier()
                if rank == 0:
                    records.append(_record(task, model, args, workers, setting, latency, bandwidth, method, result))
        if rank == 0:
            results.put(("ok", records))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # the parent prints it and stops
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _record(task: Task, model: nn.Module, args: dict, workers: int, setting: str, latency: float, bandwidth: float,
            method: str, result) -> dict:
    spe = task.steps_per_epoch
    epochs = args["epochs"]
    staleness = None
    if method == "ps":
        histogram = result.staleness_histogram()
        staleness = {"histogram": {str(k): v for k, v in histogram.items()},
                     "mean": sum(k * v for k, v in histogram.items()) / max(1, sum(histogram.values()))}
    return {"workers": workers, "setting": setting, "latency_s": latency,
            "bandwidth_bytes_per_s": None if math.isinf(bandwidth) else bandwidth, "method": method,
            "losses": result.losses, "step_end_s": result.step_end_s, "wall_s": result.wall_s,
            "epoch_loss": [sum(result.losses[e * spe:(e + 1) * spe]) / spe for e in range(epochs)],
            "epoch_end_s": [result.step_end_s[(e + 1) * spe - 1] for e in range(epochs)],
            "bytes_sent": result.bytes_sent, "messages_sent": result.messages_sent,
            "final_full_loss": task.full_loss(model, result.params),
            "model_bytes": 4 * sum(p.numel() for p in model.parameters()),
            "extra": getattr(result, "extra", {}), "staleness": staleness}


def _run_world(workers: int, args: dict) -> list[dict]:
    import torch.multiprocessing as mp

    from ..launch import free_port
    world = workers + 1  # the parameter server's process; idle during the other methods
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        status, payload = results.get(timeout=args["timeout_s"] * 2)
    except queue.Empty:
        raise RuntimeError(f"the {workers}-worker runs did not finish within {args['timeout_s'] * 2:g} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


# ------------------------------------------------------------------ analysis


def running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def add_time_to_target(records: list[dict], window: int) -> None:
    """Per worker count: target = worst final running-mean loss + 2%; first time each run's running mean <= it."""
    for workers in sorted({r["workers"] for r in records}):
        mine = [r for r in records if r["workers"] == workers]
        for r in mine:
            r["smoothed"] = running_mean(r["losses"], window)
        target = 1.02 * max(r["smoothed"][-1] for r in mine)
        for r in mine:
            r["target_loss"] = target
            hit = next(i for i, v in enumerate(r["smoothed"]) if v <= target)
            r["time_to_target_s"] = r["step_end_s"][hit]
            r["steps_to_target"] = hit + 1
        for r in mine:
            base = next((b for b in mine if b["setting"] == r["setting"] and b["method"] == "allreduce"), None)
            r["speedup_vs_allreduce"] = base["time_to_target_s"] / r["time_to_target_s"] if base else None


def table(records: list[dict]) -> str:
    lines = ["| workers | network | method | loss per epoch | s per epoch | time to target (s) | vs all-reduce "
             "| steps to target | MB sent | final loss (all data) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        per_epoch = r["wall_s"] / len(r["epoch_loss"])
        speed = f"{r['speedup_vs_allreduce']:.2f}x" if r.get("speedup_vs_allreduce") else "-"
        lines.append(f"| {r['workers']} | {r['setting']} | {r['method']} | "
                     f"{' '.join(f'{v:.3f}' for v in r['epoch_loss'])} | {per_epoch:.2f} | "
                     f"{r['time_to_target_s']:.2f} | {speed} | {r['steps_to_target']} | "
                     f"{r['bytes_sent'] / 1e6:.1f} | {r['final_full_loss']:.3f} |")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("dpsgd.png skipped: install matplotlib (pip install 'autopar[plot]')")
        return False
    worker_counts = sorted({r["workers"] for r in records})
    settings = list(dict.fromkeys(r["setting"] for r in records))
    fig, axes = plt.subplots(len(worker_counts), len(settings), figsize=(4 * len(settings), 3.2 * len(worker_counts)),
                             squeeze=False)
    colours = {"allreduce": "tab:blue", "gossip": "tab:orange", "gossip-atc": "tab:red", "ps": "tab:green"}
    for i, workers in enumerate(worker_counts):
        for j, setting in enumerate(settings):
            ax = axes[i][j]
            for r in records:
                if r["workers"] == workers and r["setting"] == setting:
                    ax.plot(r["step_end_s"], r["smoothed"], label=r["method"], color=colours.get(r["method"]))
                    ax.axhline(r["target_loss"], color="grey", lw=0.6, ls="--")
            ax.set_title(f"{workers} workers, {setting}", fontsize=9)
            ax.set_xlabel("wall-clock (s)")
            ax.set_ylabel("training loss (running mean)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if any(w < 2 for w in args.workers):
        raise ConfigError(f"--workers must be >= 2 each, got {args.workers}")
    for w in args.workers:
        if args.global_batch % w:
            raise ConfigError(f"--global-batch {args.global_batch} is not divisible by {w} workers")
    if args.samples < args.global_batch:
        raise ConfigError(f"--samples {args.samples} is less than one global batch ({args.global_batch})")
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; use {' '.join(METHODS)}")
    settings = [parse_setting(s) for s in args.settings]
    config = {"samples": args.samples, "global_batch": args.global_batch, "hidden": args.hidden, "lr": args.lr,
              "epochs": args.epochs, "staleness": args.staleness, "topology": args.topology, "seed": args.seed,
              "timeout_s": args.timeout_s, "settings": settings, "methods": list(args.methods)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    records: list[dict] = []
    for workers in args.workers:
        print(f"running {workers} workers: {len(settings)} network settings x {len(args.methods)} methods ...",
              flush=True)
        records += _run_world(workers, config)
    steps_per_epoch = args.samples // args.global_batch
    add_time_to_target(records, window=max(1, steps_per_epoch // 2))
    text = table(records)
    print(text)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"config": {**config, "settings": [
        {"name": n, "latency_s": lat, "bandwidth_bytes_per_s": None if math.isinf(bw) else bw}
        for n, lat, bw in settings]}, "runs": records}, indent=1) + "\n")
    wrote = plot(records, out / "dpsgd.png")
    print(f"wrote {out / 'results.json'}, {out / 'table.md'}" + (f", {out / 'dpsgd.png'}" if wrote else "")
          + f" in {time.perf_counter() - began:.0f} s")
    return 0
