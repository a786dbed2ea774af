"""The Trainer's loop for `--dp-mode async`: workers train and push, servers serve, then everyone
evaluates, writes the run folder and saves the final checkpoint together.

Why a loop of its own: the synchronous loop agrees on the loss, the token count and the
peak memory with collectives every step, which would hold every worker to the slowest.
Here a worker's step touches only the servers; the per-step records of all workers and the
servers' staleness logs are gathered once, at the end, and only then written to
metrics.jsonl (rank 0), so each line can carry the global batch's loss (the sum of the
workers' shares, each at the parameters that worker pulled) and that step's staleness.
"""

from __future__ import annotations

import json
import time
import warnings
from collections import Counter

import torch
import torch.distributed as dist

from ..version import __version__
from ..train.base import LoopServices, TrainResult
from ..train.loss import count_targets, tokens_in
from ..train.loggers import build_loggers
from ..train.metrics import MetricsLog, Progress, peak_memory_bytes, shows_bar
from ..train.optim import lr_factor
from .runner import push_staleness


def _worker_steps(services: LoopServices, progress: Progress) -> list[dict]:
    cfg, engine = services.config, services.engine
    workers = engine.num_workers
    records = []
    for step in range(cfg.steps):
        began = time.perf_counter()
        micro = services.sampler.local_micro_batches(step, dp_rank=engine.worker_index, dp_size=workers,
                                                    micro_batch_size=cfg.micro_batch_size)
        batches = [services.loader.load(indices, services.train_data) for indices in micro]
        # each worker normalises by its own target count times W: no collective (equal to the global
        # count whenever workers hold equally many targets, as in causal LM)
        count = None
        if services.losses.token_loss:
            count = torch.tensor(float(max(1, sum(count_targets(b) for b in batches)) * workers),
                                 device=services.device)
        total = engine.forward_backward(batches, lambda out, batch: services.losses.train(out, batch, count))
        grad_norm = engine.clip_gradients(cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        lr = cfg.lr * lr_factor(step, cfg)
        reply = engine.push_pull(step, lr, final=step == cfg.steps - 1)
        engine.zero_grad()
        elapsed = time.perf_counter() - began
        share = float(total)
        tokens = sum(tokens_in(b) for b in batches)
        records.append({"loss_share": share, "grad_norm": grad_norm, "lr": lr, "step_time_s": elapsed,
                        "tokens": tokens, "staleness": reply.staleness, "waited": reply.waited})
        progress.update(loss=share * workers, tokens_per_s=tokens * workers / elapsed, lr=lr)
    return records


def train_async(services: LoopServices) -> TrainResult:
    """The parameter-server strategy's loop, on every rank (servers and workers), after the trainer's set-up."""
    cfg, engine = services.config, services.engine
    progress = Progress(total=cfg.steps, initial=0, enabled=services.is_main and shows_bar(cfg.progress),
                        main=services.is_main)
    roles = engine.roles
    progress.write(f"autopar {__version__}: {roles.world} processes, parameter server: {roles.num_workers} "
                   f"worker(s) (ranks 0-{roles.num_workers - 1}), {roles.servers} server(s) (ranks "
                   f"{roles.num_workers}-{roles.world - 1}), staleness bound {engine.staleness}, "
                   f"{engine.layout.numel:,} parameters, {services.accumulation} micro-batch(es) of "
                   f"{cfg.micro_batch_size} per worker per step\nrun folder: {services.run_dir}")
    result = TrainResult(run_dir=services.run_dir, first_step=1)
    began = time.perf_counter()
    try:
        records = []
        if engine.is_server:
            engine.serve()
        else:
            records = _worker_steps(services, progress)
        trained_s = time.perf_counter() - began
        engine.share_final_parameters()
        # workers split the eval batches as they split the training ones; servers only join the sum
        result.eval_loss = services.evaluator.evaluate((0, 0) if engine.is_server else
                                                       (engine.worker_index, engine.num_workers))
        server = engine.server
        mine = {"records": records, "trained_s": trained_s,
                "pushes": server.pushes if server else [], "pulls": server.pulls if server else [],
                "peak_mem_bytes": peak_memory_bytes(services.device)}
        everyone: list = [None] * roles.world
        dist.all_gather_object(everyone, mine)
        logs = [everyone[r]["records"] for r in roles.worker_ranks]
        result.losses = [sum(log[s]["loss_share"] for log in logs) for s in range(cfg.steps)]
        pushes = [p for e in everyone for p in e["pushes"]]
        pulls = [p for e in everyone for p in e["pulls"]]
        if services.is_main:
            _write_metrics(services, logs, result, pushes, max(e["peak_mem_bytes"] for e in everyone),
                           max(everyone[r]["trained_s"] for r in roles.worker_ranks))
            (services.run_dir / "staleness.json").write_text(json.dumps(
                {"staleness_bound": engine.staleness, "workers": roles.worker_ranks, "servers": roles.server_ranks,
                 "pushes": [p._asdict() for p in pushes], "pulls": [p._asdict() for p in pulls]}) + "\n")
        with warnings.catch_warnings():  # the servers stepped the optimizer; keep the schedule's state in step
            warnings.simplefilter("ignore")
            for _ in range(cfg.steps):
                services.scheduler.step()
        if cfg.steps:
            services.checkpointer.save(cfg.steps)
    finally:
        progress.close()
        engine.close()
    return services.close_run(result)


def _write_metrics(services: LoopServices, logs: list[list[dict]], result: TrainResult, pushes: list,
                   peak: int, trained_s: float) -> None:
    """One line per step: the global batch's loss, worker 0's timing, the step's staleness over workers;
    the last line adds the eval loss and the staleness histogram of the whole run."""
    cfg = services.config
    by_push = push_staleness(pushes)
    histogram = Counter(by_push.values())
    # written after the run, from every worker's records: no wall-clock stamps (each has its step time)
    with_log = MetricsLog(build_loggers(cfg.log, services.run_dir, start=0, config={}), every=cfg.log_every,
                          last=cfg.steps, stamp=False)
    try:
        for s in range(cfg.steps):
            number = s + 1
            first = logs[0][s]
            stale = [by_push[(w, s)] for w in range(len(logs))]
            record = {"step": number, "loss": result.losses[s], "lr": first["lr"],
                      "grad_norm": first["grad_norm"],  # worker 0's pushed gradient (its share)
                      "tokens_per_s": sum(log[s]["tokens"] for log in logs) / first["step_time_s"],
                      "step_time_s": first["step_time_s"], "peak_mem_bytes": peak,
                      "worker_losses": [log[s]["loss_share"] * len(logs) for log in logs],
                      "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
                      "pulls_waited": sum(log[s]["waited"] for log in logs)}
            if number == cfg.steps:
                record["eval_loss"] = result.eval_loss
                record["staleness_histogram"] = {str(k): v for k, v in sorted(histogram.items())}
                record["train_wall_s"] = trained_s
            if with_log.due(number):
                with_log.write(record)
    finally:
        with_log.close()
