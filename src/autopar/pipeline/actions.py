"""The vocabulary of pipeline schedules: a schedule is data, one ordered action list per rank.

A schedule generator (schedules.py) emits compute actions; `add_communication` lowers them
by inserting the sends and receives the cross-rank dependencies need; the simulator
(simulate.py) checks and times the lowered lists; the runtime (runtime.py) only executes
them. Stages are *global* indices 0..num_stages-1 (num_stages = pp * chunks); with
interleaving a rank holds several (its chunks), placed by `stage_to_rank`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Op(str, Enum):
    FORWARD = "F"  # forward of one micro-batch through one stage
    BACKWARD = "B"  # full backward (input and weight gradients)
    BACKWARD_INPUT = "I"  # input gradients only (zero-bubble schedules)
    BACKWARD_WEIGHT = "W"  # the weight gradients left by an earlier I
    RECOMPUTE = "R"  # re-run the forward of a recomputed micro-batch, building its graph, before B / I
    SEND_ACT = "SEND_F"  # send a forward's outputs to the next stage
    RECV_ACT = "RECV_F"  # receive a forward's inputs from the previous stage
    SEND_GRAD = "SEND_B"  # send input gradients to the previous stage
    RECV_GRAD = "RECV_B"  # receive output gradients from the next stage

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_OPS

    @property
    def is_comm(self) -> bool:
        return not self.is_compute


COMPUTE_OPS = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.RECOMPUTE})


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: `op` on micro-batch `microbatch` of global stage `stage`.

    `stage` is always this rank's stage, sender or receiver; `peer` is the other rank:
    - SEND_F(stage=s): stage s sends its forward outputs to stage s+1's rank;
    - RECV_F(stage=s): stage s receives its forward inputs from stage s-1's rank;
    - SEND_B(stage=s): stage s sends its input gradients to stage s-1's rank;
    - RECV_B(stage=s): stage s receives its output gradients from stage s+1's rank.
    `str()` and `parse` write and read the compact form ('0F3', '1SEND_F2'), without the peer.
    `step` (communication actions only): the communication step (comm_steps.py) the transfer
    belongs to; a runtime posts the consecutive actions of one step as one batched group, and
    both ends of a transfer carry the same step. None: posted on its own.
    """

    stage: int
    op: Op
    microbatch: int
    peer: int | None = None
    step: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """'0F3' -> Action(0, F, 3); '1SEND_F2' -> Action(1, SEND_F, 2)."""
        digits = 0
        while digits < len(text) and text[digits].isdigit():
            digits += 1
        tail = text[digits:]
        for op in sorted(Op, key=lambda o: -len(o.value)):
            if tail.startswith(op.value) and tail[len(op.value):].isdigit():
                return cls(int(text[:digits]), op, int(tail[len(op.value):]))
        raise ValueError(f"not an action: {text!r} (expected e.g. '0F3', '1B0', '2SEND_F1')")


Schedule = dict[int, list[Action]]
"""rank -> that rank's actions, in execution order."""


def stage_to_rank(stage: int, pp: int, num_stages: int, style: str = "loop") -> int:
    """Which rank runs a global stage: `loop` (stage s on rank s % pp) or `v` (rank r: r and 2pp-1-r)."""
    if style == "loop":
        return stage % pp
    if style == "v":
        chunk, offset = divmod(stage, pp)
        return offset if chunk % 2 == 0 else pp - 1 - offset
    raise ValueError(f"unknown stage placement {style!r}; use 'loop' or 'v'")
