"""Where this process stands in a job, read from the launcher's environment: no torch needed.

Kept apart from distributed.py (which joins the process group and imports torch.distributed) so that
the command line can name a failing rank without importing torch (`autopar --help` stays fast).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import DistributedError


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the job, read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    launched: bool  # True when a launcher (torchrun / autopar launch) set the env

    @classmethod
    def from_environ(cls) -> DistEnv:
        env = os.environ
        if "WORLD_SIZE" not in env:
            return cls(rank=0, world_size=1, local_rank=0, launched=False)
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local = int(env.get("LOCAL_RANK", rank))
        except (KeyError, ValueError) as exc:
            raise DistributedError(f"launcher environment is incomplete or malformed ({exc}); "
                                   f"RANK and WORLD_SIZE must be integers, as torchrun sets them") from None
        return cls(rank=rank, world_size=world, local_rank=local, launched=True)
