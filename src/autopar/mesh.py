"""The process mesh: ranks arranged as pp x dp x tp, groups looked up by name.

tp is the innermost dimension, so a tensor-parallel group is made of adjacent ranks (on
one machine, where its frequent all-reduces are cheapest); pp is the outermost, so
pipeline stages may span machines, where only point-to-point activations travel. Built
on torch's DeviceMesh; every sub-group gets the run's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import Strategy
from .distributed import backend_for, group_options
from .errors import ConfigError, choices

DIM_NAMES = ("pp", "dp", "tp")


@dataclass
class ProcessMesh:
    """This rank's view of the pp x dp x tp mesh."""

    device_mesh: DeviceMesh
    strategy: Strategy
    device_type: str

    @classmethod
    def build(cls, strategy: Strategy, *, device: str = "cpu", timeout_s: float = 300.0) -> ProcessMesh:
        world = dist.get_world_size()
        strategy = strategy.resolved(world)
        shape = (strategy.pp, strategy.dp, strategy.tp)
        backend = backend_for(device)
        override = {name: (backend, group_options(backend, timeout_s)) for name in DIM_NAMES}
        mesh = init_device_mesh(device, shape, mesh_dim_names=DIM_NAMES, backend_override=override)
        return cls(device_mesh=mesh, strategy=strategy, device_type=device)

    def _check(self, name: str) -> None:
        if name not in DIM_NAMES:
            raise ConfigError(f"unknown mesh dimension {name!r}; valid: {choices(DIM_NAMES)}")

    def group(self, name: str) -> dist.ProcessGroup:
        self._check(name)
        return self.device_mesh.get_group(name)

    def size(self, name: str) -> int:
        self._check(name)
        return self.device_mesh.size(DIM_NAMES.index(name))

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

    def describe(self) -> str:
        coords = ", ".join(f"{n}={self.local_rank(n)}/{self.size(n)}" for n in DIM_NAMES)
        return f"rank {self.rank}: {coords}"
