"""Who serves and who works: the last K ranks of the world are servers, the others workers."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Roles:
    world: int
    servers: int

    @classmethod
    def check(cls, world: int, servers: int, staleness: int) -> Roles:
        """Clear errors for impossible layouts (the same on every rank, before any message)."""
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            raise ConfigError(f"strategy.staleness must be an integer >= 0 (0: synchronous; larger: workers may "
                              f"run that many steps ahead of the slowest), got {staleness!r}")
        if not isinstance(servers, int) or isinstance(servers, bool) or servers < 1:
            raise ConfigError(f"strategy.servers must be a positive integer, got {servers!r}")
        if servers >= world:
            raise ConfigError(f"--servers {servers} with {world} process(es) leaves no worker: the parameter server "
                              f"takes {servers} process(es) and needs at least one more to train; use --servers <= "
                              f"{max(1, world - 1)} or --nproc >= {servers + 1}")
        return cls(world=world, servers=servers)

    @property
    def num_workers(self) -> int:
        return self.world - self.servers

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.num_workers))

    @property
    def server_ranks(self) -> list[int]:
        return list(range(self.num_workers, self.world))

    def is_server(self, rank: int) -> bool:
        return rank >= self.num_workers

    def shard_of(self, rank: int) -> int:
        return rank - self.num_workers
