"""The ranks of benchmarks/strategy_search.py (and of strategy_user_jobs.py, which launches the same worker):
measure the blocks and the cores, search on rank 0, then set up, step and release every chosen configuration in
rounds, one Trainer alive at a time, and write what they measured. How it measures: strategy_search.py's
docstring."""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path

from strategy_search import GLOBAL_BATCH, SEQ_LEN, pick_configs, runnable, strategy_of

def search_in_ranks(spec: dict) -> tuple[dict, object]:
    """Measure the blocks on rank 0 (the others wait in a barrier, idle), then the cores this job gets now, as
    `autopar calibrate` does (calibrate_ranks.sharing_probe: a workload on rank 0 alone, then on every rank at
    once, timed to the last rank's end; about 1.8 for 4-8 ranks on a quiet 2-core machine, near the rank count
    when other jobs hold the cores, since then every process gets the same slice whether or not our other ranks
    run), so that the profile and the runs see the same load. Rank 0 then profiles the model,
    searches with the measured blocks and those cores, and picks the configurations to run. Returns what every
    rank gets, and on rank 0 a function that scores the chosen configurations again with given background cores
    (Cluster.background_cores, measured once their trainers exist)."""
    import torch.distributed as dist

    from autopar.search.calibrate_ranks import sharing_probe
    from autopar.search.cluster import load_cluster
    from autopar.search.cost import StepModel
    from autopar.search.measure_profile import measure_blocks, with_measured_blocks
    from autopar.search.profile import profile_model
    from autopar.search.search import SearchSpace, exhaustive
    from autopar.search.step_probe import reference_candidate

    rank, world = dist.get_rank(), dist.get_world_size()
    cluster = load_cluster(spec["cluster"])
    margs = spec["model_args"]

    alone, began = None, time.perf_counter()
    if spec["measure"]:
        dist.barrier()
        if rank == 0:
            alone = measure_blocks(spec["model"], seq_len=SEQ_LEN, model_args=margs)
        cores = sharing_probe()
    measured_s = time.perf_counter() - began
    block = None
    if rank == 0:
        began = time.perf_counter()
        profile = profile_model(spec["model"], seq_len=SEQ_LEN, model_args=margs,
                                tp_degrees=tuple(d for d in (1, 2, 4, 8) if world % d == 0))
        if spec["measure"]:
            from autopar.search.ring_cost import CP_DEGREES, with_ring_seconds  # a ring cp rank's attention, timed
            profile = with_ring_seconds(with_measured_blocks(profile, alone),
                                        degrees=tuple(d for d in CP_DEGREES if world % d == 0))
            cluster = cluster.replace(cores_per_node=cores)
        step_model = StepModel(profile, cluster.replace(memory_headroom=1.0), global_batch_size=GLOBAL_BATCH)
        # the `time` cut is left out of the space here: the runtime measures block times for it, so its cut would
        # follow the noise of that measurement rather than the model's (uniform and parameters cut identically)
        space = SearchSpace(nproc=world, partitions=("uniform", "parameters"))
        if spec.get("schedules"):
            space = dataclasses.replace(space, schedules=tuple(spec["schedules"].split(",")))
        result = exhaustive(step_model, space)
        search_s = time.perf_counter() - began
        # the reference step (search/step_probe.py) calibrates the level; it is run beside the others, not scored
        reference = step_model.evaluate(reference_candidate(world, GLOBAL_BATCH))
        others = [e for e in result.ranked if e.candidate.describe() != reference.candidate.describe()]
        chosen = pick_configs(others, spec["limit"], by_schedule=bool(spec.get("schedules"))) + [reference]
        pick = result.ranked[0]
        block = {"search_s": search_s, "evaluated": result.evaluated, "fitting": len(result.ranked),
                 "pick": pick.candidate.describe(), "pick_runnable": runnable(pick), "blocks_measured_s": measured_s,
                 "effective_cores": cluster.cores_per_node, "cluster_source": cluster.source,
                 "configs": [{"strategy": strategy_of(e.candidate), "micro_batch_size": e.candidate.micro_batch_size,
                              "describe": e.candidate.describe(), "predicted_s": e.step_time_s,
                              "predicted_bytes_per_pp_rank": e.memory_per_rank, "bounds": list(e.bounds),
                              "predicted_memory_terms": [m.to_dict() for m in e.memory_per_stage],
                              "parts": e.parts, "reference": e is reference} for e in chosen]}
    box = [block]
    dist.broadcast_object_list(box, src=0)
    if rank != 0:
        return box[0], None

    def rescore(background: float, scale: float = 1.0) -> list:
        """The chosen configurations scored again with `background` cores taken by idle threads and the level
        `scale` a reference step measured (Cluster.time_shared_scale)."""
        again = StepModel(profile, cluster.replace(memory_headroom=1.0, background_cores=background,
                                                   time_shared_scale=scale), global_batch_size=GLOBAL_BATCH)
        return [again.evaluate(e.candidate) for e in chosen]
    return box[0], rescore


def calibrate_level(block: dict, rescore) -> None:
    """Score every configuration again with the level the reference step measured (search/step_probe.py)."""
    from autopar.search.step_probe import time_shared_scale
    index = next((i for i, c in enumerate(block["configs"]) if c.get("reference")), None)
    background = block.get("background_cores", 0.0)
    unscaled = rescore(background)
    if index is None or not block["configs"][index].get("measured_s"):
        block["time_shared_scale"] = 1.0
        return
    scale = time_shared_scale(block["configs"][index]["measured_s"], unscaled[index])
    block["time_shared_scale"] = scale
    for c, before, after in zip(block["configs"], unscaled, rescore(background, scale)):
        c.update(predicted_unscaled_s=before.step_time_s, predicted_s=after.step_time_s, parts=after.parts)


TIMED_STEPS = 3  # timed steps per visit, after set_up's two: one step's time varies ~10% from the next on a
# time-shared machine, and a visit costs a set-up (0.5-2 s) a few more steps do not
TERMS = ("step", "forward_backward", "busy", "clip_gradients", "optimizer", "zero_grad", "cpu")


def time_phases(trainer) -> dict[str, float]:
    """Wrap the step's phases (engine forward+backward, gradient clipping, optimizer step, zero_grad) with
    timers on this trainer's objects only; returns the dict each step's seconds are written into."""
    seconds: dict[str, float] = {}

    def timed(owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - began
        setattr(owner, attr, wrapper)

    timed(trainer.engine, "forward_backward", "forward_backward")
    timed(trainer.engine, "clip_gradients", "clip_gradients")
    timed(trainer.engine, "zero_grad", "zero_grad")
    timed(trainer.optimizer, "step", "optimizer")
    return seconds


def worker(spec_path: Path) -> None:
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.confirm_ranks import alone
    from autopar.data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
    from autopar.models import build_model
    from autopar.search.calibrate_ranks import background_cores

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # a driver that chose and scored the configurations itself (strategy_user_jobs.py) passes them as `block`
    block, rescore = (spec["block"], None) if "block" in spec else search_in_ranks(spec)
    spec["configs"] = block["configs"]
    corpus = load_corpus("stdlib")
    tokenizer = build_tokenizer("byte")
    vocab = padded_vocab_size(tokenizer.vocab_size)
    data: dict = {}
    visits = itertools.count()  # each visit's own run folder

    def build(cfg: dict):
        """A fresh Trainer of one configuration (the model on meta, materialised from the seed: alike every visit)."""
        model, info = build_model(spec["model"], spec["model_args"], vocab_size=vocab, device="meta")
        if "train" not in data:
            data["train"], _ = build_datasets(corpus, tokenizer, seq_len=spec.get("seq_len", SEQ_LEN), task=info.task,
                                              seed=0)
        config = autopar.TrainConfig(steps=10_000, global_batch_size=spec.get("global_batch", GLOBAL_BATCH),
                                     micro_batch_size=cfg["micro_batch_size"], progress=False,
                                     out=f"{spec['runs']}/{next(visits)}", warmup_steps=1,
                                     compile=cfg["strategy"].get("compile", False))
        fields = {k: v for k, v in cfg["strategy"].items() if k != "compile"}  # (a TrainConfig field)
        return autopar.Trainer(model, data["train"], strategy=autopar.Strategy(**fields), config=config)

    results: list[dict] = [{} for _ in spec["configs"]]
    samples: dict[int, list[float]] = {i: [] for i in range(len(results))}
    phases: dict[int, list[list[float]]] = {i: [] for i in range(len(results))}
    # the reference step sets every prediction's level, so it is timed twice a round, first and last
    reference = [i for i, c in enumerate(spec["configs"]) if c.get("reference")]
    others = [i for i, c in enumerate(spec["configs"]) if not c.get("reference")]
    for _ in range(spec["repeats"]):
        for i in reference + others + reference:
            if "error" in results[i]:
                continue
            with alone(lambda: build(spec["configs"][i])) as trainer:  # no other configuration's trainer alive
                if not set_up(trainer, results[i]):
                    results[i].setdefault("error", "another rank could not set this configuration up")
                    continue
                if "background_cores" not in block:
                    # one trainer's process groups alive, as in a run of it alone, each with a gloo thread that polls
                    # every 10 ms: what they burn while the ranks idle scores the configurations again
                    block["background_cores"] = background_cores()
                for step in range(2, 2 + TIMED_STEPS):
                    samples[i].append(timed_step(trainer, step, phases[i]))
    for i, times in samples.items():
        if times:
            results[i]["measured_s"] = statistics.median(times)
            results[i]["samples_s"] = times
            results[i]["measured_terms_s"] = {name: statistics.median(p[k] for p in phases[i])
                                              for k, name in enumerate(TERMS)}
    if rank == 0:
        if rescore:
            for c, e in zip(block["configs"], rescore(block.get("background_cores", 0.0))):
                c.update(predicted_s=e.step_time_s, parts=e.parts, searched_s=c["predicted_s"])
        for c, m in zip(block["configs"], results):
            c.update(m)
        if rescore:
            calibrate_level(block, rescore)
        Path(spec["out"]).write_text(json.dumps(block))
    dist.barrier()
    dist.destroy_process_group()


def set_up(trainer, record: dict) -> bool:
    """Set a configuration's trainer up and run its first two steps, untimed (allocations: gradient buffers,
    optimizer states); on its first visit the second one counts the peak live tensor bytes per rank. False on all
    ranks when any failed."""
    import torch.distributed as dist

    from autopar.confirm_ranks import all_ranks_ok
    from autopar.search.live_memory import step_peak_bytes
    began = time.perf_counter()
    try:
        trainer._setup()
        trainer.train_step(0)
        if "measured_bytes_per_rank" in record:
            trainer.train_step(1)
        else:
            peaks, terms = [None] * dist.get_world_size(), {}
            dist.all_gather_object(peaks, (step_peak_bytes(trainer, 1, breakdown=terms), terms))
            record["measured_bytes_per_rank"] = [p for p, _ in peaks]
            record["measured_memory_terms"] = [t for _, t in peaks]  # resident + bytes at the peak by making op
            record["setup_s"] = time.perf_counter() - began
        ok = True
    except Exception as exc:  # noqa: BLE001 - reported per configuration, the others still run
        record["error"] = f"{type(exc).__name__}: {exc}"
        ok = False
    return all_ranks_ok(ok)


def timed_step(trainer, step: int, phases: list) -> float:
    """One step from a common start: the slowest rank's seconds; its terms (each the slowest rank's) and the CPU
    seconds of every thread summed over the ranks are appended to `phases`."""
    import torch
    import torch.distributed as dist
    seconds = time_phases(trainer)
    dist.barrier()
    began, used = time.perf_counter(), time.process_time()
    trainer.train_step(step)
    elapsed, cpu = time.perf_counter() - began, time.process_time() - used
    busy = sum(end - start for start, end, action in getattr(trainer.engine, "last_events", [])
               if action.op.is_compute)
    mine = torch.tensor([elapsed, seconds.get("forward_backward", 0.0), busy, seconds.get("clip_gradients", 0.0),
                         seconds.get("optimizer", 0.0), seconds.get("zero_grad", 0.0)], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # each term: the slowest rank's
    summed = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(summed)  # CPU seconds of the step (every thread), summed over the ranks
    phases.append(mine.tolist() + [float(summed)])
    return float(mine[0])
