"""A model's costs per block, read once from its traced graph, so that scoring a strategy is arithmetic.

The search scores thousands of strategies; tracing or planning per strategy would take
minutes. So the model is traced ONCE (on meta, micro-batch 1) and reduced to per-block
numbers per sequence: forward FLOPs, activation bytes, parameter elements, the bytes that
cross each possible cut; and, per tensor-parallel degree the TP planner accepts, the FLOPs
and parameters left on one rank and the bytes each rank all-reduces. Costs of a micro-batch
of b sequences are b times these (true for these models: no op mixes sequences).

Approximations, stated: saved activations are the sum of every op's output (an upper bound
on what autograd keeps; measure_profile.py replaces them, and the FLOP-rate times, with
measured ones on this machine); under
tensor parallelism the FLOPs of ops that read a split weight, and attention in a block that
has split layers, are divided by tp, and a block's activation bytes are each op's output / tp where the
TP plan shards that value, whole elsewhere (norms, residuals, a row layer's summed output); backward
all-reduces as many bytes as forward.

`with_layers(n)` scales a profile traced with few repeated layers to n identical layers,
so a 20B-parameter model is profiled from a 2-layer trace in seconds.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch

from ..errors import AutoparError
from ..partition.plan import crossings
from ..trace import ModelGraph, trace

ATTENTION_OPS = ("scaled_dot_product_attention", "aten.bmm", "aten.matmul", "_flash_attention", "_efficient_attention")


@dataclass(frozen=True)
class Crossing:
    """What crosses one cut between stages, in bytes: `per_seq` grows with the micro-batch, `fixed` does not
    (a rotary cos/sin table, position ids: computed from the sequence alone); the gradients sent back, for the
    floating-point tensors only (the runtime sends none for token ids or a boolean mask, pipeline/runtime.py)."""

    per_seq: float
    fixed: float = 0.0
    grad_per_seq: float = 0.0
    grad_fixed: float = 0.0

    def at(self, micro_batch: float) -> float:
        return self.per_seq * micro_batch + self.fixed

    def grad_at(self, micro_batch: float) -> float:
        return self.grad_per_seq * micro_batch + self.grad_fixed


@dataclass(frozen=True)
class TPProfile:
    """Per-block costs on one rank of a tensor-parallel group of `tp` ranks (per sequence)."""

    tp: int
    flops: tuple[float, ...]  # forward FLOPs on one rank
    params: tuple[int, ...]  # parameter elements on one rank
    saved_bytes: tuple[float, ...]
    allreduce_bytes: tuple[float, ...]  # forward all-reduce payload per rank (backward: the same again)
    allreduce_count: tuple[int, ...]  # forward all-reduces per block (each pays the latency)
    largest_params: tuple[int, ...] = ()
    """Per block, the elements of its largest parameter tensor on one rank: clipping's float64 copy of one gradient
    at a time is this large (memory.update_bytes). Empty: unknown (that term priced as nothing)."""


@dataclass(frozen=True)
class ExpertCosts:
    """Per block, what expert parallelism changes (per sequence where it grows with the batch)."""

    num_experts: int  # the fewest experts of any layer: ep must divide it
    top_k: int
    params: tuple[int, ...]  # the experts' parameter elements (the rows ep shards)
    flops: tuple[float, ...]  # forward FLOPs of the experts: 2 x tokens x top_k x one expert's parameters
    dispatch_bytes: tuple[float, ...]  # bytes one all-to-all moves per sequence: tokens x top_k x hidden x 4


@dataclass(frozen=True)
class AttentionCosts:
    """Per block, what context parallelism exchanges (per sequence), and the head count all-to-all divides."""

    heads: int  # the fewest query heads of any attention (the shape the ring's work is measured at)
    kv_heads: int
    layers: tuple[int, ...]  # attentions per block
    kv_bytes: tuple[float, ...]  # keys and values per sequence
    qkv_out_bytes: tuple[float, ...]  # queries, keys, values (repeated to the query heads) and output per sequence
    flops: tuple[float, ...]  # forward FLOPs of the attentions per sequence
    head_dim: int = 0  # of the first attention (the shape the ring's work is measured at); 0: unknown
    causal: bool = True  # the first attention's call says is_causal or passes a mask (an LM's); False: full
    masked: bool = False  # the model passes a mask tensor (so its own kernel is the masked one)
    head_counts: tuple[int, ...] = ()  # every attention's query heads (all-to-all: context_parallel.swaps_heads)
    ring_seconds: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)
    """Per cp degree, measured on this machine (search/ring_cost.py): the seconds one attention changes by when
    the model's kernel over the whole sequence becomes one rank's ring over T/cp tokens, as (forward fixed,
    forward per sequence, backward fixed, backward per sequence) on top of the block's T/cp share. Empty: not
    measured (the ring priced as 1/cp of the kernel, which the written-out ring runs several times slower)."""
    all_to_all_seconds: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)
    """The same for all-to-all attention's own work: its swaps' buffers and reorders around the kernel over T with
    H/cp heads (the exchange itself priced apart, from the calibrated all-to-all). Empty: not measured."""


@dataclass(frozen=True)
class ModelProfile:
    """Per-block costs per sequence of `seq_len` tokens; block 0 the prelude, the last the postlude."""

    name: str
    seq_len: int
    block_names: tuple[str, ...]
    flops: tuple[float, ...]  # forward FLOPs per sequence (tp = 1)
    saved_bytes: tuple[float, ...]  # fp32 activation bytes per sequence
    params: tuple[int, ...]  # parameter elements (a weight used by several blocks counted where first used)
    boundary_bytes: tuple[float, ...]  # [c]: bytes crossing a cut after block c, per sequence
    shared_params: int  # elements of weights read by more than one block (tied embedding/head)
    shared_blocks: tuple[int, int] = (0, 0)  # first and last block reading a shared weight
    tp: dict[int, TPProfile] = field(default_factory=dict)
    tp_refused: dict[int, str] = field(default_factory=dict)  # degree -> why the planner refused it
    weight_flops: tuple[float, ...] = ()
    """Forward FLOPs per sequence of the ops that read a parameter (tp = 1): their backward's weight half is
    what a zero-bubble schedule's W computes (the same FLOPs again); empty: unknown (W priced as half of B)."""
    weight_out_bytes: tuple[float, ...] = ()
    """Output bytes per sequence of the ops that read a parameter: the gradients a zero-bubble I keeps for W."""
    ops: tuple[int, ...] = ()
    """Traced ops per block: each pays a dispatch cost however little it computes, which a tensor-parallel split
    does not shrink (cost.StepModel.fixed_shares); empty: unknown."""
    crossings: tuple[Crossing, ...] = ()
    """[c]: what crosses a cut after block c, split as the memory model needs it (Crossing); empty: every byte of
    boundary_bytes per sequence, its gradient as large."""
    measured: tuple | None = None
    """Per block, measured on this machine (measure_profile.BlockCosts): times and bytes that replace the
    FLOP-rate estimate and the traced activation bytes. None: estimate from FLOPs."""
    experts: ExpertCosts | None = None
    """The mixture-of-experts layers experts/detect.py recognises (what --ep shards); None: none."""
    attention: AttentionCosts | None = None
    """The scaled-dot-product attentions (what --cp splits); None: none traced."""
    exchange: tuple[tuple[float, float, float, float], ...] = ()
    """Per block, seconds of collectives outside tensor parallelism each pass waits for (expert all-to-alls,
    context parallelism's attention exchange): (forward fixed, forward per sequence, backward fixed, backward
    per sequence); set by search/dimensions.py on the profile it prices a layout with. Empty: none."""
    exchange_waits: tuple[tuple[int, int], ...] = ()
    """Per block, the waits of ring attention's exchange per micro-batch (forward, backward): on time-shared cores
    each idles them until the neighbour it waits on has run (cost.py, Cluster.wait_idle_s of 2 ranks); set by
    search/dimensions.py. Empty: none (an all-to-all's calibrated wall time already holds its wait)."""
    coupled_groups: int = 1
    """How many tensor-parallel groups one layer couples (context parallelism: cp of them, each waiting on the
    others' exchange): a TP all-reduce then idles time-shared cores until tp x coupled_groups ranks have run."""

    def exchange_seconds(self, micro_batch: int) -> tuple[list[float], list[float]]:
        """Forward and backward exchange seconds per block at `micro_batch` sequences."""
        if not self.exchange:
            return [0.0] * self.num_blocks, [0.0] * self.num_blocks
        return ([ff + fs * micro_batch for ff, fs, _, _ in self.exchange],
                [bf + bs * micro_batch for _, _, bf, bs in self.exchange])

    @property
    def num_blocks(self) -> int:
        return len(self.flops)

    @property
    def num_params(self) -> int:
        return sum(self.params)

    def at_tp(self, tp: int) -> TPProfile:
        if tp in self.tp:
            return self.tp[tp]
        raise AutoparError(f"tp={tp} was not profiled for {self.name}: "
                           f"{self.tp_refused.get(tp, 'not among the degrees asked for')}")

    def with_layers(self, n: int) -> ModelProfile:
        """The same model with `n` repeated layers, each a copy of the first traced one."""
        if self.num_blocks < 3:
            raise AutoparError(f"{self.name} has no repeated layer to replicate")

        def grow(values: tuple, keep_last: int = 1) -> tuple:
            return tuple(values[:1]) + tuple(values[1:2]) * n + tuple(values[len(values) - keep_last:])

        cuts = self.boundary_bytes  # cuts: after prelude, between layers, after the last layer
        new_cuts = (cuts[0],) + (cuts[1],) * (n - 1) + (cuts[-1],) if n > 1 else (cuts[0], cuts[-1])
        tps = {t: dataclasses.replace(p, flops=grow(p.flops), params=grow(p.params), saved_bytes=grow(p.saved_bytes),
                                      allreduce_bytes=grow(p.allreduce_bytes),
                                      allreduce_count=grow(p.allreduce_count),
                                      largest_params=grow(p.largest_params) if p.largest_params else ())
                for t, p in self.tp.items()}
        crossed = self.crossings
        if crossed:
            crossed = (crossed[0],) + (crossed[1],) * (n - 1) + (crossed[-1],) if n > 1 else (crossed[0], crossed[-1])
        names = (self.block_names[0],) + tuple(f"layer.{i}" for i in range(n)) + (self.block_names[-1],)
        last = n + 1
        shared = (self.shared_blocks[0], last if self.shared_blocks[1] == self.num_blocks - 1 else
                  self.shared_blocks[1])
        measured = grow(self.measured) if self.measured is not None else None
        experts = dataclasses.replace(self.experts, params=grow(self.experts.params), flops=grow(self.experts.flops),
                                      dispatch_bytes=grow(self.experts.dispatch_bytes)) if self.experts else None
        attention = dataclasses.replace(self.attention, layers=grow(self.attention.layers),
                                        kv_bytes=grow(self.attention.kv_bytes), flops=grow(self.attention.flops),
                                        qkv_out_bytes=grow(self.attention.qkv_out_bytes)) if self.attention else None
        return dataclasses.replace(self, block_names=names, flops=grow(self.flops), saved_bytes=grow(self.saved_bytes),
                                   params=grow(self.params), boundary_bytes=new_cuts, crossings=crossed, tp=tps,
                                   shared_blocks=shared,
                                   measured=measured, experts=experts, attention=attention, weight_flops=grow(self.weight_flops) if self.weight_flops else (),
                                   weight_out_bytes=grow(self.weight_out_bytes) if self.weight_out_bytes else (),
                                   ops=grow(self.ops) if self.ops else ())


def profile_graph(graph: ModelGraph, *, name: str, seq_len: int, batch: int = 1,
                  tp_degrees: tuple[int, ...] = (1,), sequence_parallel: bool = False,
                  model: torch.nn.Module | None = None) -> ModelProfile:
    """Reduce a traced graph (traced at micro-batch `batch`) to per-sequence block costs.
    `sequence_parallel`: the tp degrees run with --sp (a split layer's activations all / tp). `model`: the traced
    module, to find its experts (what --ep shards); without it the profile has none."""
    from .dimension_profile import attention_costs, expert_costs
    blocks = graph.blocks
    scale = 1.0 / batch
    flops = tuple(b.flops * scale for b in blocks)
    saved = tuple(b.activation_bytes * scale for b in blocks)
    owner: dict[str, list[int]] = {}
    for i, b in enumerate(blocks):
        for p in b.params:
            owner.setdefault(p, []).append(i)
    params = [0] * len(blocks)
    for p, users in owner.items():
        params[users[0]] += graph.param_numel[p]
    largest = _largest_params(graph, lambda fqn: graph.param_numel[fqn])
    shared = {p: users for p, users in owner.items() if len(users) > 1}
    shared_blocks = (min(u[0] for u in shared.values()), max(u[-1] for u in shared.values())) if shared else (0, 0)
    cut_values = crossings(graph)
    cut_bytes = tuple(sum(v.bytes for v in values) * scale for values in cut_values)
    batched = _batched_values(graph)

    def crossing(values) -> Crossing:
        def total(wanted) -> tuple[float, float]:
            return (sum(v.bytes for v in values if wanted(v) and v.name in batched) * scale,
                    float(sum(v.bytes for v in values if wanted(v) and v.name not in batched)))
        (per_seq, fixed), (grad_per_seq, grad_fixed) = total(lambda v: True), total(lambda v: v.needs_grad)
        return Crossing(per_seq, fixed, grad_per_seq, grad_fixed)
    weight_flops, weight_out = [0.0] * len(blocks), [0.0] * len(blocks)
    ops = [0] * len(blocks)
    for cost in graph.nodes.values():
        ops[cost.block] += 1
        if cost.params:
            weight_flops[cost.block] += cost.flops * scale
            weight_out[cost.block] += cost.out_bytes * scale
    profile = ModelProfile(name=name, seq_len=seq_len, block_names=tuple(b.name for b in blocks), flops=flops,
                           saved_bytes=saved, params=tuple(params), boundary_bytes=cut_bytes,
                           crossings=tuple(crossing(values) for values in cut_values),
                           shared_params=sum(graph.param_numel[p] for p in shared), shared_blocks=shared_blocks,
                           weight_flops=tuple(weight_flops), weight_out_bytes=tuple(weight_out), ops=tuple(ops),
                           experts=expert_costs(graph, model, seq_len) if model is not None else None,
                           attention=attention_costs(graph, scale))
    for tp in tp_degrees:
        if tp == 1:
            profile.tp[1] = TPProfile(1, flops, tuple(params), saved, (0.0,) * len(blocks), (0,) * len(blocks),
                                      largest)
            continue
        try:
            profile.tp[tp] = _tp_profile(graph, tp, params, scale, sequence_parallel)
        except AutoparError as exc:
            profile.tp_refused[tp] = str(exc)
    return profile


def _batched_values(graph: ModelGraph) -> set[str]:
    """Names of the graph's values computed from the model's inputs (so with a batch dimension); the others (a
    rotary table, position ids) come from constants and the sequence length alone and do not grow with it."""
    from torch.export.graph_signature import InputKind
    batched = {spec.arg.name for spec in graph.exported.graph_signature.input_specs
               if spec.kind == InputKind.USER_INPUT}
    for node in graph.graph.nodes:
        if node.op == "call_function" and any(arg.name in batched for arg in node.all_input_nodes):
            batched.add(node.name)
    return batched


def _largest_params(graph: ModelGraph, local_numel) -> tuple[int, ...]:
    """Per block, the most elements `local_numel(fqn)` gives one of its parameters (each counted in its first block)."""
    largest = [0] * len(graph.blocks)
    seen: set[str] = set()
    for i, b in enumerate(graph.blocks):
        for p in b.params:
            if p not in seen:
                seen.add(p)
                largest[i] = max(largest[i], local_numel(p))
    return tuple(largest)


def _tp_profile(graph: ModelGraph, tp: int, params: list[int], scale: float,
                sequence_parallel: bool = False) -> TPProfile:
    from ..tensor_parallel import plan_tensor_parallel  # read-only use of the TP planner
    plan = plan_tensor_parallel(graph, tp)
    if not plan.params:
        raise AutoparError(f"the tensor-parallel planner split no layer at tp={tp}")
    split = set(plan.params)
    n = len(graph.blocks)
    flops, reduce, count = [0.0] * n, [0.0] * n, [0] * n
    has_split = [False] * n
    for cost in graph.nodes.values():
        if any(p in split for p in cost.params):
            has_split[cost.block] = True
    for cost in graph.nodes.values():
        divided = any(p in split for p in cost.params) or (
            has_split[cost.block] and any(op in cost.target for op in ATTENTION_OPS))
        flops[cost.block] += cost.flops * scale / (tp if divided else 1)
        if cost.name in plan.row or cost.name in plan.embeddings:
            reduce[cost.block] += cost.out_bytes * scale
            count[cost.block] += 1
    local = list(params)
    owner_block = {}
    for i, b in enumerate(graph.blocks):
        for p in b.params:
            owner_block.setdefault(p, i)
    for fqn in split:
        if fqn in owner_block:
            local[owner_block[fqn]] -= graph.param_numel[fqn] - graph.param_numel[fqn] // tp
    if sequence_parallel:  # sequence parallelism splits the rest too (benchmarks/sp_activation_memory.py)
        saved = tuple(b.activation_bytes * scale / (tp if has_split[i] else 1) for i, b in enumerate(graph.blocks))
    else:  # each op's output split as the plan splits that value (the column layers' outputs and what follows them)
        saved = tuple(b * scale for b in _split_activation_bytes(graph, plan, tp))
    largest = _largest_params(graph, lambda fqn: graph.param_numel[fqn] // (tp if fqn in split else 1))
    return TPProfile(tp, tuple(flops), tuple(local), saved, tuple(reduce), tuple(count), largest)


def _split_activation_bytes(graph: ModelGraph, plan, tp: int) -> list[float]:
    """Per block, the traced outputs' bytes on one tp rank: a value the plan shards (plan.value_shards: a column
    layer's output and the per-head, per-feature ops after it, a vocabulary-parallel head's logits) holds 1 / tp of
    its bytes, every other one (norms, residuals, a row layer's summed output) all of them. An op returning several
    values (attention's output with its statistics) is split when its pieces are. A reshape that copies whole can be
    a view on one rank (_local_view): then it holds nothing there."""
    sharded = set(plan.value_shards)
    for node in graph.exported.graph.nodes:
        if node.target is operator.getitem and node.name in sharded and isinstance(node.args[0], torch.fx.Node):
            sharded.add(node.args[0].name)
    viewed = {node.name for node in graph.exported.graph.nodes if _local_view(node, plan.value_shards, tp)}
    out = [0.0] * len(graph.blocks)
    for cost in graph.nodes.values():
        if cost.name not in viewed:
            out[cost.block] += cost.out_bytes / (tp if cost.name in sharded else 1)
    return out


def _local_view(node, shards: dict, tp: int) -> bool:
    """A reshape of an expanded value copies it (grouped-query attention repeating each key/value head for its query
    heads), unless the dimensions it merges with the expanded one hold one element each, which is what a rank has
    left when tp splits the key/value heads down to one: then the rank's reshape is a view (tried on meta tensors at
    the rank's shapes)."""
    from ..tensor_parallel.rules import VIEWS  # (the reshape family as the TP planner names it)
    source = node.args[0] if node.target in VIEWS and node.args and isinstance(node.args[0], torch.fx.Node) else None
    if source is None or source.target is not torch.ops.aten.expand.default or node.name not in shards:
        return False
    base = source.args[0]
    if not isinstance(base, torch.fx.Node) or base.name not in shards or source.name not in shards:
        return False

    def local(value) -> list[int] | None:
        meta = value.meta.get("val")
        if not isinstance(meta, torch.Tensor):
            return None
        shape, (dim, _) = list(meta.shape), shards[value.name]
        shape[dim] //= tp
        return shape
    shapes = [local(v) for v in (base, source, node)]
    if any(s is None for s in shapes):
        return False
    expanded = torch.empty(shapes[0], device="meta").expand(shapes[1])
    return expanded.reshape(shapes[2]).untyped_storage().nbytes() == expanded.untyped_storage().nbytes()


REPEAT_FROM = 8  # layers; deeper models built from n_layer identical layers are traced with 2 and scaled


def profile_model(model_name: str, *, seq_len: int, tp_degrees: tuple[int, ...] = (1,),
                  model_args: dict | None = None, vocab_size: int | None = None,
                  layers: int | None = None) -> ModelProfile:
    """Build `model_name` on meta, trace it at micro-batch 1, and profile it.

    With `layers`, the model is traced with 2 repeated layers and scaled to `layers`
    (with_layers): the trace and the TP plan then cost seconds at any depth. A model built with
    more than REPEAT_FROM identical `n_layer` layers (the GPT presets) is profiled that way by
    default: tracing all 44 layers of gpt-20b took 16 s, two layers scaled 0.4 s, same FLOPs and
    parameters.
    """
    from ..data import build_tokenizer, padded_vocab_size
    from ..models import build_model
    args = dict(model_args or {})
    if vocab_size is None:
        vocab_size = padded_vocab_size(build_tokenizer("byte").vocab_size)
    if layers is None:
        _, info = build_model(model_name, dict(args), vocab_size=vocab_size, device="meta")
        depth = info.args.get("n_layer")
        if isinstance(depth, int) and depth > REPEAT_FROM:
            layers = depth
    if layers is not None:
        args["n_layer"] = min(2, layers)
    model, info = build_model(model_name, args, vocab_size=vocab_size, device="meta")
    if seq_len > info.max_seq_len:
        raise AutoparError(f"seq_len={seq_len} is longer than {info.name}'s context of {info.max_seq_len}")
    graph = trace(model, (torch.zeros(1, seq_len, dtype=torch.long, device="meta"),))
    profile = profile_graph(graph, name=info.name, seq_len=seq_len, tp_degrees=tp_degrees, model=model)
    if layers is not None and layers != profile.num_blocks - 2:
        profile = profile.with_layers(layers)
    return profile
