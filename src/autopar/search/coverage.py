"""What the search covers of what the runtime can do, as one table.

Why a table: a user reading `autopar plan --auto` should know which of the runtime's choices the
search tried and which it left alone, and why; the plan output ("not searched: ..."), plan.json
(`search.not_covered`) and docs/features/strategy-search.md all read (or are checked against) this
table, so a dimension that lands in the runtime without the search is named in one place. The
schedules come from the schedule table (config/schedules.py: `searched`), so a new schedule is
listed here without a second edit. What `--strategy auto` refuses beside it is the rule table's
rule "search-scope" (config/rules.py); tests check that every flag it names is a row here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.schedules import SCHEDULE_TABLE, ScheduleSpec


@dataclass(frozen=True)
class Dimension:
    """One choice the runtime offers: whether the search varies it, and how or why not."""

    name: str  # as the user meets it: the flag (and value)
    searched: bool
    how: str  # searched: what it tries; not searched: why not


def _schedule_reason(spec: ScheduleSpec) -> str:
    if not spec.flushes:
        return "asynchronous (no flush between steps): its stale weights train a different model than one process"
    if spec.placement != "loop":
        return f"its {spec.placement.upper()} placement of stages: the cost model places stages as a loop"
    return "the cost model does not price it"


_SEARCHED_SCHEDULES = ", ".join(spec.name for spec in SCHEDULE_TABLE if spec.searched)

COVERAGE: tuple[Dimension, ...] = (
    Dimension("dp x tp x pp", True, "every product equal to the process count, tp within a node and only degrees "
              "the tensor-parallel planner accepts for the model"),
    Dimension("--micro-batch-size / --micro-batches", True, "every size and count that divides the batch"),
    Dimension("--schedule", True, _SEARCHED_SCHEDULES),
    Dimension("--chunks", True, "1 and 2 stages per rank, for the schedules that interleave"),
    Dimension("--recompute", True, "none, whole stages, or the fewest blocks per stage that fit the device memory"),
    Dimension("--partition", True, "uniform, by parameters, by time"),
    Dimension("--zero", True, "levels 0-3 wherever the rule table lets them run (with pp and tp too)"),
    *(Dimension(f"--schedule {spec.name}", False, _schedule_reason(spec))
      for spec in SCHEDULE_TABLE if not spec.searched),
    Dimension("--stage-tp", False, "per-stage tp degrees: the cost model prices one tp degree for every stage"),
    Dimension("--tp-subbatches", False, "the cost model does not price sub-pipelined tensor parallelism"),
    Dimension("--sp", True, "on and off wherever tp > 1 divides the sequence: a split block's activations all / tp, each tensor-parallel "
              "all-reduce priced as a reduce-scatter and an all-gather"),
    Dimension("--ep", True, "every ep dividing dp and the expert count, on models whose mixture-of-experts layers "
              "the expert planner recognises: 1/ep of the experts' memory, their dispatch and combine all-to-alls, "
              "the busiest rank's share of the tokens"),
    Dimension("--cp / --cp-mode", True, "every cp whose 2 x cp divides the sequence, ring and (where cp divides the "
              "heads of each tp rank) all-to-all, on models with scaled-dot-product attention: activations and "
              "compute / cp, attention's exchange priced by mode"),
    Dimension("--compile", True, "on and off where the cluster file holds a measured compile_speedup: the repeated "
              "blocks' compute / the speedup, compile_seconds amortised over the run's steps"),
    Dimension("--boundary", False, "the cost model prices whole-tensor direct transfers between stages"),
    Dimension("--recompute all-but-last", False, "the search plans recomputation itself (none, whole stages, "
              "stage-aware blocks)"),
    Dimension("--memory-budget-mb", False, "the search budgets recomputation from the device memory "
              "(--memory-per-device-gb)"),
    Dimension("--dp-mode gossip", False, "it trains a different model than one process (neighbour averaging)"),
    Dimension("--dp-mode async", False, "the parameter server trains a different model than one process "
              "(stale gradients)"),
    Dimension("--sparse-embeddings", False, "the cost model does not price sparse row exchanges"),
    Dimension("--optimizer sparse-adam", False, "its sparse row exchange is not priced"),
    Dimension("--batchnorm", False, "it chooses what BatchNorm's statistics are (the numbers trained)"),
    Dimension("--dp-shares", False, "not searched as weights: on a cluster with per-device speeds the search "
              "prices and applies auto's shares where the layout allows them, elsewhere even (heterogeneous.md)"),
    Dimension("--dtype", False, "taken as given, never switched: fp32 to bf16 changes the numbers trained "
              "(the cost and memory models follow the choice)"),
)

# Every Strategy field, by the row that names it: a field added to the runtime (a new kind of parallelism)
# without a row here fails tests/test_search.py until the search covers it or this table says why not.
FIELD_ROWS = {"dp": "dp x tp x pp", "tp": "dp x tp x pp", "pp": "dp x tp x pp", "stage_tp": "--stage-tp",
              "boundary": "--boundary", "schedule": "--schedule", "vertical_sync": "--schedule pipedream",
              "tied_delay": "--schedule pipedream", "chunks": "--chunks", "partition": "--partition",
              "recompute": "--recompute", "memory_budget_mb": "--memory-budget-mb", "tp_subbatches": "--tp-subbatches",
              "zero": "--zero", "batchnorm": "--batchnorm", "dp_mode": "--dp-mode gossip",
              "topology": "--dp-mode gossip", "gossip_order": "--dp-mode gossip", "staleness": "--dp-mode async",
              "servers": "--dp-mode async", "sparse_embeddings": "--sparse-embeddings",
              "sparse_threshold": "--sparse-embeddings", "sparse_sharding": "--sparse-embeddings",
              "sparse_schedule": "--sparse-embeddings", "sp": "--sp", "ep": "--ep", "cp": "--cp / --cp-mode",
              "cp_mode": "--cp / --cp-mode", "dp_shares": "--dp-shares"}
SEARCH_SETTINGS = ("search", "plan", "cluster", "memory_per_device_gb", "confirm")  # how it searches, not what


def not_covered() -> list[dict[str, str]]:
    """The dimensions the search leaves alone, as plan.json records them."""
    return [{"name": d.name, "why": d.how} for d in COVERAGE if not d.searched]


def not_searched_line() -> str:
    """The one line `autopar plan --auto` prints."""
    return "not searched: " + "; ".join(f"{d.name} ({d.how})" for d in COVERAGE if not d.searched)
