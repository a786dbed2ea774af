"""Fault injection for tests: AUTOPAR_FAULT="KIND:rank=R:step=S[:attempt=A]" (read here only).

    kill              rank R kills itself (SIGKILL) as step S begins: a dead process, no clean-up
    raise-collective  rank R raises RuntimeError as a failed collective would, as step S begins
    sigterm           rank R receives SIGTERM as step S begins (preemption: S finishes, is saved, exit)
    nan               rank R's loss share of step S is NaN (a bad step)
    hang              rank R stops in a sleep as step S begins (its peers then wait in a collective)

Steps count from 1 as metrics.jsonl does. A fault fires only in run attempt A (default 0: the
first; a restarted run is attempt 1, 2, ...), so a restarted run does not meet it again.
The trainer wraps its steps in `FaultySteps` only when the variable is set: the production step
has no fault branches.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, replace

from ..errors import ConfigError, choices
from .deferred import Finished
from .steps import StepInputs, StepsBase, StopFlag

ENV = "AUTOPAR_FAULT"
KINDS = ("kill", "raise-collective", "sigterm", "nan", "hang")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    attempt: int = 0

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, *fields = text.strip().split(":")
        if kind not in KINDS:
            raise ConfigError(f"{ENV}={text!r}: unknown fault {kind!r}; use one of {choices(KINDS)}, "
                              f"e.g. kill:rank=1:step=7")
        values = {}
        for item in fields:
            key, _, value = item.partition("=")
            if key not in ("rank", "step", "attempt") or not value.strip().isdigit():
                raise ConfigError(f"{ENV}={text!r}: {item!r} is not rank=N, step=N or attempt=N "
                                  f"(non-negative integers), e.g. {kind}:rank=1:step=7")
            values[key] = int(value)
        missing = [k for k in ("rank", "step") if k not in values]
        if missing:
            raise ConfigError(f"{ENV}={text!r}: missing {', '.join(missing)}; e.g. {kind}:rank=1:step=7")
        return cls(kind=kind, **values)

    @classmethod
    def from_environ(cls) -> Fault | None:
        text = os.environ.get(ENV, "").strip()
        return cls.parse(text) if text else None

    def due(self, rank: int, step: int, attempt: int) -> bool:
        """True on the rank, step (1-based) and run attempt this fault is for."""
        return (rank, step, attempt) == (self.rank, self.step, self.attempt)

    def strike(self, rank: int, step: int, attempt: int) -> None:
        """Called as each step begins: kill, raise, signal or hang here when due."""
        if not self.due(rank, step, attempt):
            return
        print(f"autopar: injected fault ({ENV}): {self.kind} on rank {rank} at step {step}", flush=True)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "raise-collective":
            raise RuntimeError(f"injected fault ({ENV}): a collective failed on rank {rank} at step {step}")
        elif self.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "hang":
            while True:  # the watchdog (or the launcher) ends this process
                time.sleep(60)

    def poisons_loss(self, rank: int, step: int, attempt: int) -> bool:
        return self.kind == "nan" and self.due(rank, step, attempt)


class FaultySteps:
    """Steps with `fault` injected: it strikes as its step begins (before the step reads the stop flag, so
    an injected SIGTERM stops after that very step); a "nan" fault poisons that step's loss on its rank."""

    def __init__(self, steps: StepsBase, fault: Fault, *, rank: int, attempt: int):
        self.steps, self.fault, self.rank, self.attempt = steps, fault, rank, attempt
        self._inputs, steps.inputs = steps.inputs, self._poisoned_inputs  # (an instance attribute: this object only)

    def run(self, step: int, stop: StopFlag) -> list[Finished]:
        self.fault.strike(self.rank, step + 1, self.attempt)
        return self.steps.run(step, stop)

    def settle_for_stop(self) -> list[Finished]:
        return self.steps.settle_for_stop()

    def _poisoned_inputs(self, step: int) -> StepInputs:
        inputs = self._inputs(step)
        if not self.fault.poisons_loss(self.rank, step + 1, self.attempt):
            return inputs
        loss_fn = inputs.loss_fn
        return replace(inputs, loss_fn=lambda output, batch: loss_fn(output, batch) * float("nan"))
