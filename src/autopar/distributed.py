"""Joining (or forming) the process group, whoever started us.

Three ways a process can be started, all handled here so the rest of autopar never asks:
- by `torchrun` or `autopar launch` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set);
- as a plain single process (no env): a world of one, on an in-memory store;
- inside a test pool that already formed the group (reused as it is).

Every group gets an explicit timeout, so a rank that dies makes the others fail with a
message instead of hanging for gloo's default 30 minutes.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ._torch_internals import backend_options, clear_dtensor_caches, registered_process_groups, tcp_store
from .dist_env import DistEnv  # noqa: F401 (re-exported: where callers have always found it)
from .errors import DistributedError


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def group_options(backend: str, timeout_s: float):
    """Backend options carrying our timeout (sub-groups do not inherit the world's)."""
    return backend_options(backend, timeout_s)


def init_distributed(device: str, timeout_s: float) -> DistEnv:
    """Join the job's process group (or make a world of one); returns this rank's place."""
    if dist.is_initialized():
        return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())), launched=True)
    env = DistEnv.from_environ()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise DistributedError("device=cuda but no CUDA GPU is visible; use --device cpu")
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    backend = backend_for(device)
    timeout = timedelta(seconds=timeout_s)
    try:
        if env.launched and _restarted_by_torchrun():
            dist.init_process_group(backend, store=_fresh_store(env, timeout), rank=env.rank,
                                    world_size=env.world_size, timeout=timeout)
        elif env.launched:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    except (RuntimeError, ValueError) as exc:
        raise DistributedError(f"could not join the process group (rank {env.rank} of {env.world_size}, "
                               f"MASTER_ADDR={os.environ.get('MASTER_ADDR')}, "
                               f"MASTER_PORT={os.environ.get('MASTER_PORT')}): {exc}") from None
    return env


def _restarted_by_torchrun() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")


def _fresh_store(env: DistEnv, timeout: timedelta):
    """The job's store under a prefix of its own for this restart.

    Measured with torch 2.13: after torchrun restarts its workers (--max-restarts), the new world can read
    the addresses the previous workers left in the store (same keys), and a rank then connects to a dead
    peer ("Connection refused"); a prefix per restart keeps each attempt's keys apart.
    """
    store = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.rank, env.world_size, timeout)
    return dist.PrefixStore(f"autopar/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def process_groups() -> set:
    """The sub-groups this process holds now (the default group left out; torch keeps no public list)."""
    if not dist.is_initialized():
        return set()
    return {group for group in registered_process_groups() if group is not dist.group.WORLD}


def destroy_groups(groups) -> None:
    """Destroy sub-groups every member has finished with, and forget DTensor's cached sharding decisions.

    Each idle gloo group keeps threads of its own (a TCP event loop among them), so a process that builds
    mesh after mesh (a notebook, a test pool) gets slower with every group left alive. DTensor caches
    sharding decisions by specs holding a DeviceMesh, and meshes of one shape compare equal: a later mesh
    would be handed the destroyed groups ("Could not resolve the process group") unless the caches go too.
    """
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):  # already destroyed (by its owner): nothing is left to free
            pass
    if "torch.distributed.tensor" in sys.modules:  # only a process that used DTensor has the caches
        clear_dtensor_caches()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_gather_single(output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's `shard` gathered into `output`, in rank order: torch.distributed.all_gather_single where torch
    has it (2.13; all_gather_into_tensor is deprecated there), all_gather_into_tensor on older torch (2.11, the GPU
    image's), the same collective under its former name. Looked up at each call, so a test that wraps the torch
    function sees the calls."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, shard, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, whole: torch.Tensor, group=None, async_op: bool = False):
    """`whole` summed over the ranks, this rank's 1/n slice of it into `output`: torch.distributed.
    reduce_scatter_single where torch has it (2.13), reduce_scatter_tensor on older torch (2.11), as
    all_gather_single."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, whole, group=group, async_op=async_op)
