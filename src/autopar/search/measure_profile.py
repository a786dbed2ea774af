"""Measured per-block costs on this machine, for a profile whose FLOP estimate is too coarse (CPU, small models).

On a CPU with small layers the step is not FLOPs / matmul rate: every op pays a fixed
dispatch cost, elementwise ops are memory-bound, and autograd keeps far fewer bytes than the
sum of every op's output. So each block is built as a one-block stage (as the `time`
partition does, partition/measure.py) and run for real, at two micro-batch sizes, one thread:

    forward, backward time  fitted as  fixed + per_sequence x micro-batch  (per block)
    saved bytes             what autograd keeps for the backward (saved-tensor hooks, as the
                            runtime's stage-aware recomputation measures it), per sequence
    transient bytes         the most bytes alive at once during the block's forward+backward
                            beyond its inputs and saved tensors (output gradients, temporaries;
                            the loss and its softmax for the last block), per sequence
    update time             the per-parameter work after the backward (gradient norm, clip,
                            foreach AdamW step) on the block's parameters
    I and W time            the runtime's own zero-bubble split of the same backward
                            (pipeline/split_backward.py: I the input gradient, W the weight
                            gradients from what I kept), fitted like the backward: on CPU their
                            sum is more than the fused backward (a second autograd call, the kept
                            gradients read back), which a zero-bubble schedule pays every micro-batch
    held bytes              what I keeps for W (WeightWork.held_bytes: the gradients at the
                            weight-consuming ops), per sequence; the graph's saved tensors stay
                            alive with it until W, counted as activations. Recomputation does not
                            change it: R rebuilds the whole graph before I, and I keeps it to W
    split transient bytes   the most bytes alive during the block's forward, I and W beyond its
                            saved and held bytes, as the transient above

Measured at tp = 1. A tensor-parallel degree scales the per-sequence time of a block by its
share of FLOPs left on one rank, its fixed time as search/tp_fixed.py says (the ops' dispatch
stays, the rest follows the parameters), its update time by its parameter share, its saved bytes
by the profile's activation share and its transient by part (step_memory.py); stated
approximations.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from .._torch_internals import tree_leaves
from ..errors import AutoparError
from .live_memory import LiveTensorPeak, storage_bytes
from .profile import ModelProfile

MICRO_BATCHES = (1, 4)  # the two sizes the linear fit goes through
_clock = time.thread_time
"""What the blocks are timed with: the measuring thread's CPU seconds, which a rank with a core of its own takes
as wall time. Wall time read while other processes held the core (a shared machine) counted their slices too:
blocks timed at load 27 on 2 cores read 4x slow, and the plans priced on them as much."""


@dataclass(frozen=True)
class BlockCosts:
    """Measured costs of one block: seconds = fixed + per_sequence x micro-batch; bytes per sequence."""

    forward_fixed_s: float
    forward_per_seq_s: float
    backward_fixed_s: float
    backward_per_seq_s: float
    saved_per_seq: float
    transient_fixed: float
    transient_per_seq: float
    update_s: float = 0.0  # the step's work on this block's parameters: gradient-norm terms, clip, AdamW step
    update_call_s: float = 0.0
    """The part of update_s an update pays once whatever it holds (the optimizer step's own Python, the norm's host
    read): timed block by block it is in every block's, but a rank updates all its blocks in one call
    (cost.update_time). The blocks' updates summed less one update of them all, per block beyond the first."""
    update_foreach_norm_s: float | None = None
    """update_s with the data-parallel engine's gradient norm (torch.nn.utils.clip_grad_norm_: foreach, in the
    gradients' dtype) instead of the float64 sum one tensor at a time that the pipeline, TP and ZeRO engines take:
    on a width-768 block's 7M parameters 4 ms against 44 ms here, the AdamW step 10 ms. None: not measured
    (update_s whatever the engine)."""
    cpu_per_wall: float = 1.0
    """CPU seconds per second of the times above: 1, as they are the measuring thread's CPU seconds (_clock); a
    profile that timed wall seconds while other processes held the core says so with less. The time-shared
    bound counts CPU."""
    # the zero-bubble split (None: not measured; the cost model then prices I and W from the backward)
    input_fixed_s: float | None = None
    input_per_seq_s: float | None = None
    weight_fixed_s: float | None = None
    weight_per_seq_s: float | None = None
    held_per_seq: float | None = None
    split_transient_fixed: float | None = None
    split_transient_per_seq: float | None = None
    eager_saved_per_seq: float | None = None
    """Bytes autograd keeps for this block when the model runs as itself, not as traced stages (the engines
    without a pipeline or TP: data parallel, ZeRO 1-3, train/fsdp_engine.py); None: not measured. They can
    differ: a traced hf:llama layer keeps 1.25x what the eager one does (benchmarks/strategy_search_terms.py
    --saved)."""

    @property
    def has_split(self) -> bool:
        return self.input_fixed_s is not None


def _update_seconds(stage, repeats: int, foreach_norm: bool = False) -> float:
    """Median seconds of what a training step does per parameter after the backward, on this block's own:
    the gradient norm's squares and the clip scale per tensor (as the engines do, one tensor at a time), then
    a foreach AdamW step (train/optim.py). On small models this per-tensor work is milliseconds per step,
    far above its bytes / memory bandwidth. `foreach_norm`: the norm and clip as the data-parallel engine takes
    them instead (torch.nn.utils.clip_grad_norm_, train/engine.py)."""
    params = [p for p in stage.parameters() if p.requires_grad]
    if not params:
        return 0.0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    optimizer = torch.optim.AdamW(params, lr=1e-9, **({"fused": True} if fused else {"foreach": True}))  # as trained

    def update() -> None:
        if foreach_norm:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            return
        squares = torch.zeros((), dtype=torch.float64)
        for p in params:
            squares += p.grad.double().square().sum()
        scale = 1.0 / (1.0 + float(squares.sqrt()))
        for p in params:
            p.grad.mul_(scale)
        optimizer.step()

    update()  # allocates the optimizer states
    samples = []
    for _ in range(repeats):
        began = _clock()
        update()
        samples.append(_clock() - began)
    return statistics.median(samples)


def _eager_saved_bytes(model: nn.Module, block_names: tuple[str, ...], batch: int, seq_len: int,
                       seed: int) -> list[int] | None:
    """Per block, bytes autograd keeps in one forward of the model itself on `batch` sequences,
    attributed by hooks on the layer blocks' modules: before the first layer to the first block, after the
    last to the last; a storage saved by several blocks counts once, in the first. None when a layer block is
    not a module of the model (a custom cut), so the traced blocks' bytes stand."""
    from ..models.materialize import materialize
    layers = block_names[1:-1]
    try:
        for name in layers:
            model.get_submodule(name)
    except AttributeError:
        return None
    full = materialize(copy.deepcopy(model), "cpu", seed=seed)
    modules = [full.get_submodule(name) for name in layers]
    weights = {t.untyped_storage().data_ptr() for t in [*full.parameters(), *full.buffers()]}
    totals, seen, current = [0] * len(block_names), set(), [0]
    hooks = []
    for i, module in enumerate(modules, start=1):
        hooks.append(module.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i)))
        hooks.append(module.register_forward_hook(lambda *_: current.__setitem__(0, len(block_names) - 1)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in weights and key not in seen:
            seen.add(key)
            totals[current[0]] += t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            full(torch.zeros(batch, seq_len, dtype=torch.long))  # no loss: the traced blocks' bytes have none either
    finally:
        for hook in hooks:
            hook.remove()
    return totals


def _loss(out) -> torch.Tensor:
    """The last block's loss as training computes it: cross-entropy over the logits (softmax kept)."""
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    logits = next((t for t in leaves if t.dim() == 3), None)
    if logits is None:
        return sum(t.float().square().mean() for t in leaves)
    target = torch.zeros(logits.shape[:2], dtype=torch.long)
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _one_block_stages(model: nn.Module, batch: int, seq_len: int, seed: int):
    """Every block of `model` as a materialised one-block stage, traced at micro-batch `batch`."""
    import copy

    from ..models.materialize import materialize
    from ..partition.stages import StageModule, lifted_constant_values, materialize_stage, plan_stages
    from ..trace import trace
    graph = trace(model, (torch.zeros(batch, seq_len, dtype=torch.long, device="meta"),))
    specs = plan_stages(graph, list(range(len(graph.blocks) + 1)))
    full = materialize(copy.deepcopy(model), "cpu", seed=seed)
    stages = [StageModule(graph, spec, len(specs)) for spec in specs]
    if any(v is None for stage in stages for v in stage.constants.values()):
        constants = lifted_constant_values(model, graph, torch.device("cpu"))
        for stage in stages:
            stage.constants.update({k: constants[k] for k in stage.constants if k in constants})
    return graph, [materialize_stage(stage, full, "cpu") for stage in stages]


def _example(value: torch.Tensor) -> torch.Tensor:
    if value.is_floating_point():
        return torch.randn(value.shape, dtype=value.dtype)
    return torch.zeros(value.shape, dtype=value.dtype)


def _block_inputs(graph, stages) -> list[tuple]:
    """Each block's inputs: the previous block's outputs (real shapes and dtypes), the first from the graph."""
    values = tuple(_example(v) for v in graph.example_inputs)
    inputs = []
    with torch.no_grad():
        for stage in stages:
            inputs.append(values)
            values = tuple(t for t in tree_leaves(stage(*values)) if isinstance(t, torch.Tensor))
    return inputs


def _run_block(stage, inputs: tuple, counter: LiveTensorPeak | None = None) -> tuple[float, float]:
    """One forward and backward of a one-block stage: their seconds (counting live bytes if asked)."""
    x = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in inputs)
    if counter is not None:
        counter.resident |= storage_bytes([*x, *(p.grad for p in stage.parameters() if p.grad is not None)])[1]
    with counter if counter is not None else contextlib.nullcontext():
        began = _clock()
        out = stage(*x)
        if stage.is_last:
            out = (_loss(out),)
        forward = _clock() - began
        pairs = [(o, torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o))
                 for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        began = _clock()
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        backward = _clock() - began
        del out, pairs
    return forward, backward


def _run_split(stage, inputs: tuple, cache, counter: LiveTensorPeak | None = None) -> tuple[float, float, float, int]:
    """One forward, I and W of a one-block stage as the runtime runs them (pipeline/split_backward.py, with a
    plan cache as each runtime keeps): their seconds, and the bytes I kept for W."""
    from ..pipeline.split_backward import backward_input, backward_weight
    x = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in inputs)
    params = [p for p in stage.parameters() if p.requires_grad]
    if counter is not None:
        counter.resident |= storage_bytes([*x, *(p.grad for p in params if p.grad is not None)])[1]
    with counter if counter is not None else contextlib.nullcontext():
        began = _clock()
        out = stage(*x)
        if stage.is_last:
            out = (_loss(out),)
        forward = _clock() - began
        pairs = [(o, None if o.dim() == 0 else torch.randn_like(o))
                 for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        wanted = [v for v in x if v.requires_grad]
        began = _clock()
        got, work = backward_input([o for o, _ in pairs], [g for _, g in pairs], wanted, params, cache)
        middle = _clock()
        held = work.held_bytes
        backward_weight(work)
        ended = _clock()
        del out, pairs, got, work
    return forward, middle - began, ended - middle, held


def _measure_chains(chains: list, repeats: int) -> list[tuple[list[float], list[float], list[int], list[int],
                                                             list[float], float]]:
    """Per chain (one per micro-batch size): median forward and backward seconds, saved and transient bytes
    of every block, its parameter update's seconds (the same in every chain), and the CPU seconds per wall second
    of all the timing (the same too). The chains' blocks are timed in turn, round after round, so load drift on a
    shared machine hits both micro-batch sizes alike (the fit of fixed and per-sequence time depends on both)."""
    from ..pipeline.recompute import measure_saved_bytes
    from ..pipeline.split_plan import SplitPlanCache
    prepared = [(stages, _block_inputs(graph, stages)) for graph, stages in chains]
    times = [[([], [], [], []) for _ in stages] for stages, _ in prepared]
    caches = [[SplitPlanCache() for _ in stages] for stages, _ in prepared]
    for repeat in range(repeats + 1):  # round 0 warms up
        for c, (stages, inputs) in enumerate(prepared):
            for i, stage in enumerate(stages):
                forward, backward = _run_block(stage, inputs[i])
                if repeat:
                    times[c][i][0].append(forward)
                    times[c][i][1].append(backward)
                _, backward_i, backward_w, _ = _run_split(stage, inputs[i], caches[c][i])
                if repeat:
                    times[c][i][2].append(backward_i)
                    times[c][i][3].append(backward_w)
    cpu_per_wall = 1.0  # the times are the thread's CPU seconds (_clock)
    updates = [_update_seconds(stage, repeats) for stage in prepared[0][0]]
    results = []
    for c, (stages, inputs) in enumerate(prepared):
        saved, transient, held, split_transient = [], [], [], []
        for i, stage in enumerate(stages):
            saved.append(measure_saved_bytes(stage, inputs[i])[0])
            counter = LiveTensorPeak(storage_bytes([*stage.parameters(), *stage.buffers()])[1])
            _run_block(stage, inputs[i], counter)
            transient.append(max(0, counter.peak - saved[i]))
            counter = LiveTensorPeak(storage_bytes([*stage.parameters(), *stage.buffers()])[1])
            held.append(_run_split(stage, inputs[i], caches[c][i], counter)[3])
            split_transient.append(max(0, counter.peak - saved[i] - held[i]))
            stage.zero_grad(set_to_none=True)
        median = [[statistics.median(samples) for samples in block] for block in times[c]]
        results.append(([m[0] for m in median], [m[1] for m in median], saved, transient, updates, cpu_per_wall,
                        [m[2] for m in median], [m[3] for m in median], held, split_transient))
    return results


def measure_blocks(model_name: str, *, seq_len: int, model_args: dict | None = None, vocab_size: int | None = None,
                   micro_batches: tuple[int, int] = MICRO_BATCHES, repeats: int = 5, seed: int = 0
                   ) -> list[BlockCosts]:
    """Measure every block of `model_name` at two micro-batch sizes (one thread) and fit the costs."""
    from ..data import build_tokenizer, padded_vocab_size
    from ..models import build_model
    if vocab_size is None:
        vocab_size = padded_vocab_size(build_tokenizer("byte").vocab_size)
    model, _ = build_model(model_name, dict(model_args or {}), vocab_size=vocab_size, device="meta")
    return measure_module_blocks(model, seq_len=seq_len, micro_batches=micro_batches, repeats=repeats, seed=seed)


def measure_module_blocks(model: nn.Module, *, seq_len: int, micro_batches: tuple[int, int] = MICRO_BATCHES,
                          repeats: int = 5, seed: int = 0) -> list[BlockCosts]:
    """Measure every block of `model` (called on token ids of shape (batch, seq_len); meta or real weights,
    left untouched: a materialised copy is measured) at two micro-batch sizes, one thread, and fit the costs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank runs (launch.py)
    try:
        chains = [_one_block_stages(model, b, seq_len, seed) for b in micro_batches]
        runs = _measure_chains(chains, repeats)
        whole_update = _update_seconds(nn.ModuleList(chains[0][1]), repeats)  # one call over every block
        foreach = [_update_seconds(stage, repeats, foreach_norm=True) for stage in chains[0][1]]
    finally:
        torch.set_num_threads(threads)
    (f1, b1, s1, t1, updates, cpu_per_wall, i1, w1, _, x1), (f2, b2, s2, t2, _, _, i2, w2, h2, x2) = runs
    lo, hi = micro_batches
    graph = chains[-1][0]
    names = tuple(getattr(b, "name", "") for b in graph.blocks)
    eager = _eager_saved_bytes(model, names, hi, seq_len, seed) if len(names) == len(f1) else None

    def fit(small: float, large: float) -> tuple[float, float]:
        per = max(0.0, (large - small) / (hi - lo))
        return max(0.0, small - per * lo), per

    timed = [u for u in updates if u > 0]
    call = min(max(0.0, (sum(timed) - whole_update) / (len(timed) - 1)), min(timed)) if len(timed) > 1 else 0.0
    out = []
    for i in range(len(f1)):
        (ff, fs), (bf, bs), (tf, ts) = fit(f1[i], f2[i]), fit(b1[i], b2[i]), fit(t1[i], t2[i])
        (inf, ins), (wf, ws), (xf, xs) = fit(i1[i], i2[i]), fit(w1[i], w2[i]), fit(x1[i], x2[i])
        out.append(BlockCosts(forward_fixed_s=ff, forward_per_seq_s=fs, backward_fixed_s=bf, backward_per_seq_s=bs,
                              saved_per_seq=s2[i] / hi, transient_fixed=tf, transient_per_seq=ts,
                              update_s=updates[i], update_call_s=call if updates[i] > 0 else 0.0,
                              update_foreach_norm_s=foreach[i],
                              cpu_per_wall=cpu_per_wall, input_fixed_s=inf, input_per_seq_s=ins,
                              weight_fixed_s=wf, weight_per_seq_s=ws, held_per_seq=h2[i] / hi,
                              split_transient_fixed=xf, split_transient_per_seq=xs,
                              eager_saved_per_seq=eager[i] / hi if eager else None))
    return out


def _same_layers_alike(profile: ModelProfile, blocks: list[BlockCosts]) -> list[BlockCosts]:
    """Where the layers (every block but the first and last) are the same computation (equal traced FLOPs
    and parameters), give each the median of their measurements, so that one noisy timing on a shared
    machine does not skew a cut."""
    layers = blocks[1:-1]
    middle = list(zip(profile.flops[1:-1], profile.params[1:-1]))
    if len(layers) < 2 or any(m != middle[0] for m in middle):
        return blocks
    def typical_of(name: str):
        values = [getattr(b, name) for b in layers]
        return None if any(v is None for v in values) else statistics.median(values)

    typical = BlockCosts(**{f.name: typical_of(f.name) for f in dataclasses.fields(BlockCosts)})
    return [blocks[0], *([typical] * len(layers)), blocks[-1]]


def with_measured_blocks(profile: ModelProfile, blocks: list[BlockCosts]) -> ModelProfile:
    """`profile` whose block times and activation bytes are the measured ones (tensor-parallel ones scaled)."""
    if len(blocks) != profile.num_blocks:
        raise AutoparError(f"measured {len(blocks)} blocks of {profile.name}, but its profile has "
                           f"{profile.num_blocks}; measure the same model arguments")
    blocks = _same_layers_alike(profile, blocks)
    saved = tuple(b.saved_per_seq for b in blocks)
    tps = {}
    for t, p in profile.tp.items():
        share = [mine / whole if whole else 1.0 for mine, whole in zip(p.saved_bytes, profile.saved_bytes)]
        tps[t] = dataclasses.replace(p, saved_bytes=tuple(s * r for s, r in zip(saved, share)))
    return dataclasses.replace(profile, saved_bytes=saved, tp=tps, measured=tuple(blocks))


MEASURE_MEMORY_SHARE = 0.25  # measure a model only if its weights, gradients and AdamW states fit this share of RAM


def measurable_here(cluster, num_params: int) -> str | None:
    """Why the blocks cannot be measured for `cluster` on this machine (None: they can).

    Measuring is right only where the cluster is this machine (the cpu-local preset or a file written by
    `autopar calibrate`, which sets cores_per_node) and the model runs here: weights, gradients and two
    AdamW moments in fp32 within a quarter of this machine's RAM. GPU presets keep the analytic model. Not
    inside ranks: every rank would measure different times and could pick a different plan."""
    import os
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        return ("each rank would search on its own, and measured times differ between processes (plans must agree); "
                "search before the ranks start (autopar train --strategy auto, autopar.plan_auto) to measure")
    if cluster.name != "cpu-local" and not cluster.cores_per_node:
        return f"cluster {cluster.name} is not this machine (a preset or file without cores_per_node)"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 8 * 2**30
    need = 16 * num_params
    if need > MEASURE_MEMORY_SHARE * ram:
        return (f"{num_params:,} parameters need {need / 2**30:.1f} GiB to train, more than "
                f"{MEASURE_MEMORY_SHARE:.0%} of this machine's {ram / 2**30:.1f} GiB")
    return None


COST_MODELS = ("auto", "measured", "flops")


def with_cost_model(profile: ModelProfile, cluster, cost_model: str, measure) -> tuple[ModelProfile, str]:
    """The profile the search should score with, and one sentence saying which and why.

    auto: measured block costs (`measure()`) where measurable_here allows, else the traced FLOPs at the
    cluster's rate; measured: the same, refused with the reason where it cannot; flops: never measure."""
    from ..errors import ConfigError, choices
    if cost_model not in COST_MODELS:
        raise ConfigError(f"cost model must be one of {choices(COST_MODELS)}, got {cost_model!r}")
    if cost_model == "flops":
        return profile, "block times from traced FLOPs at the cluster's rate (--cost-model flops)"
    reason = measurable_here(cluster, profile.num_params)
    if reason is None:
        try:
            blocks = measure()
        except ConfigError as exc:
            reason = str(exc)
        else:
            from .ring_cost import CP_DEGREES, with_ring_seconds  # context parallelism's ring, timed beside the blocks
            degrees = tuple(d for d in CP_DEGREES if not cluster.num_devices or cluster.num_devices % d == 0)
            return (with_ring_seconds(with_measured_blocks(profile, blocks), degrees=degrees),
                    f"block times and activation bytes measured on this machine ({len(blocks)} blocks, one thread; "
                    f"--cost-model flops to skip)")
    if cost_model == "measured":
        raise ConfigError(f"--cost-model measured: cannot measure the blocks here: {reason}; use --cost-model flops")
    return profile, f"block times from traced FLOPs at the cluster's rate (not measured: {reason})"
