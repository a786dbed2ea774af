"""A point of the search space (`Candidate`) and what the step model predicts for it (`Estimate`).

Apart from cost.py so the search, the plan writer and the benchmarks can name them without the step
model's imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .memory import StageMemory


@dataclass(frozen=True)
class Candidate:
    """One point of the search space: degrees, micro-batching, schedule, recomputation, cut."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str = "1f1b"
    chunks: int = 1
    recompute: str = "none"  # none | stage-aware (fewest blocks per stage that fit) | all (whole stage)
    partition: str = "time"  # uniform | parameters | time; ignored when `bounds` is given
    bounds: tuple[int, ...] | None = None  # explicit block bounds per stage (MCMC)
    recompute_blocks: tuple[int, ...] | None = None  # explicit recomputed blocks per stage (MCMC)
    zero: int = 0  # ZeRO level over each dp group: 0 replicated, 1 optimizer, 2 and gradients, 3 and parameters
    ep: int = 1  # expert parallelism: each MoE layer's experts sharded over ep of the dp ranks
    sp: bool = False  # sequence parallelism inside the tp group
    cp: int = 1  # context parallelism: each sequence split over cp ranks (the world is dp x cp x tp x pp)
    cp_mode: str = "ring"  # ring | all-to-all (attention's exchange under cp)
    compile: bool = False  # torch.compile each repeated block

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dimensions(self) -> str:
        """The dimensions beyond dp x tp x pp, as describe() and the plan name them ("" when none is set)."""
        return "".join((f" ep={self.ep}" if self.ep > 1 else "", " sp" if self.sp else "",
                        f" cp={self.cp} {self.cp_mode}" if self.cp > 1 else "", " compile" if self.compile else ""))

    def describe(self) -> str:
        cut = "custom cut" if self.bounds else f"{self.partition} cut"
        rc = (f"recompute {list(self.recompute_blocks)}" if self.recompute_blocks is not None
              else f"recompute {self.recompute}")
        sched = f"{self.schedule}" + (f" x{self.chunks} chunks" if self.chunks > 1 else "")
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} mbs={self.micro_batch_size} m={self.num_microbatches} "
                f"{sched} {rc} {cut}" + (f" zero {self.zero}" if self.zero else "") + self.dimensions)


@dataclass
class Estimate:
    """The prediction for one candidate."""

    candidate: Candidate
    step_time_s: float
    tokens_per_s: float
    fits: bool
    memory_per_stage: list[StageMemory]
    memory_per_rank: list[float]  # per pipeline rank (a rank holds `chunks` stages)
    bubble: float
    comm_share: float
    bounds: tuple[int, ...]
    recompute_blocks: tuple[int, ...]
    parts: dict[str, float] = field(default_factory=dict)  # seconds: pipeline, dp_exposed, tied, optimizer
    cluster_plan: dict = field(default_factory=dict)  # on a mixed cluster: the shares, cut and devices priced

    @property
    def peak_memory(self) -> float:
        return max(self.memory_per_rank)
