"""How plans are written for people: a configuration in one phrase, its costs, one plan beside another.

Shared by the banner (auto.Plan.describe), the decision against the default layout (decision.py)
and the end-of-run comparison of measured with predicted (auto.measured_vs_predicted).
"""

from __future__ import annotations

from .search import differing, ms, percent


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def configuration(record: dict) -> str:
    """A plan's strategy in one phrase: degrees, schedule, micro-batches, recomputation, cut."""
    s, t = record["strategy"], record["train"]
    parts = [f"dp={s['dp']} tp={s.get('tp', 1)} pp={s.get('pp', 1)}"]
    if s.get("pp", 1) > 1:
        parts.append(s.get("schedule", "1f1b") + (f" x{s['chunks']} chunks" if s.get("chunks", 1) > 1 else ""))
    micro = t.get("micro_batches") or t["global_batch_size"] // (s["dp"] * t["micro_batch_size"])
    parts.append(f"m={micro} of {t['micro_batch_size']}")
    if s.get("recompute", "none") != "none":
        parts.append(f"recompute {s['recompute']}")
    if s.get("memory_budget_mb"):
        parts.append(f"recompute to fit {s['memory_budget_mb']:g} MiB")
    mixed = record.get("cluster_plan") or {}
    if s.get("pp", 1) > 1:
        parts.append(f"{s.get('partition', 'time')} cut" + (
            f" at stage speeds {','.join(f'{v:g}' for v in mixed['stage_speeds'])} (blocks {mixed['stage_bounds']})"
            if mixed.get("stage_bounds") and s.get("partition", "time") == "time" else ""))
    if s.get("dp_shares", "even") != "even":
        parts.append(f"dp shares {s['dp_shares']}" + (
            f" ({mixed['microbatches_per_replica']} micro-batches)" if mixed.get("microbatches_per_replica") else ""))
    if s.get("zero"):
        parts.append(f"zero {s['zero']}")
    if s.get("ep", 1) > 1:
        parts.append(f"ep={s['ep']}")
    if s.get("sp"):
        parts.append("sp")
    if s.get("cp", 1) > 1:
        parts.append(f"cp={s['cp']} {s.get('cp_mode', 'ring')}")
    if t.get("compile"):
        parts.append("compile")
    return " ".join(parts)


def same_plan(a: dict, b: dict) -> bool:
    return a.get("strategy") == b.get("strategy") and a.get("train") == b.get("train")


def versus(other: dict, mine: dict) -> str:
    """`other`'s predicted step time beside `mine`, in digits that differ; at equal times, its memory."""
    pair = differing(other["step_time_s"], mine["step_time_s"], ms)
    if pair is None:
        return f"same predicted time, {max(other.get('peak_memory_bytes_per_rank') or [0]) / 2**20:.3g} MiB/rank"
    slower = other["step_time_s"] / mine["step_time_s"] - 1
    return f"{pair[0]}/step ({'+' if slower > 0 else ''}{percent(slower)})"


def costs(prediction: dict) -> str:
    per_rank = prediction.get("peak_memory_bytes_per_rank") or [0]
    return f"{milliseconds(prediction['step_time_s'])} ms/step, {max(per_rank) / 2**20:.1f} MiB/rank"
