"""PipeDream's weight-stashing rule on the whole model, in one process: the oracle of `--schedule pipedream`.

    W(t+1) = opt(W(t), grad f_t(W_0(v_0), ..., W_{pp-1}(v_{pp-1}))),  v_s = max(r, t - (pp-1-s))

(v_s = max(r, t - (pp-1)) for every stage with vertical sync), where f_t is step t's loss (one
micro-batch per replica), W_s(k) the weights of the parameters stage s reads after k updates,
and r the first step of the pipeline run t belongs to (a flush before each eval, checkpoint and
the end starts a new run; pipeline/async_schedules.py). This engine keeps the last pp versions
of every parameter and, for step t, points every use of a parameter at the version of the
stage that reads it, then applies the summed gradient to the newest weights. A parameter read
by several stages (a tied embedding and output head) is one Parameter reachable under several
names; its names are matched to its stages in module order (the embedding's name comes first
and belongs to the first stage reading it), which holds for the models autopar ships. Such a
parameter follows the tied rule (pipeline/async_schedules.py, `tied_steps_due`): its update at
step t applies the summed gradient of step t - tied_delay, none in a run's first tied_delay
steps, and at a run's last step every one not applied yet.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from autopar._torch_internals import parameter_table
from autopar.dropout import active_scope
from autopar.pipeline.async_schedules import runs_of, stash_version, tied_steps_due
from autopar.train.engine import DataParallelEngine, accumulate_gradients


class StashOracleEngine(DataParallelEngine):
    """The whole model; step t's gradient taken with each stage's parameters at that stage's stashed version."""

    def __init__(self, *args, pp: int, stages_of: dict[str, list[int]], vertical_sync: bool, steps: int,
                 flush_after: frozenset[int], tied_delay: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.pp, self.vertical_sync, self.steps, self.flush_after = pp, vertical_sync, steps, flush_after
        self.tied_delay = pp - 1 if tied_delay is None else tied_delay
        self.params = list(self.sync.params)
        index = {id(p): i for i, p in enumerate(self.params)}
        seen: dict[int, int] = {}
        self.slots = []  # (owner module, attribute, parameter index, stage)
        for name, p in self.module.named_parameters(remove_duplicate=False):
            canonical = next(n for n, q in self.module.named_parameters() if q is p)
            stages = sorted(stages_of.get(canonical, stages_of.get(name, [])))
            if not stages:
                raise ValueError(f"stash oracle: no stage reads parameter {name!r} ({canonical!r})")
            k = seen.get(id(p), 0)
            seen[id(p)] = k + 1
            owner_path, _, attr = name.rpartition(".")
            owner = self.module.get_submodule(owner_path) if owner_path else self.module
            self.slots.append((owner, attr, index[id(p)], stages[min(k, len(stages) - 1)]))
        stages_by_index: dict[int, set[int]] = {}
        for _, _, i, stage in self.slots:
            stages_by_index.setdefault(i, set()).add(stage)
        groups: dict[object, list[nn.Parameter]] = {}
        for i, stages in sorted(stages_by_index.items()):
            key = ("stage", min(stages)) if len(stages) == 1 else ("tied", i)
            groups.setdefault(key, []).append(self.params[i])
        self.clip_groups = list(groups.values())
        self.tied = {i for i, stages in stages_by_index.items() if len(stages) > 1}
        self.tied_posted: dict[int, dict[int, torch.Tensor]] = {i: {} for i in self.tied}  # index -> step -> G(step)
        self.history: dict[int, list[torch.Tensor]] = {}
        self.runs: dict[int, tuple[int, int]] = {}

    def forward_backward(self, batches, loss_fn) -> torch.Tensor:
        t = active_scope().step
        if not self.runs:
            self.runs = runs_of(range(t, self.steps), self.flush_after)
        start = self.runs[t][0]
        self.history[t] = [p.detach().clone() for p in self.params]
        self.history = {v: w for v, w in self.history.items() if v >= max(start, t - self.pp + 1)}
        leaves: dict[tuple[int, int], nn.Parameter] = {}
        saved = [(owner, attr, parameter_table(owner)[attr]) for owner, attr, _, _ in self.slots]
        try:
            for owner, attr, i, stage in self.slots:
                v = stash_version(t, stage, pp=self.pp, run_start=start, vertical_sync=self.vertical_sync)
                if (i, v) not in leaves:
                    leaves[(i, v)] = nn.Parameter(self.history[v][i].clone())
                parameter_table(owner)[attr] = leaves[(i, v)]
            total = accumulate_gradients(self.module, self.forward_fn, self.autocast, batches, loss_fn)
        finally:
            for owner, attr, original in saved:
                parameter_table(owner)[attr] = original
        due = tied_steps_due(t, run_start=start, run_end=self.runs[t][1], delay=self.tied_delay)
        for i, p in enumerate(self.params):
            grads = [leaf.grad for (j, _), leaf in leaves.items() if j == i and leaf.grad is not None]
            p.grad = torch.stack(grads).sum(0) if grads else torch.zeros_like(p)
            if i in self.tied:
                self.tied_posted[i][t] = p.grad
                summed = None
                for u in due:
                    grad = self.tied_posted[i].pop(u)
                    summed = grad if summed is None else summed + grad
                p.grad = summed
        self.sync.finish()
        return total

    def clip_gradients(self, max_norm: float) -> float:
        """The whole model's norm (reported); each clip group (module docstring) scaled by its own."""
        squares = []
        for group in self.clip_groups:
            squares.append(float(sum(p.grad.double().square().sum() for p in group if p.grad is not None)))
        for group, square in zip(self.clip_groups, squares):
            norm = math.sqrt(square)
            if norm > max_norm and math.isfinite(max_norm):
                for p in group:
                    if p.grad is not None:
                        p.grad.mul_(max_norm / (norm + 1e-6))
        return math.sqrt(sum(squares))
