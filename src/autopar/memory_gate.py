"""The memory gate: a run set by hand is refused before any rank starts when the memory model says it cannot fit.

`autopar train --model gpt-20b --nproc 1` used to run a minute and be killed by the kernel with no word.
The strategy search's memory model (search/memory_fit.py) predicts the peak per pipeline rank from the
model traced on meta (seconds, no real allocation); the CLI holds it against the memory one rank may use
(search/device_memory.py: this host's available memory over its ranks, or the GPU's) and refuses a run that
is over it by more than the model's error, naming the estimate per pipeline rank and the nearest changes
that fit, checked by the same model and by the runtime's own strategy checks. `--force` starts it anyway.

Gated: strategies set by hand (`--strategy auto` checks memory in its own search, and a saved plan was made
by it). Not gated, and said so: what the memory model does not cover (memory_fit.not_covered), and a host
whose memory cannot be read. `dry_run` is `autopar train --dry-run`: the same checks and the plan, no rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .config import JobConfig
from .errors import ConfigError, ModelError
from .search.cluster import preset, resolve_cluster
from .search.device_memory import rank_memory, size
from .search.memory_fit import MODEL_ERROR, Fit, MemoryFit, Setting, candidate_of, changes, not_covered, rank_lines
from .search.profile import profile_graph
from .strategies import Resolved, resolve
from .version import __version__

TP_DEGREES = (1, 2, 4, 8)  # the tp degrees suggestions may use (each is planned on the traced model)
SUGGESTIONS = 3  # most changes named


@dataclass
class MemoryVerdict:
    """What the gate found: the lines to show, and the refusal or warning, if any."""

    lines: list[str] = field(default_factory=list)
    refusal: str | None = None
    warning: str | None = None
    fit: Fit | None = None


def is_hand_set(job: JobConfig) -> bool:
    """A strategy the user chose (no --strategy auto, no saved plan): the runs the gate holds to the memory."""
    return job.strategy.planning.mode == "manual" and not job.strategy.planning.plan


def check_memory(job: JobConfig, resolved: Resolved, build: Callable, *, force: bool = False,
                 force_hint: str = "Pass --force to start it anyway", reuse_trace: bool = False) -> MemoryVerdict:
    """Raise ConfigError when the run cannot fit (unless `force`); otherwise return what was found.

    `build()` gives the job's parts (job.build_job: the model on meta and its data), called only when the
    strategy is covered and the memory known. `force_hint`: how to force it, as the refusal ends. `reuse_trace`:
    a model of the same structure traced earlier in this process is not traced again (_fit_model)."""
    verdict = estimate(job, resolved, build, suggest=True, force_hint=force_hint, reuse_trace=reuse_trace)
    if verdict.refusal is not None and not force:
        raise ConfigError("\n".join([verdict.refusal, *verdict.lines[1:]]))
    return verdict


def estimate(job: JobConfig, resolved: Resolved, build: Callable, *, suggest: bool,
             force_hint: str = "Pass --force to start it anyway", reuse_trace: bool = False) -> MemoryVerdict:
    strategy, config = resolved.strategy, resolved.config
    missing = not_covered(strategy, config)
    if missing is not None:
        return MemoryVerdict([f"memory not estimated for {missing}: the memory model does not cover it, so the run "
                              f"is not checked against the memory"])
    nproc = job.launch.nproc
    memory = rank_memory(config.device, nproc, memory_per_device_gb=job.strategy.planning.memory_per_device_gb)
    if memory is None:
        where = "no CUDA device is visible here" if config.device == "cuda" else "this host's memory cannot be read"
        return MemoryVerdict([f"memory not estimated: {where}"])
    parts = estimate_parts(job) or build()
    try:
        fit = _fit_model(parts, strategy, config, nproc) if reuse_trace else _traced_fit(parts, strategy, config, nproc)
    except ModelError as exc:  # data parallelism runs models the tracer cannot take: the estimate only is lost
        return MemoryVerdict([f"memory not estimated: the model could not be traced on meta ({exc})"])
    base = Setting(candidate=candidate_of(strategy, config, resolved.accumulation), world=nproc, dtype=config.dtype,
                   global_batch_size=config.global_batch_size, memory=memory.bytes,
                   stage_budget_mb=strategy.pipeline.memory_budget_mb)
    found = fit.assess(base)
    limit = memory.bytes * (1 + MODEL_ERROR)
    head = (f"memory per rank, predicted by the strategy search's model on the traced model (live tensors; a run is "
            f"refused only when even the lower figure is over {1 + MODEL_ERROR:g}x the memory, the model's error):")
    lines = [head, *rank_lines(found), f"  memory: {memory.describe()}: "
             + ("fits" if found.fits else f"predicted {size(found.high * found.headroom)} with the allocator's "
                f"{found.headroom:g}x headroom, over it" + ("" if found.refused else " but within the model's error"))]
    verdict = MemoryVerdict(lines=lines, fit=found)
    if found.refused:
        verdict.refusal = (f"{parts.name} with dp={strategy.dp} tp={strategy.tp} pp={strategy.pp} does not fit: the "
                           f"memory model predicts {size(found.high)} per rank at the peak (at least "
                           f"{size(found.low)}), and the memory is {memory.describe()}; refused before starting "
                           f"(over {size(limit)}, {1 + MODEL_ERROR:g}x the memory, is beyond the model's error). "
                           f"{force_hint}")
        if suggest:
            lines += _suggestions(fit, base, job, resolved)
    elif not found.fits:
        verdict.warning = (f"the memory model predicts {size(found.high * found.headroom)} per rank with headroom, "
                           f"over the {memory.describe()}, but within its error: starting")
    return verdict


@dataclass
class EstimateParts:
    """What the estimate needs of a job, as job.JobParts holds it: the model on meta and one sample."""

    job: JobConfig  # with the model's resolved arguments
    model: Any
    name: str
    train_data: Any
    run_info: dict


def estimate_parts(job: JobConfig) -> EstimateParts | None:
    """The model and a sample without training a tokenizer or reading data files, which build_job does (bpe on the
    corpus: half a minute) and the ranks do again. The vocabulary is the most the run's tokenizer can have
    (--vocab-size for word and bpe, the file's for hf:PATH), so the estimate can only be a little high. None
    where build_job is as cheap and exact (the byte tokenizer on the corpus) or the task has no sample here."""
    import torch

    from .data import ByteTokenizer, CausalLMWindows, MaskedLMWindows, build_tokenizer, padded_vocab_size
    from .models import build_model
    data = job.data
    if data.tokenizer == "byte" and data.data is None:
        return None
    if data.tokenizer == "byte":
        vocab = ByteTokenizer().vocab_size
    elif data.tokenizer in ("word", "bpe"):
        vocab = data.vocab_size
    elif data.tokenizer.startswith("hf:"):
        vocab = build_tokenizer(data.tokenizer).vocab_size
    else:
        return None
    model, info = build_model(job.model.name, job.model.args, vocab_size=padded_vocab_size(vocab), device="meta")
    tokens = torch.zeros(2 * data.seq_len + 2, dtype=torch.long)
    if info.task == "causal-lm":
        sample = CausalLMWindows(tokens, data.seq_len)
    elif info.task == "masked-lm":
        sample = MaskedLMWindows(tokens, data.seq_len, mask_id=1, random_vocab=2, seed=0)
    else:
        return None
    resolved = dataclasses.replace(job, model=dataclasses.replace(job.model, args=info.args))
    return EstimateParts(job=resolved, model=model, name=info.name, train_data=sample,
                         run_info={"model": f"{info.name} ({info.task}, {info.num_params:,} parameters)",
                                   "tokenizer": f"{data.tokenizer} (at most {vocab} tokens; made when the run "
                                                f"starts)"})


_FITS: dict[tuple, MemoryFit] = {}  # the last few models' traced profiles, by structure (check_trainer's repeats)


def _fit_model(parts, strategy, config, nproc: int) -> MemoryFit:
    """The model's MemoryFit, traced once per structure in this process: a process that sets up one Trainer per
    layout of the same model (a benchmark, a sweep) traces it once."""
    import torch
    try:
        sample = parts.train_data[0]
    except Exception:  # noqa: BLE001 - a dataset that cannot be indexed here: traced, not kept
        return _traced_fit(parts, strategy, config, nproc)
    values = sample.values() if isinstance(sample, dict) else sample if isinstance(sample, (tuple, list)) else [sample]
    key = (parts.job.model.name, repr(sorted(parts.job.model.args.items())), type(parts.model).__qualname__,
           tuple((n, tuple(p.shape), p.dtype) for n, p in parts.model.named_parameters()),
           tuple(tuple(v.shape) for v in values if isinstance(v, torch.Tensor)), nproc, strategy.tp, strategy.sp,
           strategy.planning.cluster, config.device, config.optimizer)
    if key not in _FITS:
        if len(_FITS) >= 4:
            _FITS.pop(next(iter(_FITS)))
        _FITS[key] = _traced_fit(parts, strategy, config, nproc)
    return _FITS[key]


def _traced_fit(parts, strategy, config, nproc: int) -> MemoryFit:
    """Trace the model on meta once and profile it at the tp degrees the run or a suggestion may use.

    A built-in model of more than REPEAT_FROM identical `n_layer` layers (the GPT presets) is traced with two
    and scaled (ModelProfile.with_layers, as the search profiles them): gpt-20b in a second, not fifteen."""
    from .models import build_model
    from .search.profile import REPEAT_FROM
    from .trace import trace
    from .train.fields import example_call
    model, args = parts.model, dict(parts.job.model.args)
    depth = args.get("n_layer")
    scaled = not parts.job.model.name.startswith("hf:") and isinstance(depth, int) and depth > REPEAT_FROM
    if scaled:
        model, _ = build_model(parts.job.model.name, {**args, "n_layer": 2}, device="meta")
    call_args, kwargs = example_call(model, parts.train_data)
    graph = trace(model, call_args, kwargs)
    seq_len = int(call_args[0].shape[-1]) if call_args and call_args[0].dim() >= 2 else 1
    degrees = tuple(sorted({t for t in TP_DEGREES if t <= nproc} | {strategy.tp}))
    profile = profile_graph(graph, name=parts.name, seq_len=seq_len, tp_degrees=degrees,
                            sequence_parallel=strategy.sp)
    if scaled:
        profile = profile.with_layers(depth)
    default = "h100-80gb" if config.device == "cuda" else "cpu-local"  # only ranks the suggestions by speed
    cluster = resolve_cluster(strategy.planning.cluster) if strategy.planning.cluster else preset(default)
    return MemoryFit(profile, cluster, optimizer=config.optimizer, ranks_per_host=nproc)


def _suggestions(fit: MemoryFit, base: Setting, job: JobConfig, resolved: Resolved) -> list[str]:
    """The nearest configurations that fit and that the runtime accepts: same processes first (fewest flags
    changed, then fastest predicted), else another process count, and changes to the training (batch, precision)."""
    dp_given = job.strategy.dp is not None
    micro_given = job.train.micro_batches is not None
    cuda = resolved.config.device == "cuda"
    shared_host = not cuda and job.strategy.planning.memory_per_device_gb is None  # a given memory is per device
    devices = None
    if cuda:
        import torch
        devices = torch.cuda.device_count() or None

    def accepted(s: Setting) -> bool:
        return _runs(s, job)

    def best(settings) -> tuple[Setting, Fit, list[str]] | None:
        scored = []
        for s in settings:
            if not fit.may_fit(s):
                continue
            found = fit.assess(s)
            if found.fits:
                flags = changes(base, s, dp_given=dp_given, micro_batches_given=micro_given)
                scored.append((len(flags), found.estimate.step_time_s, s, found, flags))
        scored.sort(key=lambda t: t[:2])
        return next(((s, found, flags) for _, _, s, found, flags in scored if accepted(s)), None)

    options = []
    same = best(fit.layouts(base, base.world, memory=base.memory))
    if same is not None:
        options.append(("smallest change that fits", same))
    for world, memory, hosts in fit.process_counts(base, shared_host=shared_host, devices_per_host=devices):
        other = best(fit.layouts(base, world, memory=memory, hosts=hosts, micro_batch_sizes=lambda per_replica: sorted(
            {max(d for d in range(1, base.candidate.micro_batch_size + 1) if per_replica % d == 0), 1})))
        if other is not None:
            if same is None or len(other[2]) <= len(same[2]):  # not the same change plus more processes
                options.append(("with another process count", other))
            break
    if same is None:  # a smaller batch or bf16 activations change what is trained: named only when needed
        batches = []
        g = base.global_batch_size // 2
        while g >= base.candidate.dp and g >= 1:
            batches.append(g)
            g //= 2
        training = [s for g in batches for s in fit.layouts(base, base.world, memory=base.memory, global_batch_size=g)]
        if base.dtype == "fp32":
            training += list(fit.layouts(base, base.world, memory=base.memory, dtype="bf16-autocast"))
        changed = best(training)
        if changed is not None:
            options.append(("changing the training", changed))
    if not options:
        return ["  nothing near this fits (same or other process counts up to 64x, smaller batches, bf16 "
                "activations): a smaller model, or hosts with more memory"]
    lines = []
    for label, (s, found, flags) in options[:SUGGESTIONS]:
        lines.append(f"  {label}: {' '.join(flags)} (predicted {size(found.high)} per rank, "
                     f"{found.high * found.headroom / s.memory:.0%} of its {size(s.memory)} with headroom)")
    return lines


def _runs(s: Setting, job: JobConfig) -> bool:
    """Whether the runtime's strategy checks accept this configuration (strategies.resolve, no model needed)."""
    c = s.candidate
    recompute = "all" if c.recompute == "all" else ("none" if c.recompute == "none" else job.strategy.pipeline.recompute)
    strategy = dataclasses.replace(job.strategy, dp=c.dp if job.strategy.dp is not None else None, tp=c.tp, pp=c.pp,
                                   schedule=c.schedule if c.pp > 1 else job.strategy.pipeline.schedule,
                                   chunks=c.chunks if c.pp > 1 else 1, recompute=recompute, zero=c.zero)
    micro = c.num_microbatches if job.train.micro_batches is not None else None
    config = dataclasses.replace(job.train, micro_batch_size=c.micro_batch_size, micro_batches=micro,
                                 global_batch_size=s.global_batch_size, dtype=s.dtype)
    try:
        resolve(strategy, config, s.world)
    except ConfigError:
        return False
    return True


# ---------------------------------------------------------------------- the Python API's gate

SCREEN_STATE_SHARE = 0.05  # weights, gradients and AdamW state under this share of a rank's memory, and
SCREEN_ACTIVATION_SHARE = 0.5  # micro-batch input elements x parameters x 4 bytes under this share: not traced
# (both, with the allocator's 1.1x headroom: at most 61% of the memory, for a dense model)


def check_trainer(model: Any, train_data: Any, resolved: Resolved, world: int, *, force: bool) -> MemoryVerdict | None:
    """`Trainer(...).train()` with a strategy set by hand: the command line's gate (check_memory) on the model and
    data given, before the engine allocates anything; ConfigError when it cannot fit, unless `force`. None where
    it is not estimated: no memory to hold it against, or a run small beside the memory (`_clearly_small`: the
    trace costs a second on a large model, and most runs are far from the limit)."""
    from .config import LaunchConfig, ModelConfig
    config = resolved.config
    memory = rank_memory(config.device, world, memory_per_device_gb=resolved.strategy.planning.memory_per_device_gb)
    if memory is None or _clearly_small(model, train_data, config, memory.bytes):
        return None
    name = type(model).__name__
    job = JobConfig(strategy=resolved.strategy, train=config, launch=LaunchConfig(nproc=world),
                    model=ModelConfig(name=name, args={}))
    parts = EstimateParts(job=job, model=model, name=name, train_data=train_data, run_info={})
    verdict = check_memory(job, resolved, lambda: parts, force=force,
                           force_hint="Pass Trainer(..., force=True) to start it anyway", reuse_trace=True)
    if verdict.refusal is not None:  # forced: said once, by rank 0
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"autopar: warning: {verdict.refusal}; force=True: starting", flush=True)
    return verdict


def _clearly_small(model: Any, train_data: Any, config: Any, memory_bytes: int) -> bool:
    """Whether a run is small beside the memory without tracing it: its parameters' state (fp32 weights, gradients,
    AdamW's two moments: 16 bytes each) and a dense model's activations (at most one saved value per parameter use:
    the micro-batch's input elements x parameters x 4 bytes) both far below a rank's memory."""
    import torch
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    try:
        sample = train_data[0]
    except Exception:  # noqa: BLE001 - a dataset that cannot be indexed here: estimated in full
        return False
    values = sample.values() if isinstance(sample, dict) else sample if isinstance(sample, (tuple, list)) else [sample]
    elements = max((v.numel() for v in values if isinstance(v, torch.Tensor)), default=0)
    if not elements:
        return False
    return (16 * params <= SCREEN_STATE_SHARE * memory_bytes
            and 4 * params * elements * config.micro_batch_size <= SCREEN_ACTIVATION_SHARE * memory_bytes)


# ---------------------------------------------------------------------- autopar train --dry-run


def dry_run(job: JobConfig, build: Callable, check: Callable[[JobConfig], Resolved], *, force: bool = False) -> None:
    """`autopar train --dry-run`: resolve the config (and the search or the plan, without --confirm's trial runs),
    run `check` (every check a run makes before its ranks start) and the memory estimate, print the plan; no
    process starts, no folder is made. Raises what the run would raise."""
    searched = None
    if job.strategy.planning.mode == "auto" or job.strategy.planning.plan:
        from .train.fields import example_call
        parts = build()
        searched = resolve(job.strategy, job.train, job.launch.nproc, model=parts.model, model_name=parts.name,
                           example=lambda: example_call(parts.model, parts.train_data))
        if job.strategy.planning.confirm and not job.strategy.planning.plan:
            print(f"--confirm {job.strategy.planning.confirm}: the trial runs are not made in a dry run", flush=True)
        job = dataclasses.replace(job, strategy=searched.strategy, train=searched.config)
    checked = check(job)
    _print_plan(job, searched or checked, build, gated=searched is None, force=force)


def _print_plan(job: JobConfig, resolved: Resolved, build: Callable, *, gated: bool, force: bool) -> None:
    """The start banner's lines (as the Trainer prints them), the engine, the plan, and the memory estimate."""
    parts = estimate_parts(job) or build()
    strategy, config = resolved.strategy, resolved.config
    params = sum(p.numel() for p in {id(p): p for p in parts.model.parameters()}.values())
    world = job.launch.nproc
    lines = [f"autopar {__version__}: {world} process(es), strategy dp={strategy.dp} "  # as the Trainer's banner
             f"tp={strategy.stage_tp or strategy.tp} pp={strategy.pp}{f' cp={strategy.cp}' if strategy.cp > 1 else ''}, "
             f"{params:,} parameters, {resolved.accumulation} micro-batch(es) of {config.micro_batch_size} per replica per step",
             f"run folder: {job.train.out or 'runs/<start time> (made when the run starts)'}"]
    lines += [f"{k}: {v}" for k, v in parts.run_info.items() if k in ("corpus", "model", "data", "tokenizer",
                                                                       "pretrained")]
    lines.append(f"engine: {resolved.entry.name}")
    if resolved.plan is not None:
        lines.append(resolved.plan.describe())
    verdict = estimate(job, resolved, lambda: parts, suggest=True)
    lines += verdict.lines
    if verdict.refusal is not None and gated and not force:
        print("\n".join(lines), flush=True)
        raise ConfigError(verdict.refusal)
    if verdict.warning is not None:
        lines.append(f"warning: {verdict.warning}")
    if verdict.refusal is not None:
        lines.append("warning: predicted not to fit; " + ("--force starts it anyway" if gated else
                                                          "not refused: the strategy was chosen by the search or a "
                                                          "saved plan"))
    lines.append(f"dry run: every check passed; without --dry-run `autopar train` would start {world} process(es)")
    print("\n".join(lines), flush=True)
