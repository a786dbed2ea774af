"""The process mesh: ranks arranged as pp x dp x tp (pp x dp x cp x tp with --cp), groups looked up by name.

tp is the innermost dimension, so a tensor-parallel group is made of adjacent ranks (on
one machine, where its frequent all-reduces are cheapest); pp is the outermost, so
pipeline stages may span machines, where only point-to-point activations travel. Built
on torch's DeviceMesh; every sub-group gets the run's timeout. Context parallelism (cp) sits between
dp and tp: its ring exchanges blocks every layer, more often than dp's once-per-step sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import Strategy
from .distributed import backend_for, group_options
from .errors import ConfigError, choices

DIM_NAMES = ("pp", "dp", "tp")
CP_DIM_NAMES = ("pp", "dp", "cp", "tp")  # with --cp > 1


@dataclass
class ProcessMesh:
    """This rank's view of the pp x dp x tp mesh (pp x dp x cp x tp with --cp)."""

    device_mesh: DeviceMesh
    device_type: str
    dims: tuple[str, ...] = DIM_NAMES
    replica_group: dist.ProcessGroup | None = None  # with --cp: the ranks of one (pp, tp) over dp x cp

    @classmethod
    def build(cls, strategy: Strategy, *, device: str = "cpu", timeout_s: float = 300.0) -> ProcessMesh:
        world = dist.get_world_size()
        strategy = strategy.resolved(world)
        if strategy.stage_tps is not None:
            return StageMesh.build(strategy, device=device, timeout_s=timeout_s)
        cp = strategy.cp
        dims = CP_DIM_NAMES if cp > 1 else DIM_NAMES
        shape = (strategy.pp, strategy.dp, cp, strategy.tp) if cp > 1 else (strategy.pp, strategy.dp, strategy.tp)
        backend = backend_for(device)
        override = {name: (backend, group_options(backend, timeout_s)) for name in dims}
        mesh = init_device_mesh(device, shape, mesh_dim_names=dims, backend_override=override)
        replica_group = None
        if cp > 1:  # weight gradients are summed over dp x cp: one group per (pp, tp), made on every rank in order
            ranks = mesh.mesh.reshape(strategy.pp, strategy.dp * cp, strategy.tp)
            for p in range(strategy.pp):
                for t in range(strategy.tp):
                    members = [int(r) for r in ranks[p, :, t]]
                    group = dist.new_group(members, backend=backend, pg_options=group_options(backend, timeout_s))
                    if dist.get_rank() in members:
                        replica_group = group
        return cls(device_mesh=mesh, device_type=device, dims=dims, replica_group=replica_group)

    def _check(self, name: str) -> None:
        if name not in self.dims:
            raise ConfigError(f"unknown mesh dimension {name!r}; valid: {choices(self.dims)}")

    def gradient_group(self) -> dist.ProcessGroup:
        """Where weight gradients are summed: the dp group, or dp x cp with context parallelism."""
        return self.replica_group if self.replica_group is not None else self.group("dp")

    def group(self, name: str) -> dist.ProcessGroup:
        self._check(name)
        return self.device_mesh.get_group(name)

    def size(self, name: str) -> int:
        self._check(name)
        return self.device_mesh.size(self.dims.index(name))

    def local_rank(self, name: str) -> int:
        self._check(name)
        return self.device_mesh.get_local_rank(name)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def dp_rank(self) -> int:
        return self.local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def tp_group_index(self) -> int:
        """Which tensor-parallel group this rank is in (a seed stream shared by its group)."""
        return self.rank // self.size("tp")

    def describe(self) -> str:
        coords = ", ".join(f"{n}={self.local_rank(n)}/{self.size(n)}" for n in self.dims)
        return f"rank {self.rank}: {coords}"


def stage_rank_table(stage_tp: tuple[int, ...], dp: int) -> list[list[list[int]]]:
    """Global ranks of pipelines whose stages have their own tp degrees: [stage][dp][tp rank].

    Stage-major, then dp, then tp (innermost, adjacent ranks), as the uniform mesh orders
    pp x dp x tp: stage s starts after dp * sum(stage_tp[:s]) ranks. All equal degrees give
    exactly the uniform mesh's numbering.
    """
    table, start = [], 0
    for t in stage_tp:
        table.append([[start + d * t + j for j in range(t)] for d in range(dp)])
        start += dp * t
    return table


@dataclass
class StageMesh:
    """This rank's view of a pipeline whose stages have different tp degrees (--stage-tp 2,4).

    The same lookups as ProcessMesh: "tp" is this stage's tp group (its size is this stage's
    degree), "dp" the replicas of this (stage, tp rank), "pp" this rank's stage index. There is
    no single pp group (stages differ in rank count): "replica" groups every rank of one dp
    index, and the boundary transfers (pipeline/hetero_boundary.py) address global ranks.
    """

    dp: int  # replicas of each (stage, tp rank)
    device_type: str
    table: list[list[list[int]]]  # [stage][dp][tp] -> global rank
    stage: int
    dp_index: int
    tp_index: int
    groups: dict[str, dist.ProcessGroup]

    @classmethod
    def build(cls, strategy: Strategy, *, device: str = "cpu", timeout_s: float = 300.0) -> StageMesh:
        """Collective over the world: every rank creates every group, in one order."""
        degrees, dp = strategy.stage_tps, strategy.dp
        table = stage_rank_table(degrees, dp)
        backend = backend_for(device)
        options = group_options(backend, timeout_s)
        me = dist.get_rank()
        where = {r: (s, d, j) for s, rows in enumerate(table) for d, row in enumerate(rows) for j, r in enumerate(row)}
        stage, dp_index, tp_index = where[me]
        groups: dict[str, dist.ProcessGroup] = {}
        candidates = {
            "tp": [row for rows in table for row in rows],
            "dp": [[rows[d][j] for d in range(dp)] for rows in table for j in range(len(rows[0]))],
            "replica": [[r for rows in table for r in rows[d]] for d in range(dp)],
        }
        for name, lists in candidates.items():
            for ranks in lists:
                group = dist.new_group(ranks, backend=backend, pg_options=options)
                if me in ranks:
                    groups[name] = group
        return cls(dp=dp, device_type=device, table=table, stage=stage, dp_index=dp_index,
                   tp_index=tp_index, groups=groups)

    @property
    def stage_tp(self) -> tuple[int, ...]:
        return tuple(len(rows[0]) for rows in self.table)

    def group(self, name: str) -> dist.ProcessGroup:
        if name not in self.groups:
            raise ConfigError(f"mesh group {name!r} does not exist with --stage-tp (stages differ in rank "
                              f"count); valid: {choices(sorted(self.groups))}")
        return self.groups[name]

    def gradient_group(self) -> dist.ProcessGroup:
        """Where weight gradients are summed: the dp group (context parallelism does not run with --stage-tp)."""
        return self.group("dp")

    def size(self, name: str) -> int:
        return {"pp": len(self.table), "dp": self.dp, "tp": len(self.table[self.stage][0]),
                "replica": sum(self.stage_tp)}[name]

    def local_rank(self, name: str) -> int:
        return {"pp": self.stage, "dp": self.dp_index, "tp": self.tp_index,
                "replica": dist.get_rank(self.groups["replica"])}[name]

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def dp_rank(self) -> int:
        return self.dp_index

    @property
    def dp_size(self) -> int:
        return self.dp

    @property
    def tp_group_index(self) -> int:
        return self.stage * self.dp + self.dp_index

    def describe(self) -> str:
        return (f"rank {self.rank}: stage={self.stage}/{len(self.table)} dp={self.dp_index}/{self.dp} "
                f"tp={self.tp_index}/{self.size('tp')}")
