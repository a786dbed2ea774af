"""What a tensor-parallel plan says: how each parameter is split, and why each layer is or is not.

Kept apart from the planner (plan.py) so that the code applying a plan (apply.py) and the
checkpoint code depend only on these small records, not on the graph analysis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParamShard:
    """How one parameter is split: along `dim`, each segment sliced contiguously per rank."""

    fqn: str
    dim: int
    segments: tuple[int, ...]
    role: str  # column | row | vocab

    def local_slices(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """(start, length) along `dim` of this rank's pieces, in order."""
        out, offset = [], 0
        for size in self.segments:
            part = size // tp
            out.append((offset + rank * part, part))
            offset += size
        return out


@dataclass
class LayerDecision:
    """One line of the plan: a layer that was split, or stayed replicated and why."""

    node: str
    module: str
    params: list[str]
    role: str  # column | row | vocab-embedding | vocab-head | per-feature | tp-sum | replicated
    detail: str
    reason: str = ""  # for a layer kept whole: why, in a few words (the banner groups by it)


@dataclass
class SequencePlan:
    """Sequence parallelism (--sp) on top of a tp plan: the values that hold 1/tp of the sequence, and the
    places where the sequence is cut (a row layer's sum) or joined again (a column layer's input)."""

    length: int  # the sequence length of the traced model
    tp: int
    values: dict[str, int] = field(default_factory=dict)  # value -> its sequence dim (held as 1/tp of it)
    scatter: set[str] = field(default_factory=set)  # row / vocab-embedding nodes: sum becomes a reduce-scatter
    gathers: dict[str, list[str]] = field(default_factory=dict)  # node -> sequence-split operands it reads whole
    slices: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # node -> (whole operand, its seq dim)
    copies: dict[str, list[str]] = field(default_factory=dict)  # node -> whole operands broadcast over the slice
    edits: dict[str, dict[int, Any]] = field(default_factory=dict)  # reshapes: {arg index: local sizes}
    outputs: set[str] = field(default_factory=set)  # sequence-split values the model returns (gathered there)
    kept: list[str] = field(default_factory=list)  # row layers whose sum stays an all-reduce, and why

    def summary(self) -> str:
        line = (f"sequence parallel: {len(self.scatter)} sums reduce-scattered over the {self.length}-token "
                f"sequence ({self.length // self.tp} per rank), "
                f"{len({v for values in self.gathers.values() for v in values})} values all-gathered")
        return line + (f"; {len(self.kept)} kept as all-reduce" if self.kept else "")


@dataclass
class TensorParallelPlan:
    tp: int
    params: dict[str, ParamShard] = field(default_factory=dict)  # primary FQN -> how it is split
    column: dict[str, int] = field(default_factory=dict)  # node -> index of the input to wrap in copy_to_tp
    row: set[str] = field(default_factory=set)  # nodes whose output is summed over tp ranks
    embeddings: dict[str, int] = field(default_factory=dict)  # node -> global vocabulary size
    arg_edits: dict[str, dict[int, Any]] = field(default_factory=dict)  # node -> {arg index: new value}
    sums: dict[str, int] = field(default_factory=dict)  # node -> divisor: its result summed over tp ranks
    copies: dict[str, list[str]] = field(default_factory=dict)  # node -> whole operands read through copy_to_tp
    vocab_output: bool = False  # the model's logits leave the graph sharded over the vocabulary
    vocab_size: int | None = None
    decisions: list[LayerDecision] = field(default_factory=list)
    replicated_params: list[str] = field(default_factory=list)  # whole on every rank (norms, row biases, ...)
    value_shards: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # node -> (dim, segments)
    linears: int = 0  # linear layers (on parameters) in the model
    sequence: SequencePlan | None = None  # --sp: norms, dropout and residuals on 1/tp of the sequence

    def summary(self) -> str:
        """One line for the run's banner: how much was split, what stayed whole and why."""
        count = {role: sum(1 for d in self.decisions if d.role == role)
                 for role in ("column", "row", "vocab-head", "vocab-embedding", "replicated")}
        split = count["column"] + count["row"] + count["vocab-head"]
        line = (f"tensor parallel: {split} of {self.linears} linears split (column {count['column']}, row "
                f"{count['row']}, vocab {count['vocab-head']})")
        if count["vocab-embedding"]:
            line += f", {count['vocab-embedding']} embedding(s) split over the vocabulary"
        reasons: dict[str, int] = {}
        for d in self.decisions:
            if d.role == "replicated":
                reasons[d.reason or d.detail] = reasons.get(d.reason or d.detail, 0) + 1
        line += f"; {count['replicated']} kept whole"
        if reasons:
            line += ": " + "; ".join(f"{n} x {why}" for why, n in reasons.items())
        return line + (f"; {self.sequence.summary()}" if self.sequence is not None else "")

    def vocab_start(self, rank: int) -> int:
        assert self.vocab_size is not None
        return rank * (self.vocab_size // self.tp)

    def table(self) -> str:
        lines = [f"tensor parallelism: tp={self.tp}, {len(self.params)} parameters split, "
                 f"logits {'sharded over the vocabulary' if self.vocab_output else 'replicated'}",
                 f"{'role':<16} {'module':<44} detail"]
        for d in self.decisions:
            lines.append(f"{d.role:<16} {d.module or d.node:<44} {d.detail}")
        if self.replicated_params:
            shown = ", ".join(self.replicated_params[:6]) + (", ..." if len(self.replicated_params) > 6 else "")
            lines.append(f"whole on every rank: {len(self.replicated_params)} parameters (norms, biases added after "
                         f"the all-reduce, position tables, unsplit layers): {shown}")
        lines.append(self.summary())
        if self.sequence is not None:
            lines.extend(f"{'all-reduce kept':<16} {why}" for why in self.sequence.kept)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"tp": self.tp, "vocab_output": self.vocab_output,
                "params": {k: {"dim": v.dim, "segments": list(v.segments), "role": v.role}
                           for k, v in self.params.items()},
                "layers": [vars(d) for d in self.decisions], "replicated": self.replicated_params,
                "summary": self.summary()}
