"""Delayed SGD in one process: the update at step t uses the gradient taken at the iterate of step t - tau_t.

    w_{t+1} = w_t - lr * (grad f(w_{t - tau_t}; z_t) + weight_decay * w_t)

(iterates before the start are w_0). This is the model of asynchronous parameter-server
SGD that Deng et al. (arXiv 2308.09430) analyse, and the reference the parameter server is
tested against: with W workers applied round-robin and a loose staleness bound, the server
runs exactly this with tau = W - 1 (see tests/test_delayed_sgd.py).

Use it like an optimizer, evaluating the loss inside `delayed_parameters()`:

    opt = DelayedSGD(model.parameters(), lr=0.1, delay=FixedDelay(4))
    for batch in batches:
        with opt.delayed_parameters():      # the model now holds w_{t - tau_t}
            loss_fn(model, batch).backward()
        opt.step()                           # back to w_t, then the SGD update
        opt.zero_grad()

The update itself is torch's SGD (no momentum), so tau = 0 is bit-identical to plain SGD.
A ring buffer keeps the last max_delay + 1 iterates.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from ..errors import ConfigError


class FixedDelay:
    """tau_t = tau at every step."""

    def __init__(self, tau: int):
        _check_delay("tau", tau)
        self.tau = self.max_delay = tau

    def __call__(self, step: int) -> int:
        return self.tau

    def __repr__(self) -> str:
        return f"FixedDelay({self.tau})"


class RandomDelay:
    """tau_t drawn uniformly from {0, ..., tau_max}, from its own seeded generator (one draw per step,
    so the sequence does not depend on anything else the program draws)."""

    def __init__(self, tau_max: int, seed: int = 0):
        _check_delay("tau_max", tau_max)
        self.max_delay, self.seed = tau_max, seed
        self._rng = random.Random(seed)
        self._drawn: list[int] = []

    def __call__(self, step: int) -> int:
        while len(self._drawn) <= step:
            self._drawn.append(self._rng.randint(0, self.max_delay))
        return self._drawn[step]

    def __repr__(self) -> str:
        return f"RandomDelay({self.max_delay}, seed={self.seed})"


class ScheduledDelay:
    """tau_t = fn(t), for delays that follow a known pattern (e.g. a synchronous round of W workers)."""

    def __init__(self, fn: Callable[[int], int], max_delay: int):
        _check_delay("max_delay", max_delay)
        self.fn, self.max_delay = fn, max_delay

    def __call__(self, step: int) -> int:
        tau = self.fn(step)
        if not 0 <= tau <= self.max_delay:
            raise ConfigError(f"delay schedule gave tau={tau} at step {step}, outside [0, {self.max_delay}]")
        return tau

    def __repr__(self) -> str:
        return f"ScheduledDelay(max_delay={self.max_delay})"


def _check_delay(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be an integer >= 0 (a number of steps), got {value!r}")


Delay = FixedDelay | RandomDelay | ScheduledDelay


class DelayedSGD:
    """Plain SGD whose gradients are evaluated at a past iterate (see the module docstring)."""

    def __init__(self, params: Iterable, *, lr: float, delay: Delay | int, weight_decay: float = 0.0,
                 foreach: bool = True):
        if not lr > 0:
            raise ConfigError(f"lr must be > 0, got {lr}")
        self.delay = FixedDelay(delay) if isinstance(delay, int) else delay
        if not hasattr(self.delay, "max_delay"):
            raise ConfigError(f"delay must be an int, FixedDelay, RandomDelay or ScheduledDelay, got {delay!r}")
        self.optimizer = torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, foreach=foreach)
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.step_count = 0
        self.last_delay = 0
        self._history: deque[list[torch.Tensor]] = deque([self._snapshot()], maxlen=self.delay.max_delay + 1)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def _load(self, values: list[torch.Tensor]) -> None:
        for p, v in zip(self.params, values):
            p.copy_(v)

    def current_delay(self) -> int:
        """tau for this step, capped at the steps taken (before the start, every iterate is w_0)."""
        return min(self.delay(self.step_count), self.step_count)

    @contextmanager
    def delayed_parameters(self) -> Iterator[int]:
        """Inside: the parameters hold w_{t - tau_t} (yields tau_t); on exit they are w_t again."""
        tau = self.current_delay()
        self.last_delay = tau
        if tau == 0:
            yield 0
            return
        current = self._snapshot()
        self._load(self._history[-1 - tau])
        try:
            yield tau
        finally:
            self._load(current)

    def step(self) -> None:
        self.optimizer.step()
        self.step_count += 1
        if self.delay.max_delay:
            self._history.append(self._snapshot())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
