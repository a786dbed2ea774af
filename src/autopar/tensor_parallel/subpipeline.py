"""Sub-pipelined tensor parallelism: overlap each tp all-reduce with the next sub-batch's compute.

A tensor-parallel stage waits on one all-reduce per row-parallel layer (two per transformer
layer). Merak's idea: split the micro-batch along the batch dimension into K independent
sub-batches and run them as a software pipeline, so that while the all-reduce of sub-batch
j is in flight the rank computes sub-batch j+1. Rows of a batch never mix in these models,
so the result is K=1's up to rounding (a matmul over fewer rows may block differently:
1e-7 relative on the benchmark's model; identical on the test models).

How it is built (no model changes):

1. the model is traced a second time at the sub-batch shape (B/K rows), which keeps every
   static view size right, and the same stage cut and tensor-parallel rewrite are applied
   to that trace (its own plan: the local view sizes there are for B/K rows);
2. the stage's graph pieces are inlined into one graph, and every `ReduceFromTP` call is
   split into an asynchronous start and a wait placed just before the value's first use;
3. the graph is cut into segments at those reduces (a node's segment = how many reduces
   lie on its longest path from the inputs), and the K copies are emitted segment by
   segment: segment s of copies 0..K-1, then segment s+1 of copies 0..K-1. So the wait
   for copy j's reduce comes after segment s of copies j+1.., which is what hides it;
   segments span attention, MLP and the next layer alike (the whole stage is one graph);
4. batched stage inputs are narrowed into K slices, batched outputs concatenated.

Unlike Merak's hand-written GPT-2 blocks, every copy reads only its own sub-batch's values
(Merak's level-2/3 functions reuse sub-batch 1's residual for sub-batch 2); the tests check
equality with a single process.

Backward overlaps too. The reduce's gradient is the identity; `copy_to_tp`'s gradient is an
all-reduce (f, before every column layer and the vocabulary head). Each f becomes a
`tp_grad_start` (its backward starts the all-reduce and returns the buffer in flight) fed by
a `tp_grad_wait` (identity forward; its backward waits for that buffer). Autograd runs ready
nodes latest-created first, so placement decides the order: f's are also segment cuts, each
start is emitted with copy j's part of the segment that consumes it, each wait with copy j's
part of the segment before. Backward then runs: copy j's consumers, start j, copy j-1's
consumers, start j-1, ..., and only then the segment before, whose first step for copy j is
its wait: every backward all-reduce but the last copy's is in flight during another copy's
backward compute, started in the same order on every rank (the graph fixes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn

from ..dropout import GraphDropout
from ..errors import ConfigError, ModelError
from ..partition.stages import StageModule, StageSpec, _output_nodes, plan_stages, retarget_device
from ..trace import trace
from .apply import CopyToTP, ReduceFromTP, rewrite_graph
from .plan import plan_tensor_parallel

START, WAIT = "tp_reduce_start", "tp_reduce_wait"
GRAD_START, GRAD_WAIT = "tp_grad_start", "tp_grad_wait"


class InflightReduces:
    """All-reduces started but not yet waited on, by the tensor they write into.

    `events`, when a list, records ("start" | "wait", tag) of the backward all-reduces (tests).
    """

    def __init__(self):
        self.handles: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        self.events: list[tuple[str, str]] | None = None

    def start(self, buffer: torch.Tensor, group: dist.ProcessGroup, tag: str | None = None) -> None:
        # keyed by storage address, held with the buffer: autograd may hand the buffer to the
        # wait's backward in another Python wrapper, but the storage is the same
        self.handles[buffer.data_ptr()] = (dist.all_reduce(buffer, group=group, async_op=True), buffer)
        if tag is not None and self.events is not None:
            self.events.append(("start", tag))

    def wait(self, buffer: torch.Tensor, tag: str | None = None) -> None:
        handle = self.handles.pop(buffer.data_ptr(), None)
        if handle is None:
            raise RuntimeError("sub-pipelined tp: waiting on an all-reduce that was never started")
        handle[0].wait()  # bounded by the tp group's timeout
        if tag is not None and self.events is not None:
            self.events.append(("wait", tag))


class _StartReduce(torch.autograd.Function):
    """g's forward, started asynchronously on a copy; its backward is the identity (as g's)."""

    @staticmethod
    def forward(ctx, x, group, inflight):
        buffer = x.contiguous().clone()
        inflight.start(buffer, group)
        return buffer

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class ReduceStart(nn.Module):
    def __init__(self, group: dist.ProcessGroup, inflight: InflightReduces):
        super().__init__()
        self.group, self.inflight = group, inflight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StartReduce.apply(x, self.group, self.inflight)


class ReduceWait(nn.Module):
    """Blocks until the all-reduce writing into x is done; x (same tensor, same autograd node) passes through."""

    def __init__(self, inflight: InflightReduces):
        super().__init__()
        self.inflight = inflight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inflight.wait(x)
        return x


class _StartGradReduce(torch.autograd.Function):
    """f's forward (the identity); its backward starts the gradient all-reduce and returns the buffer in flight."""

    @staticmethod
    def forward(ctx, x, group, inflight, tag):
        ctx.group, ctx.inflight, ctx.tag = group, inflight, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        buffer = grad.contiguous().clone()
        ctx.inflight.start(buffer, ctx.group, ctx.tag)
        return buffer, None, None, None


class _WaitGradReduce(torch.autograd.Function):
    """The identity, placed just before a `_StartGradReduce`; its backward waits for that all-reduce."""

    @staticmethod
    def forward(ctx, x, inflight, tag):
        ctx.inflight, ctx.tag = inflight, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.inflight.wait(grad, ctx.tag)
        return grad, None, None


class GradReduceStart(nn.Module):
    def __init__(self, group: dist.ProcessGroup, inflight: InflightReduces):
        super().__init__()
        self.group, self.inflight = group, inflight

    def forward(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        return _StartGradReduce.apply(x, self.group, self.inflight, tag)


class GradReduceWait(nn.Module):
    def __init__(self, inflight: InflightReduces):
        super().__init__()
        self.inflight = inflight

    def forward(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        return _WaitGradReduce.apply(x, self.inflight, tag)


@dataclass
class _Inlined:
    graph: fx.Graph
    root: nn.Module
    params: list[str]
    buffers: list[str]
    num_inputs: int


def inline_pieces(pieces: list[fx.GraphModule], piece_specs: list) -> _Inlined:
    """One graph for a chain of pieces: (params..., buffers..., stage inputs...) -> last piece's outputs."""
    params = list(dict.fromkeys(f for spec in piece_specs for f in spec.params))
    buffers = list(dict.fromkeys(f for spec in piece_specs for f in spec.buffers))
    new, root = fx.Graph(), nn.Module()
    state = {fqn: new.placeholder("s_" + fqn.replace(".", "_")) for fqn in [*params, *buffers]}
    values = [new.placeholder(name) for name in piece_specs[0].inputs]
    num_inputs = len(values)
    for piece, spec in zip(pieces, piece_specs):
        holders = [n for n in piece.graph.nodes if n.op == "placeholder"]
        fqns = [*spec.params, *spec.buffers]
        env = {h: state[f] for h, f in zip(holders, fqns)}
        env.update(zip(holders[len(fqns):], values))
        for name, child in piece.named_children():
            if not hasattr(root, name):
                root.add_module(name, child)
        output = None
        for node in piece.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                output = node.args[0]
                continue
            env[node] = new.node_copy(node, lambda a: env[a])
        values = [env[a] if isinstance(a, fx.Node) else a for a in output]
    new.output(tuple(values))
    return _Inlined(new, root, params, buffers, num_inputs)


def interleave(inlined: _Inlined, *, k: int, input_dims: list[int | None], output_dims: list[int | None],
               group: dist.ProcessGroup) -> fx.GraphModule:
    """K copies of the inlined sub-batch graph as a software pipeline (module docstring, steps 2-4)."""
    graph, root = inlined.graph, inlined.root
    inflight = InflightReduces()
    root.add_module(START, ReduceStart(group, inflight))
    root.add_module(WAIT, ReduceWait(inflight))
    nodes = list(graph.nodes)
    reduces = {n for n in nodes if n.op == "call_module" and isinstance(root.get_submodule(n.target), ReduceFromTP)}
    copies_to_tp = {n for n in nodes if n.op == "call_module" and isinstance(root.get_submodule(n.target), CopyToTP)}
    root.add_module(GRAD_START, GradReduceStart(group, inflight))
    root.add_module(GRAD_WAIT, GradReduceWait(inflight))
    holders = [n for n in nodes if n.op == "placeholder"]
    compute = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")]
    output = next(n for n in nodes if n.op == "output")
    segment: dict[fx.Node, int] = {}  # a value after a reduce or an f starts the next segment
    for n in compute:
        segment[n] = max((segment.get(a, 0) + (a in reduces or a in copies_to_tp) for a in n.all_input_nodes),
                         default=0)

    new = fx.Graph()
    shared = {h: new.placeholder(h.name) for h in holders}
    shared.update({n: new.get_attr(n.target) for n in nodes if n.op == "get_attr"})
    copies: list[dict[fx.Node, fx.Node]] = [{} for _ in range(k)]
    state_count = len(inlined.params) + len(inlined.buffers)
    for index, dim in enumerate(input_dims):
        if dim is None:
            continue
        holder = holders[state_count + index]
        size = holder.meta.get("sub_size")
        for j in range(k):
            piece = new.call_function(torch.narrow, (shared[holder], dim, j * size, size))
            copies[j][holder] = new.call_method("contiguous", (piece,)) if dim else piece
    waited: list[dict[fx.Node, fx.Node]] = [{} for _ in range(k)]

    def lookup(j: int, node: fx.Node) -> fx.Node:
        if node in reduces:
            if node not in waited[j]:  # first use of copy j's reduced value: wait here
                waited[j][node] = new.create_node("call_module", WAIT, (copies[j][node],),
                                                  name=f"{WAIT}_{node.name}_sub{j}")
                waited[j][node].meta["subbatch"] = j
            return waited[j][node]
        return copies[j][node] if node in copies[j] else shared[node]

    waiting: list[dict[fx.Node, fx.Node]] = [{} for _ in range(k)]  # f -> its wait, emitted, start not yet
    for s in range(max(segment.values(), default=0) + 1):
        for j in range(k):
            for f, wait in list(waiting[j].items()):  # f's start opens copy j's part of its consumers' segment
                copies[j][f] = new.create_node("call_module", GRAD_START, (wait, f"{f.name}_sub{j}"),
                                               name=f"{GRAD_START}_{f.name}_sub{j}")
                copies[j][f].meta["subbatch"] = j
                del waiting[j][f]
            for n in compute:
                if segment[n] != s:
                    continue
                if n in copies_to_tp:  # its wait closes copy j's part of this segment
                    made = new.create_node("call_module", GRAD_WAIT, (lookup(j, n.args[0]), f"{n.name}_sub{j}"),
                                           name=f"{GRAD_WAIT}_{n.name}_sub{j}")
                    made.meta["subbatch"] = j
                    waiting[j][n] = made
                    continue
                if n in reduces:
                    made = new.create_node("call_module", START, (lookup(j, n.args[0]),),
                                           name=f"{START}_{n.name}_sub{j}")
                else:
                    made = new.node_copy(n, lambda a: lookup(j, a))
                    if made.op == "call_module" and isinstance(root.get_submodule(made.target), GraphDropout):
                        made.kwargs = {**made.kwargs, "subbatch": j}  # copy j's rows of the samples
                made.meta["subbatch"] = j
                copies[j][n] = made
    results = []
    for value, dim in zip(output.args[0], output_dims):
        if not isinstance(value, fx.Node):
            results.append(value)
        elif dim is None:
            results.append(lookup(0, value))
        else:
            results.append(new.call_function(torch.cat, ([lookup(j, value) for j in range(k)], dim)))
    new.output(tuple(results))
    new.lint()
    return fx.GraphModule(root, new)


def batch_dim(full: tuple[int, ...] | None, sub: tuple[int, ...] | None, k: int, what: str) -> int | None:
    """The dimension that holds the batch (full = K x sub there, equal elsewhere), or None if unbatched."""
    if full is None or sub is None or tuple(full) == tuple(sub):
        return None
    differing = [d for d, (f, s) in enumerate(zip(full, sub)) if f != s] if len(full) == len(sub) else []
    if len(differing) != 1 or full[differing[0]] != k * sub[differing[0]]:
        raise ModelError(f"cannot split {what} into {k} sub-batches: its shape is {list(full)} for the micro-batch "
                         f"but {list(sub)} for a sub-batch; --tp-subbatches needs every batch-carrying value to "
                         f"scale along one dimension (use --tp-subbatches 1)")
    return differing[0]


def _output_shapes(stage: nn.Module, graph, flat_outputs) -> list[tuple[int, ...] | None]:
    """Traced shape of each position of a stage's flat output (None for non-tensor leaves).

    Read from the traced graph by the names the stage sends (the last stage: the model's
    outputs), since rewritten pieces hold nodes the trace never had.
    """
    by_name = {n.name: n for n in graph.graph.nodes}
    names = iter([n.name for n in _output_nodes(graph.graph)] if stage.is_last else stage.spec.outputs)
    shapes = []
    for value in flat_outputs:
        node = by_name[next(names)] if isinstance(value, fx.Node) else None
        val = node.meta.get("val") if node is not None else None
        shapes.append(tuple(val.shape) if isinstance(val, torch.Tensor) else None)
    return shapes


def sub_pipeline_stage(stage: nn.Module, sub_stage: nn.Module, sub_plan, group: dist.ProcessGroup, k: int,
                       device: torch.device, *, full_graph, sub_graph) -> fx.GraphModule:
    """Replace a tensor-parallel stage's pieces by one interleaved graph built from `sub_stage`.

    `stage` is the materialised, parallelised StageModule (its parameters stay where they
    are); `sub_stage` is the same stage built on meta from the sub-batch trace.
    """

    pieces = list(sub_stage._pieces)
    for piece in pieces:
        rewrite_graph(piece, sub_plan, group)
    inlined = inline_pieces(pieces, sub_stage.piece_specs)
    input_dims = [batch_dim(f, s, k, f"stage input {name}")
                  for name, f, s in zip(stage.spec.inputs, stage.input_shapes, sub_stage.input_shapes)]
    holders = [n for n in inlined.graph.nodes if n.op == "placeholder"][len(inlined.params) + len(inlined.buffers):]
    for holder, dim, sub in zip(holders, input_dims, sub_stage.input_shapes):
        if dim is not None:
            holder.meta["sub_size"] = sub[dim]
    sub_out = next(n for n in pieces[-1].graph.nodes if n.op == "output").args[0]
    full_shapes = _output_shapes(stage, full_graph, sub_out)
    sub_shapes = _output_shapes(sub_stage, sub_graph, sub_out)
    output_dims = [batch_dim(f, s, k, f"stage output {i}") for i, (f, s) in enumerate(zip(full_shapes, sub_shapes))]
    module = interleave(inlined, k=k, input_dims=input_dims, output_dims=output_dims, group=group)
    retarget_device(module, device)
    spec = stage.spec
    stage._pieces = nn.ModuleList([module])
    stage.piece_specs = [StageSpec(index=spec.index, blocks=spec.blocks, nodes=[], inputs=spec.inputs,
                                   outputs=spec.outputs, params=inlined.params, buffers=inlined.buffers,
                                   block_range=spec.block_range)]
    return module


def sub_batch_inputs(args: tuple, kwargs: dict, k: int) -> tuple[tuple, dict]:
    """The model's traced inputs at B/K rows: every input with the main input's B rows is cut
    to B/K (masks, token types, decoder ids split the same way); one that broadcasts over the
    batch (position_ids of 1 row) is kept whole."""
    rows = args[0].shape[0]
    if rows % k:
        raise ConfigError(f"strategy.tp_subbatches={k} does not divide the micro-batch size {rows}")

    def cut(value: torch.Tensor) -> torch.Tensor:
        if value.dim() == 0 or value.shape[0] != rows:
            return value
        return torch.zeros((rows // k, *value.shape[1:]), dtype=value.dtype, device="meta")

    return tuple(cut(a) for a in args), {name: cut(v) for name, v in kwargs.items()}


def sub_pipeline_stages(stages: dict[int, nn.Module], model: nn.Module, partition, k: int,
                        group: dist.ProcessGroup, device: torch.device) -> None:
    """Trace the model at B/K rows and turn each of this rank's tensor-parallel stages into K interleaved copies."""

    full = partition.graph
    args, kwargs = sub_batch_inputs(full.example_args, full.example_kwargs, k)
    graph = trace(model, args, kwargs)
    if len(graph.blocks) != len(full.blocks):
        raise ModelError(f"the model traced at {args[0].shape[0]} rows has {len(graph.blocks)} blocks but "
                         f"{len(full.blocks)} at {full.example_args[0].shape[0]}; use --tp-subbatches 1")
    specs = plan_stages(graph, partition.bounds)
    sub_plan = plan_tensor_parallel(graph, dist.get_world_size(group))
    for index, stage in stages.items():
        sub_stage = StageModule(graph, specs[index], partition.num_stages)
        sub_pipeline_stage(stage, sub_stage, sub_plan, group, k, device, full_graph=partition.graph,
                           sub_graph=graph)
