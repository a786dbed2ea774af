"""Apply a tensor-parallel plan to pipeline stages: rewrite their graphs and shard their weights.

The stage graphs are pieces of one exported graph and keep its node names, so the plan
(computed once on the whole graph, plan.py) is applied to each piece by name:

- a column layer's input goes through `copy_to_tp` (identity forward, gradient all-reduce);
- a row layer computes its partial product without bias, all-reduces it (`reduce_from_tp`)
  and adds the bias once;
- a token-embedding lookup becomes a vocabulary-parallel lookup (out-of-range ids give 0,
  then an all-reduce);
- static view / expand / split sizes inside the sharded region are replaced by their local
  sizes (the head count becomes heads / tp);
- with sequence parallelism (plan.sequence, sequence.py) the row layers' and embeddings' sums
  become reduce-scatters over the sequence, and the split values are all-gathered where a
  column layer (or an operation not followed) reads them.

Weights are first materialised whole (from the seed, as one process would), then each rank
keeps its slices: the result is bit-identical to slicing the single-process model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx, nn

from typing import Any

from .._torch_internals import parameter_table
from ..dropout import GraphDropout, shard_dropout
from ..models.output import logits_of
from .layers import (copy_to_tp, gather_seq, linear_keeping_slice, reduce_from_tp, reduce_scatter_seq,
                     vocab_parallel_cross_entropy)
from .layout import SequencePlan
from .plan import ParamShard, TensorParallelPlan

aten = torch.ops.aten


class CopyToTP(nn.Module):
    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(x, self.group)


class ReduceFromTP(nn.Module):
    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(x, self.group)


class ReduceScatterSeq(nn.Module):
    def __init__(self, dim: int, group: dist.ProcessGroup):
        super().__init__()
        self.dim, self.group = dim, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_seq(x, self.dim, self.group)


class GatherSeq(nn.Module):
    """The whole sequence of a split value; `partial`: its reader is split over tp (gradients summed)."""

    def __init__(self, dim: int, group: dist.ProcessGroup, partial: bool):
        super().__init__()
        self.dim, self.group, self.partial = dim, group, partial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_seq(x, self.dim, self.group, partial=self.partial)


class ColumnKeepingSlice(nn.Module):
    """A column layer on a gathered sequence that keeps only this rank's slice of it for backward."""

    def __init__(self, dim: int, group: dist.ProcessGroup):
        super().__init__()
        self.dim, self.group = dim, group

    def forward(self, x_full, x_local, weight, bias=None):
        return linear_keeping_slice(x_full, x_local, weight, bias, self.dim, self.group)


class SliceSeq(nn.Module):
    """This rank's positions of a whole value read by sequence-split ranks (its gradient summed over tp)."""

    def __init__(self, dim: int, group: dist.ProcessGroup):
        super().__init__()
        self.dim, self.group = dim, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = x.shape[self.dim] // dist.get_world_size(self.group)
        return copy_to_tp(x, self.group).narrow(self.dim, dist.get_rank(self.group) * part, part)


class VocabLookup(nn.Module):
    """embedding(weight_shard, ids) for a vocabulary split in contiguous ranges, summed over ranks.

    `padding_idx` (the whole vocabulary's, -1 for none): the row `nn.Embedding(padding_idx=...)` never
    gives a gradient, kept so on the rank that holds it (a scored pad position must not move it)."""

    def __init__(self, start: int, part: int, group: dist.ProcessGroup, padding_idx: int = -1,
                 scatter_dim: int | None = None):
        super().__init__()
        self.start, self.part, self.group, self.scatter_dim = start, part, group, scatter_dim
        self.local_padding = padding_idx - start if start <= padding_idx < start + part else None

    def forward(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.part)
        local = (ids - self.start).masked_fill(outside, 0)
        out = torch.nn.functional.embedding(local, weight, padding_idx=self.local_padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.scatter_dim is not None:  # sequence parallelism: each rank keeps its positions of the sum
            return reduce_scatter_seq(out, self.scatter_dim, self.group)
        return reduce_from_tp(out, self.group)


def rewrite_graph(module: fx.GraphModule, plan: TensorParallelPlan, group: dist.ProcessGroup, *,
                  model_output: bool = False) -> int:
    """Apply the plan to one graph piece in place; returns how many nodes it changed.
    `model_output`: this piece returns the model's outputs (sequence-split ones are gathered there)."""
    graph = module.graph
    rank = dist.get_rank(group)
    seq = plan.sequence
    changed = _rewrite_sequence_reads(module, plan, seq, group, model_output) if seq is not None else 0
    copies: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        edits = plan.arg_edits.get(node.name)
        if edits:
            args = list(node.args)
            for index, value in edits.items():
                args[index] = value
            node.args = tuple(args)
            changed += 1
        for operand in plan.copies.get(node.name, ()):  # a whole value met by shards: its gradient summed
            if seq is not None and operand in seq.gathers.get(node.name, ()):
                continue  # read through a sequence gather, whose backward sums already
            source = next(a for a in node.all_input_nodes if _traced_name(module, a) == operand)
            if source not in copies:
                name = _add(module, f"tp_copy_{source.name}", CopyToTP(group))
                with graph.inserting_before(node):  # (a parameter's node may sit among the placeholders)
                    copies[source] = graph.call_module(name, (source,))
            node.replace_input_with(source, copies[source])
            changed += 1
        if node.name in plan.sums:  # a sum or mean over the split features: add the ranks' parts
            name = _add(module, f"tp_sum_{node.name}", ReduceFromTP(group))
            with graph.inserting_after(node):
                summed = graph.call_module(name, (node,))
            result = summed
            if plan.sums[node.name] > 1:
                with graph.inserting_after(summed):
                    result = graph.call_function(aten.div.Tensor, (summed, plan.sums[node.name]))
            node.replace_all_uses_with(result, delete_user_cb=lambda user: user is not summed)
            changed += 1
        if node.name in plan.column:
            index = plan.column[node.name]
            source = node.args[index]
            if _is_partial_gather(module, source):  # sequence parallel: the gather's backward sums already
                copies[source] = source
            elif source not in copies:  # one copy per value, placed before its first column reader
                name = _add(module, f"tp_copy_{source.name}", CopyToTP(group))
                with graph.inserting_before(node):
                    copies[source] = graph.call_module(name, (source,))
            args = list(node.args)
            args[index] = copies[source]
            node.args = tuple(args)
            changed += 1
        if node.name in plan.row:
            if node.target is aten.addmm.default:
                bias, x, weight = node.args
                node.target, node.args = aten.mm.default, (x, weight)
            else:
                x, weight, *rest = node.args
                bias = rest[0] if rest else None
                node.args = (x, weight)
            scatter = seq is not None and node.name in seq.scatter
            name = _add(module, f"tp_reduce_{node.name}",
                        ReduceScatterSeq(seq.values[node.name], group) if scatter else ReduceFromTP(group))
            with graph.inserting_after(node):
                reduced = graph.call_module(name, (node,))
            result, anchor = reduced, reduced
            if bias is not None and scatter:  # added on this rank's positions: its gradient summed over tp
                name = _add(module, f"tp_copy_{bias.name}_{node.name}", CopyToTP(group))
                with graph.inserting_after(reduced):
                    bias = anchor = graph.call_module(name, (bias,))
            if bias is not None:
                with graph.inserting_after(anchor):
                    result = graph.call_function(aten.add.Tensor, (reduced, bias))
            node.replace_all_uses_with(result, delete_user_cb=lambda user: user is not reduced)
            changed += 1
        if node.name in plan.embeddings:
            part = plan.embeddings[node.name] // plan.tp
            weight, ids = node.args[:2]
            padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
            scatter_dim = seq.values[node.name] if seq is not None and node.name in seq.scatter else None
            name = _add(module, f"tp_vocab_{node.name}", VocabLookup(rank * part, part, group, padding_idx,
                                                                     scatter_dim))
            with graph.inserting_after(node):
                lookup = graph.call_module(name, (weight, ids))
            node.replace_all_uses_with(lookup)
            graph.erase_node(node)
            changed += 1
    if seq is not None:
        changed += _columns_keep_slices(module, plan, group)
    split = dict(plan.value_shards)
    if seq is not None:  # dropout on positions: each rank draws its slice of the sequence's mask
        split.update({name: (dim, (seq.length,)) for name, dim in seq.values.items()})
    shard_dropout(module, split, rank, plan.tp)
    graph.lint()
    module.recompile()
    return changed


def _traced_name(module: nn.Module, value: fx.Node) -> str:
    """The name the plan knows a value by: a random node replaced by a module of the stage keeps its source's."""
    child = getattr(module, value.target, None) if value.op == "call_module" else None
    return child.source if isinstance(child, GraphDropout) else value.name


def _is_partial_gather(module: nn.Module, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(getattr(module, node.target, None), GatherSeq) \
        and getattr(module, node.target).partial


def _columns_keep_slices(module: fx.GraphModule, plan: TensorParallelPlan, group: dist.ProcessGroup) -> int:
    """Column layers reading a gathered sequence save its slice, not the whole (activation memory / tp)."""
    graph, changed = module.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.name not in plan.column or node.target is not aten.linear.default:
            continue
        gathered = node.args[0]
        if not _is_partial_gather(module, gathered):
            continue
        gather = getattr(module, gathered.target)
        name = _add(module, f"sp_column_{node.name}", ColumnKeepingSlice(gather.dim, group))
        with graph.inserting_before(node):
            replacement = graph.call_module(name, (gathered, gathered.args[0], *node.args[1:]))
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        changed += 1
    return changed


def _rewrite_sequence_reads(module: fx.GraphModule, plan: TensorParallelPlan, seq: SequencePlan,
                            group: dist.ProcessGroup, model_output: bool) -> int:
    """Sequence parallelism's reads, before the tp rewrite: whole values sliced, split values gathered.

    A gather read by a column layer, or in place of a tp copy (a whole value met by feature shards),
    is `partial`: the ranks' gradients are summed by its reduce-scatter, and the tp rewrite then
    puts no copy_to_tp of its own there."""
    graph, changed = module.graph, 0
    made: dict[tuple, fx.Node] = {}
    traced_name = lambda value: _traced_name(module, value)  # noqa: E731

    def read(node: fx.Node, source: fx.Node, key: tuple, make) -> None:
        if (key, source) not in made:
            name = _add(module, f"sp_{key[0]}_{source.name}" + "".join(f"_{k}" for k in key[1:]), make())
            with graph.inserting_before(node):
                made[(key, source)] = graph.call_module(name, (source,))
        node.replace_input_with(source, made[(key, source)])

    for node in list(graph.nodes):
        if node.op == "output" and model_output:
            for source in [a for a in node.all_input_nodes if traced_name(a) in seq.outputs]:
                read(node, source, ("gather", "out"),
                     lambda s=source: GatherSeq(seq.values[traced_name(s)], group, False))
                changed += 1
        if node.op != "call_function":
            continue
        if node.name in seq.edits:
            args = list(node.args)
            for index, value in seq.edits[node.name].items():
                args[index] = value
            node.args = tuple(args)
            changed += 1
        inputs = {traced_name(a): a for a in node.all_input_nodes}
        for operand in seq.gathers.get(node.name, ()):
            partial = node.name in plan.column or operand in plan.copies.get(node.name, ())
            dim = seq.values[operand]
            read(node, inputs[operand], ("gather", "partial" if partial else "whole"),
                 lambda d=dim, p=partial: GatherSeq(d, group, p))
            changed += 1
        for operand, dim in seq.slices.get(node.name, ()):
            read(node, inputs[operand], ("slice", dim), lambda d=dim: SliceSeq(d, group))
            changed += 1
        for operand in seq.copies.get(node.name, ()):
            read(node, inputs[operand], ("copy",), lambda: CopyToTP(group))
            changed += 1
    return changed


def _add(module: nn.Module, name: str, child: nn.Module) -> str:
    module.add_module(name, child)
    return name


def shard_tensor(full: torch.Tensor, shard: ParamShard, rank: int, tp: int) -> torch.Tensor:
    """This rank's slices of a whole tensor (for each segment, its contiguous part), concatenated, in storage of
    their own: a view would keep the whole tensor's storage alive beside the shard (tp times the memory)."""
    pieces = [full.narrow(shard.dim, start, length) for start, length in shard.local_slices(rank, tp)]
    if len(pieces) > 1:
        return torch.cat(pieces, dim=shard.dim)
    return pieces[0].clone(memory_format=torch.contiguous_format)


def gather_tensor(local: torch.Tensor, shard: ParamShard, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor from every rank's slices (collective over the tp group)."""
    tp = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    pieces = []
    for k, size in enumerate(shard.segments):
        part = size // tp
        offset = sum(s // tp for s in shard.segments[:k])
        pieces.extend(p.narrow(shard.dim, offset, part) for p in parts)
    return torch.cat(pieces, dim=shard.dim)


def shard_parameters(module: nn.Module, plan: TensorParallelPlan, group: dist.ProcessGroup) -> None:
    """Replace each planned parameter of `module` (already materialised whole) by this rank's slices."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    for fqn, shard in plan.params.items():
        try:
            param = module.get_parameter(fqn)
        except AttributeError:
            continue  # another stage's parameter
        owner_path, _, leaf = fqn.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        local = shard_tensor(param.detach(), shard, rank, tp)
        parameter_table(owner)[leaf] = nn.Parameter(local, requires_grad=param.requires_grad)


def parallelize_stage(stage: nn.Module, plan: TensorParallelPlan, group: dist.ProcessGroup) -> None:
    """Shard a materialised StageModule's weights and rewrite its graph pieces for tensor parallelism."""
    shard_parameters(stage, plan, group)
    outputs = stage.pieces[-1] if getattr(stage, "is_last", False) else None  # returns the model's outputs
    for piece in stage.modules():
        if isinstance(piece, fx.GraphModule):
            rewrite_graph(piece, plan, group, model_output=piece is outputs)
    if plan.sequence is not None and hasattr(stage, "input_shapes"):  # split values arrive as their slices
        seq = plan.sequence
        stage.input_shapes = [tuple(size // seq.tp if name in seq.values and d == seq.values[name] else size
                                    for d, size in enumerate(shape))
                              for name, shape in zip(stage.spec.inputs, stage.input_shapes)]


def vocab_parallel_loss_sum(logits: torch.Tensor, labels: torch.Tensor, *, plan: TensorParallelPlan,
                            group: dist.ProcessGroup, ignore_index: int) -> torch.Tensor:
    """Sum of token cross-entropies from logits sharded over the vocabulary (never gathered)."""
    start = plan.vocab_start(dist.get_rank(group))
    losses = vocab_parallel_cross_entropy(logits.flatten(0, -2), labels.flatten(), vocab_start=start, group=group,
                                          ignore_index=ignore_index)
    return losses.sum()


class _GatherVocab(torch.autograd.Function):
    """All-gather logits along the vocabulary for a custom loss; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group, ctx.part = group, local.shape[-1]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad.narrow(-1, rank * ctx.part, ctx.part).contiguous(), None


def gather_vocab(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherVocab.apply(local, group)


class TensorParallel:
    """What an engine needs to run tensor-parallel stages: the plan, the tp group, and conversions.

    Checkpoints hold whole tensors (gathered on save, sliced on load), so a checkpoint written
    under one (dp, tp, pp) resumes under any other; the price is one all-gather per sharded
    tensor at save time.
    """

    def __init__(self, plan: TensorParallelPlan, group: dist.ProcessGroup):
        self.plan, self.group = plan, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def parallelize(self, stage: nn.Module) -> None:
        parallelize_stage(stage, self.plan, self.group)

    def is_sharded(self, fqn: str) -> bool:
        return fqn in self.plan.params

    def file_slices(self, fqn: str) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, [(start, stop), ...]) of the whole tensor `fqn` this rank holds, None when whole: what a
        pretrained load reads from the file (models/pretrained.py's SliceFn)."""
        if fqn not in self.plan.params:
            return None
        shard = self.plan.params[fqn]
        return shard.dim, list(shard.local_slices(self.rank, self.size))

    def loss_sum(self, output: Any, batch: dict, ignore_index: int) -> torch.Tensor:
        logits = logits_of(output)
        if not self.plan.vocab_output:
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), batch["labels"].flatten(),
                                                     ignore_index=ignore_index, reduction="sum")
        return vocab_parallel_loss_sum(logits, batch["labels"], plan=self.plan, group=self.group,
                                       ignore_index=ignore_index)

    def full_output(self, output: Any) -> Any:
        """The model output with whole logits (for a custom loss function): gathered, differentiably."""
        if not self.plan.vocab_output:
            return output
        full = gather_vocab(logits_of(output), self.group)
        if isinstance(output, torch.Tensor):
            return full
        if hasattr(output, "logits"):
            output.logits = full
            return output
        return type(output)([full, *output[1:]])

    def gather(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        return gather_tensor(local, self.plan.params[fqn], self.group) if fqn in self.plan.params else local

    def shard(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        return shard_tensor(full, self.plan.params[fqn], self.rank, self.size) if fqn in self.plan.params else full

    def full_shape(self, fqn: str, local: torch.Tensor) -> tuple[int, ...]:
        shape = list(local.shape)
        if fqn in self.plan.params:
            shard = self.plan.params[fqn]
            shape[shard.dim] = sum(shard.segments)
        return tuple(shape)
