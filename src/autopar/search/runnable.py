"""The rule table (config/rules.py) asked about a candidate layout, cheaply and once per layout.

Why: what combines with what (ZeRO needs replicas and optimizer state, ZeRO-3 per stage not with
chunks or a split backward, a schedule's micro-batch and chunk counts, ...) is written once, in the
rule table, which `resolve()` checks before any process starts. The search used to restate those
rules; it now builds the Setup a candidate would run as and evaluates the same rules, so a rule
added to the table prunes the search too, without a second edit. The search scores thousands of
candidates that share a few hundred layouts, so the verdict is cached per layout (the partition and
the cut do not enter any rule).
"""

from __future__ import annotations

from functools import lru_cache

from ..config import TrainConfig
from ..config import rules
from ..config.rules import Setup
from ..config.strategy import Strategy
from ..errors import ConfigError

STAGE_AWARE_BUDGET_MB = 1.0  # a stand-in budget: the rules read only whether one is set; its value is planned later


@lru_cache(maxsize=65536)
def broken_rules(dp: int, tp: int, pp: int, micro_batch_size: int, num_microbatches: int, schedule: str, chunks: int,
                 zero: int, recompute: str, optimizer: str, dtype: str, ep: int = 1, sp: bool = False, cp: int = 1,
                 cp_mode: str = "ring", compile: bool = False) -> tuple[str, ...]:
    """Names of the rules (phase "layout") the layout breaks, in table order; () when it runs.

    `recompute` is the search's: "stage-aware" runs as --memory-budget-mb, "all" as --recompute all.
    (A test that changes the table clears this cache: `broken_rules.cache_clear()`.)
    """
    strategy = Strategy(dp=dp, tp=tp, pp=pp, schedule=schedule, chunks=chunks, zero=zero,
                        recompute="all" if recompute == "all" else "none",
                        memory_budget_mb=STAGE_AWARE_BUDGET_MB if recompute == "stage-aware" else None,
                        ep=ep, sp=sp, cp=cp, cp_mode=cp_mode)
    config = TrainConfig(global_batch_size=dp * micro_batch_size * num_microbatches, micro_batch_size=micro_batch_size,
                         optimizer=optimizer, dtype=dtype, compile=compile)
    setup = Setup(strategy, config, world=dp * cp * tp * pp)
    return tuple(rule.name for rule in rules.RULES if rule.phase == "layout" and _breaks(rule, setup))


def _breaks(rule: rules.Rule, setup: Setup) -> bool:
    try:
        return bool(rule.broken(setup))
    except ConfigError:  # the rule cannot read this layout (e.g. sizes that do not divide): it does not run either
        return True


def runs(dp: int, tp: int, pp: int, micro_batch_size: int, num_microbatches: int, schedule: str, chunks: int,
         zero: int, recompute: str, optimizer: str, dtype: str, *dimensions) -> bool:
    """Whether the rule table lets the layout run (`dimensions`: ep, sp, cp, cp_mode, compile)."""
    return not broken_rules(dp, tp, pp, micro_batch_size, num_microbatches, schedule, chunks, zero, recompute,
                            optimizer, dtype, *dimensions)
