"""The pipeline schedules as one table: every fact about a schedule that code outside its generator reads.

Why a table: the names (flags, help), the micro-batches and chunks a schedule accepts, how it places
stages, whether its backward is split into I and W, what it composes with (the rule table,
config/rules.py) and whether the search tries it were spread over the strategy, the pipeline, the
search and the checks. A new schedule is one `ScheduleSpec` here plus its generator, registered
under `generator` in pipeline/schedules.py (this layer imports no pipeline code).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, choices

MICROBATCH_RULES = ("any", "one", "at least pp", "multiple of pp")


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule: what it accepts and what it composes with."""

    name: str
    summary: str
    generator: str  # key of pipeline/schedules.py's GENERATORS (several schedules may share one)
    chunks: tuple[int, int | None] = (1, 1)  # stages per rank: (least, most); None: no upper bound
    placement: str = "loop"  # 'loop': stage s on rank s mod pp; 'v': rank r holds stages r and 2pp-1-r
    microbatches: str = "any"  # per replica per step: one of MICROBATCH_RULES
    microbatches_why: str = ""  # why, when not "any"
    split_backward: bool = False  # the backward is two actions: I (input gradient) and W (weight gradient)
    flushes: bool = True  # False: no flush between steps, weights are stale (PipeDream); not synchronous SGD
    stage_tp: bool = False  # runs planned boundaries (--stage-tp, --boundary other than direct)
    zero3_stages: bool = True  # runs FSDP2 per stage (--zero 3 with pp or tp)
    searched: bool = True  # a candidate of --strategy auto (the cost model models it)

    def minimum_microbatches(self, pp: int) -> int:
        return pp if self.microbatches in ("at least pp", "multiple of pp") else 1

    def accepts_chunks(self, chunks: int) -> bool:
        least, most = self.chunks
        return least <= chunks and (most is None or chunks <= most)

    def chunks_text(self) -> str:
        least, most = self.chunks
        return f"{least} or more" if most is None else str(least) if least == most else f"{least} to {most}"


SCHEDULE_TABLE: tuple[ScheduleSpec, ...] = (
    ScheduleSpec("gpipe", "all forwards, then all backwards", generator="gpipe",
                 stage_tp=True),
    ScheduleSpec("1f1b", "pp - stage forwards in flight, then one backward per forward", generator="1f1b",
                 stage_tp=True),
    ScheduleSpec("interleaved-1f1b", "several stages (chunks) per rank, micro-batches in groups of pp",
                 generator="interleaved", chunks=(1, None), microbatches="multiple of pp",
                 microbatches_why="micro-batches go through in groups of pp"),
    ScheduleSpec("eager-1f1b", "one forward slot ahead of 1F1B so forward transfers overlap",
                 generator="eager-1f1b", stage_tp=True),
    ScheduleSpec("scp", "Merak's shifted critical path: 1F1B with recomputation moved off the critical path",
                 generator="scp", searched=False),
    ScheduleSpec("zb-h1", "zero-bubble: backward split into I and W, W off the critical path",
                 generator="zb-h1", split_backward=True, zero3_stages=False),
    ScheduleSpec("zbv", "zero-bubble V: two chunks per rank placed as a V, backward split into I and W",
                 generator="zbv", chunks=(2, 2), placement="v", split_backward=True, zero3_stages=False,
                 searched=False),  # the cost model places stages as a loop
    ScheduleSpec("pipedream-2bw", "no flush, two weight versions per stage (PipeDream-2BW)",
                 generator="1f1b", microbatches="at least pp", flushes=False,
                 microbatches_why="the look-ahead forwards of the next step must fit in it, so two weight versions "
                                  "suffice",
                 zero3_stages=False, searched=False),
    ScheduleSpec("pipedream", "no flush, weight stashing: one optimizer step per micro-batch (PipeDream)",
                 generator="1f1b", microbatches="one", flushes=False,
                 microbatches_why="one optimizer step is one micro-batch per replica",
                 zero3_stages=False, searched=False),
)

SCHEDULE_SPECS: dict[str, ScheduleSpec] = {spec.name: spec for spec in SCHEDULE_TABLE}
# The names, by kind, as the flags, the strategy table and the search read them.
SCHEDULES = tuple(spec.name for spec in SCHEDULE_TABLE if spec.flushes)  # synchronous: flush every step
ASYNC_SCHEDULES = tuple(spec.name for spec in SCHEDULE_TABLE if not spec.flushes)  # never searched
STAGE_TP_SCHEDULES = tuple(spec.name for spec in SCHEDULE_TABLE if spec.stage_tp)
SPLIT_SCHEDULES = tuple(spec.name for spec in SCHEDULE_TABLE if spec.split_backward)


def schedule_spec(name: str) -> ScheduleSpec:
    """The table's entry for `name`; an unknown name is refused with the valid ones."""
    spec = SCHEDULE_SPECS.get(name)
    if spec is None:
        raise ConfigError(f"unknown pipeline schedule {name!r}; use one of {choices(SCHEDULE_SPECS)}")
    return spec
