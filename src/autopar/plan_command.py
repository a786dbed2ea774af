"""`autopar plan`: where the cuts fall, how layers split, per-stage tp degrees and their boundaries.

Kept apart from cli.py (argument parsing and the train path) because it is its own command: it traces
the model on meta and prints plans, and starts nothing. `--auto` hands over to search/command.py.
"""

from __future__ import annotations

import argparse

from .config import DEFAULT_MICRO_BATCH_SIZE
from .errors import ConfigError


def plan(ns: argparse.Namespace, args: dict) -> int:
    """What `autopar plan` prints for the model's `args` (the --model-arg values), before anything runs."""
    import json

    import torch

    from .data import build_tokenizer, padded_vocab_size
    from .models import build_model
    from .partition import partition
    from .partition.measure import measure_block_times
    from .trace import trace
    if ns.auto:  # the strategy search (search/command.py)
        from .search.command import cmd_plan_auto
        return cmd_plan_auto(ns, args)
    if ns.micro_batch_size is None:  # (the search's default layout resolves it per dp, as train does)
        ns.micro_batch_size = DEFAULT_MICRO_BATCH_SIZE
    tokenizer = build_tokenizer("byte")
    model, info = build_model(ns.model, args, vocab_size=padded_vocab_size(tokenizer.vocab_size), device="meta")
    if ns.seq_len > info.max_seq_len:
        raise ConfigError(f"seq_len={ns.seq_len} is longer than {info.name}'s context of {info.max_seq_len}")
    graph = trace(model, (torch.zeros(ns.micro_batch_size, ns.seq_len, dtype=torch.long, device="meta"),))
    if ns.measure:
        measure_block_times(graph, model)
    cap = ns.memory_cap_mb * 2**20 if ns.memory_cap_mb else None
    if ns.stage_tp is not None:
        return _plan_stage_tp(ns, graph, info, cap)
    ns.pp = 2 if ns.pp is None else ns.pp
    result = partition(graph, ns.pp, method=ns.method, memory_cap_bytes=cap)
    tp_plan = None
    if ns.tp != 1:
        from .tensor_parallel import plan_tensor_parallel
        tp_plan = plan_tensor_parallel(graph, ns.tp, sequence=ns.sp)
    from .experts import find_experts
    experts = find_experts(graph, model)  # mixture-of-experts layers --ep would shard, or why routing stays whole
    ep = getattr(ns, "ep", 1) or 1
    if ns.json:
        extra = {"tensor_parallel": tp_plan.to_dict()} if tp_plan is not None else {}
        if experts.layers or experts.unrecognised:
            extra["experts"] = experts.to_dict()
        print(json.dumps({"model": info.name, "micro_batch": [ns.micro_batch_size, ns.seq_len],
                          "measured": ns.measure, **result.to_dict(), **extra}, indent=2))
    else:
        print(f"{info.name}: {info.num_params:,} parameters, {len(graph.blocks)} blocks, micro-batch "
              f"{ns.micro_batch_size} x {ns.seq_len}, time {'measured' if ns.measure else 'estimated from FLOPs'}")
        print(result.table())
        if tp_plan is not None:
            print()
            print(tp_plan.table())
        if experts.layers or experts.unrecognised:
            print()
            print(experts.table(ep))
    return 0


def _plan_stage_tp(ns: argparse.Namespace, graph, info, cap) -> int:
    """`autopar plan --stage-tp 2,4`: the cut, each stage's tp degree and ranks, each boundary's transfer."""
    import json

    from .config import Strategy
    from .mesh import stage_rank_table
    from .partition import partition
    from .pipeline.hetero_boundary import boundary_routes
    from .search.cluster import cluster_for_ranks
    from .tensor_parallel import plan_tensor_parallel
    degrees = Strategy(stage_tp=ns.stage_tp).stage_tps
    if ns.pp is not None and ns.pp != len(degrees):
        raise ConfigError(f"--stage-tp {ns.stage_tp} lists {len(degrees)} stages but --pp is {ns.pp}; drop "
                          f"--pp (it is the list's length)")
    dp = 1 if ns.nproc is None else ns.nproc // sum(degrees)
    strategy = Strategy(stage_tp=ns.stage_tp, dp=None).resolved(ns.nproc or sum(degrees))  # the train-time checks
    plans = {t: plan_tensor_parallel(graph, t) for t in sorted(set(degrees)) if t > 1}  # heads / width checks
    result = partition(graph, len(degrees), method=ns.method, memory_cap_bytes=cap)
    table = stage_rank_table(degrees, dp)
    stages = [{"stage": s, "tp": t, "ranks": table[s], "tp_split": plans[t].summary() if t > 1 else "whole"}
              for s, t in enumerate(degrees)]
    boundaries = [{"from": s, "to": s + 1, "forward": boundary_routes(degrees[s], degrees[s + 1]),
                   "backward": boundary_routes(degrees[s + 1], degrees[s])} for s in range(len(degrees) - 1)]
    if ns.boundary != "direct":  # the planned transfers --boundary would run (replica 0's ranks)
        for b in boundaries:
            b["forward"], b["backward"] = _boundary_plans(ns.boundary, table, b["from"], result.boundaries[b["from"]],
                                                          cluster_for_ranks(ns.cluster, dp * sum(degrees)))
    if ns.json:
        print(json.dumps({"model": info.name, "micro_batch": [ns.micro_batch_size, ns.seq_len], "dp": dp,
                          **result.to_dict(), "stage_tp": list(degrees), "stage_layouts": stages,
                          "boundary_transfers": boundaries}, indent=2))
        return 0
    print(f"{info.name}: {info.num_params:,} parameters, {len(graph.blocks)} blocks, micro-batch "
          f"{ns.micro_batch_size} x {ns.seq_len}; --stage-tp {strategy.stage_tp or ns.stage_tp}: "
          f"{dp} x {sum(degrees)} = {dp * sum(degrees)} ranks")
    print(result.table())
    print()
    for stage in stages:
        print(f"stage {stage['stage']}: tp={stage['tp']}, ranks {stage['ranks']} ([dp][tp rank]); {stage['tp_split']}")
    for b in boundaries:
        if ns.boundary == "direct":
            print(f"boundary {b['from']} -> {b['to']}: activations {b['forward']}; gradients {b['backward']}")
            continue
        print(f"boundary {b['from']} -> {b['to']} (--boundary {ns.boundary}; times are cost-model predictions):")
        for line in b["forward"]:
            print(f"  activation {line}")
        for line in b["backward"]:
            print(f"  gradient   {line}")
    return 0


def _boundary_plans(method: str, table, sender: int, values, cluster) -> tuple[list[str], list[str]]:
    """The resharding plans (ReshardPlan.describe()) for one boundary's values: activations, then gradients,
    priced on `cluster` as train's --boundary auto prices them."""
    import torch

    from .resharding import Layout, plan_resharding
    ahead, back = Layout(ranks=tuple(table[sender][0])), Layout(ranks=tuple(table[sender + 1][0]))
    forward, backward = [], []
    for value in values:
        dtype = getattr(torch, str(value.dtype).removeprefix("torch."))
        itemsize = torch.empty((), dtype=dtype).element_size()
        forward.append(f"{value.name}: " + plan_resharding(value.shape, itemsize, ahead, back, method, cluster,
                                                          dtype=dtype).describe())
        if value.needs_grad:
            backward.append(f"{value.name}: " + plan_resharding(value.shape, itemsize, back, ahead, method, cluster,
                                                               dtype=dtype).describe())
    return forward, backward
