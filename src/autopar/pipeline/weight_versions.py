"""PipeDream-2BW's two weight versions of one pipeline rank's parameters.

The rule (pipeline/async_schedules.py): every micro-batch of step t runs forward and
backward on W(t-1), and the optimizer applies that gradient to the newest weights,
W(t+1) = opt(W(t), grad f_t(W(t-1))), with W(-1) = W(0). Between steps the newest weights
are already in use: the look-ahead forwards of step t+1 run on W(t) inside step t.

Storage: two buffers per parameter, never more. The optimizer's Parameter always holds the
newest version (so eval, checkpoints and the optimizer see ordinary parameters); the other
buffer, `older`, holds W(t-1) and is registered as a buffer of this module, so checkpoints
save it and resume restores it. A micro-batch never computes on the Parameter itself: it
runs on leaf tensors that alias one of the two buffers (`leaves`), one set per step, so
each step's gradient accumulates apart from the next step's look-ahead and the optimizer
may update a buffer no graph still reads. At the end of step t, W(t-1)'s buffer is free
(every micro-batch of step t is done): the newest weights are copied into it and the
Parameter is pointed at it before the optimizer updates it in place to W(t+1); the buffer
of W(t) becomes `older`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .._torch_internals import parameter_table


def buffer_name(fqn: str) -> str:
    return "older__" + fqn.replace(".", "__")


class TwoWeightVersions(nn.Module):
    """The older version W(t-1) of each parameter (buffers) and the step t the rank is in."""

    def __init__(self, params: dict[str, nn.Parameter]):
        super().__init__()
        self.names = list(params)
        self._params = list(params.values())  # a plain list: not registered, the owner holds them
        for name, p in params.items():
            self.register_buffer(buffer_name(name), p.detach().clone())  # W(-1) = W(0)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))  # the next step to run
        self._leaves: dict[int, list[nn.Parameter]] = {}  # step b -> leaves its micro-batches run on

    def older(self) -> list[torch.Tensor]:
        return [getattr(self, buffer_name(n)) for n in self.names]

    def leaves(self, batch_step: int) -> list[nn.Parameter]:
        """The tensors step `batch_step`'s micro-batches compute on: W(t-1) for the current step t,
        W(t) (the newest) for the look-ahead of step t+1; nothing else exists."""
        t = int(self.step)
        if batch_step not in self._leaves:
            if batch_step == t:
                sources = self.older()
            elif batch_step == t + 1:
                sources = [p.data for p in self._params]
            else:
                raise RuntimeError(f"2BW: step {batch_step} asked for weights during step {t}; only steps {t} "
                                   f"(on W({t - 1})) and {t + 1} (on W({t})) can be in flight")
            self._leaves[batch_step] = [nn.Parameter(s, requires_grad=p.requires_grad)  # aliases, no copy
                                        for s, p in zip(sources, self._params)]
        return self._leaves[batch_step]

    def gradients_to_parameters(self) -> None:
        """Step t's gradient (accumulated on its leaves) becomes the Parameters' .grad."""
        t = int(self.step)
        leaves = self._leaves.get(t)
        for i, p in enumerate(self._params):
            if not p.requires_grad:  # frozen: no gradient to hand on
                continue
            grad = leaves[i].grad if leaves is not None else None
            p.grad = grad if grad is not None else torch.zeros_like(p)

    @torch.no_grad()
    def advance(self) -> None:
        """End of step t: free W(t-1)'s buffer, give it the newest weights, point the Parameters at it
        (the optimizer then makes W(t+1) there); W(t)'s buffer becomes the older version."""
        t = int(self.step)
        self._leaves.pop(t, None)
        for name, p in zip(self.names, self._params):
            free, newest = getattr(self, buffer_name(name)), p.data
            free.copy_(newest)
            p.data = free
            self._buffers[buffer_name(name)] = newest
        self.step += 1

    def in_flight(self) -> list[int]:
        return sorted(self._leaves)

    def drop_look_ahead(self) -> None:
        """Forget the leaves of steps not yet run (stopping mid-run; their forwards are dropped)."""
        self._leaves = {b: leaves for b, leaves in self._leaves.items() if b < int(self.step)}

    def storages(self) -> set[int]:
        """Distinct weight storages this rank holds (the memory check: two per parameter)."""
        held = {p.untyped_storage().data_ptr() for p in self._params}
        held |= {b.untyped_storage().data_ptr() for b in self.older()}
        for leaves in self._leaves.values():
            held |= {leaf.untyped_storage().data_ptr() for leaf in leaves}
        return held

    def nbytes(self) -> int:
        """Bytes of both versions."""
        return 2 * sum(p.numel() * p.element_size() for p in self._params)


class StageSlots:
    """Where a stage module reads each parameter from, so a forward can run on another version."""

    def __init__(self, stage: nn.Module, index_of: dict[int, int]):
        self.slots = []  # (owner module, attribute, index into the version's leaves)
        for fqn, p in stage.named_parameters(remove_duplicate=False):
            owner_path, _, attr = fqn.rpartition(".")
            owner = stage.get_submodule(owner_path) if owner_path else stage
            self.slots.append((owner, attr, index_of[id(p)]))

    @contextlib.contextmanager
    def running_on(self, leaves: list[nn.Parameter]) -> Iterator[None]:
        saved = [(owner, attr, parameter_table(owner)[attr]) for owner, attr, _ in self.slots]
        try:
            for owner, attr, i in self.slots:
                parameter_table(owner)[attr] = leaves[i]
            yield
        finally:
            for owner, attr, original in saved:
                parameter_table(owner)[attr] = original


class StashedVersions:
    """PipeDream weight stashing on one pipeline rank: each in-flight micro-batch keeps the version
    its forward ran on until its backward is done (pipeline/async_schedules.py states the rule).

    The optimizer's Parameters always hold the newest version. A micro-batch runs on leaf tensors
    that alias a version's storage (one set per micro-batch, so its gradient stays apart). Before
    the optimizer updates in place, the Parameters move to a fresh copy if the current storage is
    still read by an in-flight micro-batch or by a later forward (vertical sync); otherwise the
    update goes in place and nothing is kept. So a rank holds one storage per version still in
    use: pp - s at most on stage s without vertical sync, and nothing beyond the Parameters
    once the pipeline has drained (a checkpoint needs no stash).
    """

    def __init__(self, params: dict[str, nn.Parameter]):
        self.names = list(params)
        self._params = list(params.values())
        self.newest = 0  # the version (updates applied) the Parameters hold
        self._kept: dict[int, list[torch.Tensor]] = {}  # older versions a later forward still needs
        self._leaves: dict[int, tuple[int, list[nn.Parameter]]] = {}  # micro-batch -> (version, its leaves)

    def start(self, version: int) -> None:
        """A pipeline run begins (training starts or resumes, or after a flush) at `version`."""
        if self._leaves:
            raise RuntimeError(f"PipeDream: a new pipeline run with micro-batches {sorted(self._leaves)} in flight")
        self.newest, self._kept = version, {}

    def leaves(self, microbatch: int, version: int) -> list[nn.Parameter]:
        """The tensors micro-batch `microbatch` runs on: version `version`, made at its first forward."""
        if microbatch in self._leaves:
            held, leaves = self._leaves[microbatch]
            if held != version:
                raise RuntimeError(f"PipeDream: micro-batch {microbatch} ran on W({held}), now asks for W({version})")
            return leaves
        if version == self.newest:
            sources = [p.data for p in self._params]
        elif version in self._kept:
            sources = self._kept[version]
        else:
            raise RuntimeError(f"PipeDream: micro-batch {microbatch} needs W({version}); this rank holds "
                               f"W({self.newest}) and {sorted(self._kept)}")
        leaves = [nn.Parameter(s, requires_grad=p.requires_grad) for s, p in zip(sources, self._params)]
        self._leaves[microbatch] = (version, leaves)
        return leaves

    def gradients_to_parameters(self, microbatch: int) -> None:
        """Micro-batch `microbatch`'s gradient (on its leaves) becomes the Parameters' .grad; its stash is dropped."""
        _, leaves = self._leaves.pop(microbatch, (None, None))
        for i, p in enumerate(self._params):
            if not p.requires_grad:  # frozen: no gradient to hand on
                continue
            grad = leaves[i].grad if leaves is not None else None
            p.grad = grad if grad is not None else torch.zeros_like(p)

    @torch.no_grad()
    def advance(self, still_needed: set[int] | range) -> None:
        """Before the optimizer makes version newest + 1: keep the current storage aside if an in-flight
        micro-batch reads it or `still_needed` (versions later forwards will ask for) holds it, and
        drop kept versions nobody needs any more."""
        in_use = {v for v, _ in self._leaves.values()}
        if self.newest in in_use or self.newest in still_needed:
            if self.newest in still_needed:
                self._kept[self.newest] = [p.data for p in self._params]
            for p in self._params:
                p.data = p.data.clone()
        self.newest += 1
        self._kept = {v: s for v, s in self._kept.items() if v in still_needed}

    def in_flight(self) -> list[int]:
        return sorted(self._leaves)

    def storages(self) -> set[int]:
        """Distinct weight storages this rank holds (the memory check)."""
        held = {p.untyped_storage().data_ptr() for p in self._params}
        for kept in self._kept.values():
            held |= {t.untyped_storage().data_ptr() for t in kept}
        for _, leaves in self._leaves.values():
            held |= {leaf.untyped_storage().data_ptr() for leaf in leaves}
        return held

    def nbytes(self) -> int:
        """Bytes of one version of this rank's weights."""
        return sum(p.numel() * p.element_size() for p in self._params)
