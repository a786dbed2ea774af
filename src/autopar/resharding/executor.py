"""Run resharding plans on a process group: asynchronous sends, receives, broadcasts and all-gathers.

Every rank of the default group builds the Resharder with the same plans in the same order: the
broadcast and all-gather groups are created then, collectively and once (gloo and NCCL both
require every rank to take part in making a group). Point-to-point messages go over a private
copy of the world group, so their tags never meet those of other users of the default group.

`start` posts this rank's part of one transfer and returns at once; `PendingReshard.wait` finishes
it and returns this rank's piece under the destination layout. Ranks that call `start` on the same
plans must do so in the same order (as with any collective): the per-plan call count is part of
each message's tag, which keeps two transfers of the same plan in flight apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError, DistributedError
from .layout import intersect, local_slices, shape_of
from .planner import ReshardPlan, Tile, receiver_senders

_TAG_BASE = 1 << 20
_SEQ_WINDOW = 256  # transfers of one plan that may be in flight at once


class PendingReshard:
    """One started transfer on this rank; `wait()` completes it."""

    def __init__(self, plan: ReshardPlan, out: torch.Tensor | None, works: list, kept: list, copies: list,
                 gather: tuple | None):
        self._plan, self._out, self._works, self._kept, self._copies = plan, out, works, kept, copies
        self._gather = gather
        self._done = False

    def wait(self) -> torch.Tensor | None:
        """This rank's piece under the destination layout (None when the rank is not in it)."""
        if self._done:
            return self._out
        try:
            for work in self._works:
                work.wait()
            for buffer, box in self._copies:  # received (or local) tiles into this rank's piece
                _place(self._out, self._plan, buffer, box)
            if self._gather is not None:
                self._all_gather(*self._gather)
        except RuntimeError as exc:  # a peer died or timed out: say which transfer, on which rank
            raise DistributedError(f"rank {dist.get_rank()}: resharding failed ({self._plan.describe()}): "
                                   f"{exc}") from exc
        self._works, self._kept, self._copies, self._done = [], [], [], True
        return self._out

    def _all_gather(self, group, group_ranks, contribution: torch.Tensor, tiles: list[Tile]) -> None:
        """The scatter-gather's second half: every destination rank gets every part of every tile."""
        gathered = [torch.empty_like(contribution) for _ in group_ranks]
        dist.all_gather(gathered, contribution, group=group)
        by_needer = {rank: gathered[i] for i, rank in enumerate(group_ranks)}
        mine = self._plan.dst.box_of(dist.get_rank(), self._plan.shape)
        offset = 0
        for tile in tiles:
            target = self._out[local_slices(tile.box, mine)]  # a gathered tile lies inside every needer's piece
            flat = target.view(-1) if target.is_contiguous() else target.new_empty(tile.numel)
            for j, needer in enumerate(tile.needers):  # straight into place when the region is contiguous
                lo, hi = tile.part_range(j)
                flat[lo:hi] = by_needer[needer][offset:offset + hi - lo]
            if not target.is_contiguous():
                target.copy_(flat.view(shape_of(tile.box)))
            offset += tile.part_numel


def _place(out: torch.Tensor, plan: ReshardPlan, buffer: torch.Tensor, box) -> None:
    """Copy the part of `buffer` (holding `box`) that lies in this rank's destination piece into `out`."""
    mine = plan.dst.box_of(dist.get_rank(), plan.shape)
    common = intersect(box, mine)
    if common is not None:
        out[local_slices(common, mine)] = buffer[local_slices(common, box)]


class Resharder:
    """Executes a fixed list of resharding plans; see the module docstring for the calling rules."""

    def __init__(self, plans: Sequence[ReshardPlan], timeout_s: float, device: torch.device | str = "cpu"):
        """device: where receive buffers and pieces are allocated (tested on CPU with gloo only)."""
        self.plans = tuple(plans)
        self.device = torch.device(device)
        for i, plan in enumerate(self.plans):
            if not isinstance(plan, ReshardPlan):
                raise ConfigError(f"Resharder: plans[{i}] must be a ReshardPlan (from plan_resharding), got {plan!r}")
        if not dist.is_initialized():
            raise DistributedError("Resharder needs an initialised process group (autopar.distributed."
                                   "init_distributed); none is")
        world = dist.get_world_size()
        for i, plan in enumerate(self.plans):
            top = max(plan.src.ranks + plan.dst.ranks)
            if top >= world:
                raise ConfigError(f"Resharder: plans[{i}] names rank {top}, but the world has {world} ranks "
                                  f"(0..{world - 1}); {plan.describe()}")
        self.rank = dist.get_rank()
        timeout = timedelta(seconds=timeout_s)
        self._p2p_group = dist.new_group(list(range(world)), timeout=timeout)
        self._groups: dict[tuple[int, ...], object] = {}
        for plan in self.plans:  # same order on every rank: new_group is collective over the world
            keys = [tuple(sorted(members)) for members in plan.broadcast_groups()]
            if plan.gather_ranks:
                keys.append(tuple(sorted(plan.gather_ranks)))
            for key in keys:
                if key not in self._groups:
                    self._groups[key] = dist.new_group(list(key), timeout=timeout)
        self._tiles_stride = max((len(p.tiles) for p in self.plans), default=1)
        self._seq = [0] * len(self.plans)
        self.link_bytes: dict[tuple[int, int], int] = {}
        """Bytes this rank put on each outgoing link, counted as plan.link_bytes counts them."""

    def _tag(self, plan_index: int, seq: int, tile: int) -> int:
        return _TAG_BASE + ((plan_index * _SEQ_WINDOW + seq % _SEQ_WINDOW) * self._tiles_stride + tile)

    def _count(self, peer: int, nbytes: int) -> None:
        self.link_bytes[(self.rank, peer)] = self.link_bytes.get((self.rank, peer), 0) + nbytes

    def start(self, plan_index: int, local: torch.Tensor | None) -> PendingReshard:
        """Post this rank's sends and receives for plans[plan_index]; `local` is its source piece (None
        when the rank is not in the source layout). Sends may read `local` until `wait()` returns, so
        every rank, senders too, calls `wait()`, and nobody writes `local` in between."""
        if not 0 <= plan_index < len(self.plans):
            raise ConfigError(f"Resharder.start: plan_index {plan_index} is out of range; "
                              f"{len(self.plans)} plan(s) were given")
        plan, me = self.plans[plan_index], self.rank
        local = self._check_local(plan, local)
        seq = self._seq[plan_index]
        self._seq[plan_index] += 1
        src_box = plan.src.box_of(me, plan.shape) if me in plan.src.ranks else None
        out = torch.empty(shape_of(plan.dst.box_of(me, plan.shape)), dtype=plan.dtype, device=self.device) \
            if me in plan.dst.ranks else None
        gathered = [t for t in plan.tiles if t.senders] if plan.gather_ranks else []
        contribution = None
        if plan.gather_ranks and me in plan.gather_ranks:
            contribution = torch.empty(sum(t.part_numel for t in gathered), dtype=plan.dtype,
                                       device=self.device)  # its padding is sent but never read
        works, kept, copies = [], [], []
        offset = 0
        for index, tile in enumerate(plan.tiles):
            tag = self._tag(plan_index, seq, index)
            holds, needs = me in tile.candidates, me in tile.needers
            if plan.gather_ranks and tile.senders:
                for j, sender in enumerate(tile.senders):
                    lo, hi = tile.part_range(j)
                    needer = tile.needers[j]
                    if sender == me and hi > lo:
                        part = local[local_slices(tile.box, src_box)].reshape(-1)[lo:hi].contiguous()
                        kept.append(part)
                        works.append(dist.isend(part, needer, group=self._p2p_group, tag=tag))
                        self._count(needer, part.numel() * plan.itemsize)
                    if needer == me and hi > lo:
                        slot = contribution[offset:offset + hi - lo]
                        if sender is None:  # this rank holds the tile: its part comes from its own piece
                            slot.copy_(local[local_slices(tile.box, src_box)].reshape(-1)[lo:hi])
                        else:
                            works.append(dist.irecv(slot, sender, group=self._p2p_group, tag=tag))
                offset += tile.part_numel
                continue
            if needs and holds:
                copies.append((local[local_slices(tile.box, src_box)], tile.box))
            if not tile.senders:
                continue
            sender = tile.senders[0]
            receivers = tile.receivers
            if plan.method == "broadcast" and len(receivers) > 1:
                members = (sender, *receivers)
                if me in members:
                    group = self._groups[tuple(sorted(members))]
                    if me == sender:
                        buffer = local[local_slices(tile.box, src_box)].contiguous()
                        kept.append(buffer)
                    else:
                        buffer = torch.empty(shape_of(tile.box), dtype=plan.dtype, device=self.device)
                        copies.append((buffer, tile.box))
                    works.append(dist.broadcast(buffer, src=sender, group=group, async_op=True))
                    position = members.index(me)
                    if position + 1 < len(members):  # chain model: each member forwards once
                        self._count(members[position + 1], buffer.numel() * plan.itemsize)
                continue
            pairs = list(zip(receiver_senders(tile, plan.method), receivers))
            if any(s == me for s, _ in pairs):
                buffer = local[local_slices(tile.box, src_box)].contiguous()
                kept.append(buffer)
                for s, r in pairs:
                    if s == me:
                        works.append(dist.isend(buffer, r, group=self._p2p_group, tag=tag))
                        self._count(r, buffer.numel() * plan.itemsize)
            for s, r in pairs:
                if r == me:
                    buffer = torch.empty(shape_of(tile.box), dtype=plan.dtype, device=self.device)
                    works.append(dist.irecv(buffer, s, group=self._p2p_group, tag=tag))
                    copies.append((buffer, tile.box))
        gather = None
        if contribution is not None:
            ranks = plan.gather_ranks
            n = len(ranks)
            self._count(ranks[(ranks.index(me) + 1) % n], (n - 1) * contribution.numel() * plan.itemsize)
            group = self._groups[tuple(sorted(ranks))]
            gather = (group, dist.get_process_group_ranks(group), contribution, gathered)
        return PendingReshard(plan, out, works, kept, copies, gather)

    def replan(self, plan_index: int, plan: ReshardPlan) -> None:
        """Put `plan` in slot plan_index: the same ranks and method as the plan there, another shape or dtype.

        Not collective (it creates no group), so a caller that learns a tensor's shape only when it first
        moves (the pipeline's boundaries) builds the Resharder at set-up on stand-in plans and swaps the
        real ones in later; the ranks of one slot must swap before their first `start` on it."""
        old = self.plans[plan_index]
        if (plan.src, plan.dst, plan.method) != (old.src, old.dst, old.method) or len(plan.tiles) > self._tiles_stride:
            raise ConfigError(f"Resharder.replan: plans[{plan_index}] may only change shape or dtype (same layouts, "
                              f"method and at most {self._tiles_stride} tiles); was {old.describe()}, got "
                              f"{plan.describe()}")
        plans = list(self.plans)
        plans[plan_index] = plan
        self.plans = tuple(plans)

    def _check_local(self, plan: ReshardPlan, local: torch.Tensor | None) -> torch.Tensor | None:
        me = self.rank
        if me not in plan.src.ranks:
            if local is not None:
                raise ConfigError(f"Resharder.start: rank {me} is not in the source layout "
                                  f"{list(plan.src.ranks)} but was given a tensor; pass None")
            return None
        want = shape_of(plan.src.box_of(me, plan.shape))
        if not isinstance(local, torch.Tensor) or tuple(local.shape) != want or local.dtype != plan.dtype \
                or local.device != self.device:
            seen = f"{tuple(local.shape)} {local.dtype} on {local.device}" if isinstance(local, torch.Tensor) \
                else repr(local)
            raise ConfigError(f"Resharder.start: rank {me} must pass its source piece of shape {want}, dtype "
                              f"{plan.dtype}, on {self.device}, got {seen}; {plan.describe()}")
        return local.detach()

    def close(self) -> None:
        """Destroy the groups this Resharder created."""
        for group in (*self._groups.values(), self._p2p_group):
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        self._groups = {}
        self._p2p_group = None
