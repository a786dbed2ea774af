"""`autopar plan --auto`: search the strategies for a model on a cluster and print the best, or a plan JSON.

The plan's `strategy` table holds Strategy fields (config.py) and its `train` table the
micro-batch settings, so `--plan plan.json` can rerun it; `prediction` holds what the model
predicted, for comparison with the measured run.
"""

from __future__ import annotations

import json
import time

from ..config import TrainConfig
from ..errors import ConfigError
from .calibration_cache import note, search_cluster
from .cluster_pricing import even_shares, step_model
from .coverage import not_covered, not_searched_line
from .cost import Estimate, StepModel
from .measure_profile import measure_blocks, with_cost_model
from .profile import profile_model
from .dimensions import compile_note, dimension_notes, longest_sequence
from .decision import PREDICTED_TIME_ERROR, decide, default_layout, to_measure
from .equivalence import execution_key
from .hetero_cluster import is_heterogeneous
from .placement import placement_lines
from .plan_text import configuration
from .search import SearchSpace, divisors, exhaustive, mcmc, require_fit


def plan_dict(e: Estimate, model: StepModel) -> dict:
    """A plan: Strategy fields + micro-batch settings + the prediction behind them."""
    c = e.candidate
    strategy = {"dp": c.dp, "tp": c.tp, "pp": c.pp, "schedule": c.schedule, "chunks": c.chunks,
                "partition": c.partition, "recompute": "all" if c.recompute == "all" else "none", "zero": c.zero}
    if c.recompute == "stage-aware" and any(e.recompute_blocks):
        strategy["memory_budget_mb"] = round(model.cluster.memory_bytes / 2**20, 1)
    if c.ep > 1:
        strategy["ep"] = c.ep
    if c.sp:
        strategy["sp"] = True
    if c.cp > 1:
        strategy.update(cp=c.cp, cp_mode=c.cp_mode)
    if e.cluster_plan.get("dp_shares", "even") != "even":  # the shares the price assumed (cluster_pricing.py)
        strategy["dp_shares"] = e.cluster_plan["dp_shares"]
    mixed = {"cluster_plan": e.cluster_plan} if e.cluster_plan else {}
    return {
        "strategy": strategy,
        "train": {"global_batch_size": model.global_batch_size, "micro_batch_size": c.micro_batch_size,
                  "micro_batches": c.num_microbatches, "dtype": model.dtype, **({"compile": True} if c.compile else {})},
        "prediction": {
            "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s, "bubble_fraction": e.bubble,
            "comm_share": e.comm_share, "peak_memory_bytes_per_rank": [round(m) for m in e.memory_per_rank],
            "memory_per_stage": [m.to_dict() for m in e.memory_per_stage], "stage_bounds": list(e.bounds),
            "recompute_blocks_per_stage": list(e.recompute_blocks), "parts_s": e.parts},
        "model": model.profile.name, "num_params": model.profile.num_params, "seq_len": model.profile.seq_len,
        "cluster": model.cluster.name, "nproc": c.world, **mixed,
    }


def cmd_plan_auto(ns, model_args: dict) -> int:
    """Run the search from parsed `plan` flags (see cli.py) and print the top plans."""
    if ns.nproc is None or ns.nproc < 1:
        raise ConfigError(f"plan --auto needs --nproc N >= 1 (the devices to plan for), got {ns.nproc}")
    if ns.top < 1:
        raise ConfigError(f"--top must be >= 1, got {ns.top}")
    cluster, calibration = search_cluster(ns.cluster, nproc=ns.nproc, memory_per_device_gb=ns.memory_per_device_gb)
    began = time.perf_counter()
    tps = tuple(d for d in divisors(ns.nproc) if d <= cluster.devices_per_node)
    profile = profile_model(ns.model, seq_len=ns.seq_len, tp_degrees=tps, model_args=model_args)
    profile, costs = with_cost_model(profile, cluster, getattr(ns, "cost_model", "auto"),
                                     lambda: measure_blocks(ns.model, seq_len=ns.seq_len, model_args=model_args))
    model = step_model(profile, cluster, global_batch_size=ns.global_batch_size, dtype=ns.dtype,
                       optimizer=getattr(ns, "optimizer", "adamw"))
    result = exhaustive(model, SearchSpace(nproc=ns.nproc))
    require_fit(result, model)
    best = result.ranked[0]
    walked = 0
    if ns.mcmc_steps:
        found, walked = mcmc(model, SearchSpace(nproc=ns.nproc), steps=ns.mcmc_steps, seed=0, start=best.candidate)
        if found is not None and found.step_time_s < best.step_time_s:
            result.ranked.insert(0, found)
    elapsed = time.perf_counter() - began
    top = result.ranked[:ns.top]
    chosen = [(e, plan_dict(e, model)) for e in top]
    train = TrainConfig(global_batch_size=ns.global_batch_size, micro_batch_size=ns.micro_batch_size)
    default = default_layout(even_shares(model), ns.nproc, ns.global_batch_size, {}, train,
                             lambda e: (plan_dict(e, model), None))
    record = decide(chosen, default, model)
    measure = to_measure([record, *record["alternatives"]], default if default.get("fits") else None, None)
    runs = configuration(record) + (f"; unsure, it would first measure {len(measure)} plans for a few steps (the pick, "
                                    f"the default layout, those within the model's {PREDICTED_TIME_ERROR:.0%} error)"
                                    if measure else "")
    longest = longest_sequence(model, best.candidate)
    if ns.json:
        print(json.dumps({**record, "longest_seq_len": longest, "compile": compile_note(cluster),
                          "dimensions_not_picked": dimension_notes(result.ranked),
                          "search": {"evaluated": result.evaluated, "collapsed_equivalent": result.collapsed,
                                     "pruned_memory": result.pruned, "mcmc_states": walked, "seconds": elapsed,
                                     "costs": costs, "calibration": calibration,
                                     "not_covered": not_covered()}}, indent=2))
        return 0
    print(f"{profile.name}: {profile.num_params:,} parameters, seq_len {profile.seq_len}, global batch "
          f"{ns.global_batch_size}; cluster {cluster.name}: {cluster.num_devices} devices, "
          f"{cluster.memory_per_device_gb:g} GiB each ({cluster.source})")
    print(f"calibration: {note(calibration)}")
    print(f"costs: {costs}")
    print(f"searched {result.evaluated} configurations in {elapsed:.1f} s ({result.collapsed} the same execution "
          f"as another, {result.pruned} over memory" + (f", MCMC scored {walked} more" if walked else "") + ")")
    print(f"{'#':>2} {'step':>10} {'tokens/s':>11} {'bubble':>7} {'comm':>6} {'peak/rank':>10}  configuration")
    rows = [(str(i), e) for i, e in enumerate(top, 1)]
    if default.get("runnable"):
        mine = execution_key(default["estimate"])
        rows = [(f"{i}*" if execution_key(e) == mine else i, e) for i, e in rows]
        if not any(i.endswith("*") for i, _ in rows):
            rows.append(("*", default["estimate"]))
    for i, e in rows:
        print(f"{i:>2} {e.step_time_s * 1e3:8.2f}ms {e.tokens_per_s:>11.0f} {e.bubble:>7.1%} {e.comm_share:>6.1%} "
              f"{e.peak_memory / 2**20:>8.1f}Mi  {e.candidate.describe()}" + (" (over memory)" if not e.fits else "")
              + (f" dp shares {e.cluster_plan['dp_shares']}" if e.cluster_plan.get("dp_shares", "even") != "even"
                 else ""))
    print("* the default layout (what `train` runs without --strategy auto, micro-batch size "
          f"{default['estimate'].candidate.micro_batch_size})" if default.get("runnable") else
          f"default layout: cannot run ({default.get('reason')})")
    if is_heterogeneous(cluster):  # the step model prices devices alike; where each rank goes is placement.py's
        print("\n".join(placement_lines(top, model)))
    mem = ", ".join(f"stage {s}: {m.total / 2**20:.1f} MiB" for s, m in enumerate(top[0].memory_per_stage))
    print(f"searched best's memory per stage: {mem}")
    print(f"why: {record['why']}")
    print(f"longest sequence the best layout fits in {cluster.memory_per_device_gb:g} GiB per device (memory model): "
          + (f"{longest} tokens" if longest else "none"))
    print(compile_note(cluster))
    for line in dimension_notes(result.ranked):
        print(f"not picked: {line}")
    print(f"train --strategy auto would run: {runs}")
    print(not_searched_line())
    return 0
