"""What combines with what: one table of rules, checked once before any process starts.

Why a table: the refusals used to sit in the strategy, the strategy table, each engine and the search,
each with its own wording and order. A rule here says when it applies (a predicate on the user's
choices), why, and what the user can do; `check_rules` raises one ConfigError naming the first
broken rule, and `rules_matrix.py` renders the same table as the README's compatibility matrix,
so the docs and the checks cannot drift apart. A new refusal is one `Rule` entry.

Field values alone ("must be one of") stay in Strategy.resolved / TrainConfig.validate; checks that
need the traced model (running statistics, tensor-parallel widths) run in the launcher's trace.
Texts are format strings over `s` (the strategy), `c` (the train config), `setup` and the rule's
`detail(setup)`; the matrix shows their fields as <name>.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ..errors import ConfigError
from .rule_setup import Setup
from .schedules import SCHEDULE_TABLE, ScheduleSpec
from .strategy import Strategy

ZERO_OPTIMIZERS = ("adamw", "adam", "adagrad")  # element-wise per-parameter state: worth sharding


@dataclass(frozen=True)
class Rule:
    """One refusal: `broken(setup)` holds when the combination cannot run."""

    name: str
    when: str  # the combination refused, in words (the matrix's column)
    broken: Callable[[Setup], bool]
    seen: str  # what was given, with the values seen
    why: str
    fix: str  # what would work
    detail: Callable[[Setup], dict] = field(default=lambda setup: {})  # extra values for the texts
    phase: str = "layout"  # "layout": on the resolved strategy; "search": on the user's choices, before a search

    def message(self, setup: Setup) -> str:
        # the texts name options by their flags' flat names ({s.schedule}, {s.dp_mode})
        values = {"s": SimpleNamespace(**setup.strategy.flat()), "c": setup.config, "setup": setup, **self.detail(setup)}
        seen, why, fix = (text.format_map(values) for text in (self.seen, self.why, self.fix))
        return f"{seen}: {why}; {fix} (rule {self.name})"


def check_rules(setup: Setup, *, phase: str = "layout", rules: Sequence[Rule] | None = None) -> None:
    """Raise one ConfigError for the first broken rule of `phase`, in table order."""
    for rule in RULES if rules is None else rules:
        if rule.phase == phase and rule.broken(setup):
            raise ConfigError(rule.message(setup))


def _names(predicate: Callable[[ScheduleSpec], bool]) -> str:
    return ", ".join(spec.name for spec in SCHEDULE_TABLE if predicate(spec))


_STAGE_TP = "--stage-tp {s.stage_tp} (stages of different tp degrees) cannot be combined with"
_BOUNDARY = "--boundary {s.boundary} (planned transfers between pipeline stages)"
_NO_FLUSH = "schedule {s.schedule!r} cannot be combined with"
_ZERO3_STAGES = "--zero 3 with pp={s.pp} tp={s.tp} cannot be combined with"
_AUTO = "--strategy auto with"
_AUTO_WHY = "the search covers synchronous data, tensor and pipeline parallelism, and {flag} is outside it"
_AUTO_FIX = "use {want}, or choose the strategy yourself without --strategy auto"


def _stage_tp(s: Strategy) -> bool:
    return s.stage_tp is not None


def _zero3_stages(setup: Setup) -> bool:
    s = setup.strategy
    return s.replicas.zero == 3 and (s.pp > 1 or s.tp > 1)


def _searched(setup: Setup) -> bool:
    return setup.strategy.planning.mode == "auto" and not setup.strategy.planning.plan


def _no_flush(setup: Setup) -> bool:
    return not setup.spec.flushes


RULES: tuple[Rule, ...] = (
    # ---- what the search covers (checked on the user's choices, before it runs)
    Rule("search-scope", "--strategy auto beside --dp-mode gossip|async, --sparse-embeddings, --tp-subbatches, "
         "--boundary other than direct, --recompute all-but-last, --memory-budget-mb or --optimizer sparse-adam",
         lambda setup: _searched(setup) and _outside_search(setup) is not None,
         _AUTO + " {flag}", _AUTO_WHY, _AUTO_FIX,
         detail=lambda setup: dict(zip(("flag", "want"), _outside_search(setup) or ("", ""))), phase="search"),
    Rule("stage-tp-search", "--stage-tp with --strategy auto or --plan",
         lambda setup: _stage_tp(setup.strategy) and (setup.strategy.planning.mode != "manual"
                                                      or setup.strategy.planning.plan is not None),
         _STAGE_TP + " --strategy auto / --plan", "the search does not choose per-stage degrees yet",
         "give the degrees by hand", phase="search"),
    # ---- stages of different tp degrees, planned boundaries
    Rule("stage-tp-chunks", "--stage-tp with --chunks > 1",
         lambda setup: _stage_tp(setup.strategy) and setup.strategy.pipeline.chunks > 1,
         _STAGE_TP + " --chunks {s.chunks}", "interleaving puts several stages, so several tp degrees, on one rank",
         "use --chunks 1"),
    Rule("stage-tp-schedule", "--stage-tp with a schedule that does not run planned boundaries",
         lambda setup: _stage_tp(setup.strategy) and not setup.spec.stage_tp,
         _STAGE_TP + " --schedule {s.schedule}",
         "its stages exchange boundary tensors through the direct transport only, which needs equal layouts",
         f"use one of {_names(lambda spec: spec.stage_tp)}"),
    Rule("stage-tp-subbatches", "--stage-tp with --tp-subbatches > 1",
         lambda setup: _stage_tp(setup.strategy) and setup.strategy.pipeline.tp_subbatches > 1,
         _STAGE_TP + " --tp-subbatches {s.tp_subbatches}", "sub-pipelining is written for one tp degree",
         "use 1"),
    Rule("stage-tp-zero", "--stage-tp with --zero > 0",
         lambda setup: _stage_tp(setup.strategy) and setup.strategy.replicas.zero != 0,
         _STAGE_TP + " --zero {s.zero}", "not tested across stages of different degrees yet", "use --zero 0"),
    Rule("stage-tp-dp-mode", "--stage-tp with --dp-mode gossip|async",
         lambda setup: _stage_tp(setup.strategy) and setup.strategy.replicas.mode != "allreduce",
         _STAGE_TP + " --dp-mode {s.dp_mode}", "its replicas sum gradients synchronously",
         "use --dp-mode allreduce"),
    Rule("stage-tp-sparse", "--stage-tp with --sparse-embeddings allgather|embrace",
         lambda setup: _stage_tp(setup.strategy) and setup.strategy.sparse.mode != "dense",
         _STAGE_TP + " --sparse-embeddings {s.sparse_embeddings}", "sparse tables are data-parallel only",
         "use dense"),
    Rule("stage-tp-memory-budget", "--stage-tp with --memory-budget-mb",
         lambda setup: _stage_tp(setup.strategy) and setup.strategy.pipeline.memory_budget_mb is not None,
         _STAGE_TP + " --memory-budget-mb", "stage-aware recomputation plans one tp degree",
         "use --recompute instead"),
    Rule("boundary-needs-pipeline", "--boundary other than direct with pp < 2",
         lambda setup: setup.strategy.pipeline.boundary != "direct" and setup.strategy.pp < 2,
         _BOUNDARY + " needs a pipeline, got pp={s.pp}", "there is no stage boundary to plan",
         "use --pp 2 or more (or --stage-tp), or --boundary direct"),
    Rule("boundary-chunks", "--boundary other than direct with --chunks > 1",
         lambda setup: setup.strategy.pipeline.boundary != "direct" and setup.strategy.pipeline.chunks != 1,
         _BOUNDARY + " cannot be combined with --chunks {s.chunks}", "it moves one stage per rank",
         "use --chunks 1 or --boundary direct"),
    Rule("boundary-schedule", "--boundary other than direct with a schedule that does not run planned boundaries",
         lambda setup: setup.strategy.pipeline.boundary != "direct" and not setup.spec.stage_tp,
         _BOUNDARY + " cannot be combined with --schedule {s.schedule}",
         "its stages exchange tensors through the direct transport only",
         f"use one of {_names(lambda spec: spec.stage_tp)} or --boundary direct"),
    # ---- options that belong to one mode
    Rule("vertical-sync-needs-pipedream", "--vertical-sync without --schedule pipedream",
         lambda setup: setup.strategy.pipeline.vertical_sync and setup.strategy.pipeline.schedule != "pipedream",
         "strategy.vertical_sync (--vertical-sync) belongs to --schedule pipedream (weight stashing), got "
         "--schedule {s.schedule}", "other schedules keep no stashed weight versions to synchronise",
         "drop it or use --schedule pipedream"),
    Rule("tied-delay-needs-pipedream", "--tied-delay without --schedule pipedream",
         lambda setup: setup.strategy.pipeline.tied_delay is not None and setup.strategy.pipeline.schedule != "pipedream",
         "strategy.tied_delay (--tied-delay) belongs to --schedule pipedream (weight stashing), got "
         "--schedule {s.schedule}", "other schedules sum a tied weight's gradient within the step",
         "drop it or use --schedule pipedream"),
    Rule("sparse-schedule-needs-embrace", "--sparse-schedule without --sparse-embeddings embrace",
         lambda setup: setup.strategy.sparse.schedule and setup.strategy.sparse.mode != "embrace",
         "--sparse-schedule with --sparse-embeddings {s.sparse_embeddings}",
         "it schedules the row exchange of sharded tables, so it needs --sparse-embeddings embrace",
         "add --sparse-embeddings embrace or drop --sparse-schedule"),
    Rule("sparse-exchange-needs-allreduce", "--sparse-embeddings allgather|embrace with --dp-mode gossip|async",
         lambda setup: setup.strategy.sparse.mode != "dense" and setup.strategy.replicas.mode != "allreduce",
         "--sparse-embeddings {s.sparse_embeddings} with --dp-mode {s.dp_mode}",
         "the sparse exchange replaces the synchronous all-reduce of the embedding tables; gossip and the "
         "parameter server move whole parameters their own way and would leave the choice unused",
         "use --sparse-embeddings dense with --dp-mode {s.dp_mode}, or --dp-mode allreduce"),
    # ---- memory: bf16 master weights and ZeRO run over synchronous all-reduce replicas
    Rule("bf16-needs-allreduce", "--dtype bf16 with gossip, the parameter server or sparse embeddings",
         lambda setup: setup.config.dtype == "bf16" and setup.other_dp_mode is not None,
         "--dtype bf16 with {mode}", "bf16 parameters with fp32 master weights are kept by the all-reduce "
         "engines only", "use --dtype bf16-autocast there, or the default all-reduce data parallelism",
         detail=lambda setup: {"mode": setup.other_dp_mode}),
    Rule("no-flush-memory", "--schedule pipedream|pipedream-2bw with --zero > 0 or --dtype bf16",
         lambda setup: _no_flush(setup) and (setup.strategy.replicas.zero or setup.config.dtype == "bf16"),
         "--schedule {s.schedule} with --zero {s.zero} / --dtype {c.dtype}",
         "it keeps several whole weight versions per stage, which do not combine with sharded or bf16 master "
         "weights yet", "use --zero 0 and --dtype fp32 or bf16-autocast, or a flushing schedule such as 1f1b"),
    Rule("zero-needs-allreduce", "--zero > 0 with gossip, the parameter server or sparse embeddings",
         lambda setup: setup.strategy.replicas.zero and setup.other_dp_mode is not None,
         "--zero {s.zero} with {mode}", "ZeRO shards optimizer state over synchronous all-reduce replicas",
         "use --zero 0, or drop that mode", detail=lambda setup: {"mode": setup.other_dp_mode}),
    Rule("zero-needs-replicas", "--zero > 0 with dp = 1",
         lambda setup: setup.strategy.replicas.zero and setup.strategy.dp == 1,
         "--zero {s.zero} with dp=1 (tp={s.tp} pp={s.pp})",
         "ZeRO shards over data-parallel replicas: there is nothing to shard over",
         "use --zero 0, or more processes for dp"),
    Rule("zero-needs-optimizer-state", f"--zero > 0 with an optimizer other than {', '.join(ZERO_OPTIMIZERS)}",
         lambda setup: setup.strategy.replicas.zero and setup.config.optimizer not in ZERO_OPTIMIZERS,
         "--zero {s.zero} with --optimizer {c.optimizer}",
         "ZeRO shards per-parameter optimizer state and this optimizer has none (plain SGD without momentum): "
         "sharding saves nothing", f"use --zero 0, or an optimizer with state: {', '.join(ZERO_OPTIMIZERS)}"),
    Rule("zero-3-stage-chunks", "--zero 3 with pp or tp, and --chunks > 1",
         lambda setup: _zero3_stages(setup) and setup.strategy.pipeline.chunks > 1,
         _ZERO3_STAGES + " --chunks {s.chunks}",
         "one FSDP2 unit per stage, and a rank's stages may share a tied weight",
         "use --chunks 1, or --zero 2 (optimizer state and gradients sharded)"),
    Rule("zero-3-stage-schedule", "--zero 3 with pp or tp, and a split-backward schedule",
         lambda setup: _zero3_stages(setup) and not setup.spec.zero3_stages,
         _ZERO3_STAGES + " --schedule {s.schedule}",
         "its weight-gradient pass (W) runs after FSDP2 has resharded the stage at the end of the "
         "input-gradient pass (I) (tried: the ranks hang)",
         f"use one of {_names(lambda spec: spec.zero3_stages)}, or --zero 2 (optimizer state and gradients "
         f"sharded)"),
    # ---- the no-flush pipelines (PipeDream-2BW, PipeDream): plain 1F1B stages over all-reduce replicas
    Rule("no-flush-dp-mode", "--schedule pipedream|pipedream-2bw with --dp-mode gossip|async",
         lambda setup: _no_flush(setup) and setup.strategy.replicas.mode != "allreduce",
         _NO_FLUSH + " --dp-mode {s.dp_mode}", "its replicas sum each step's gradient synchronously (a "
         "parameter server or gossip would add a second, different staleness)", "use --dp-mode allreduce"),
    Rule("no-flush-chunks", "--schedule pipedream|pipedream-2bw with --chunks > 1",
         lambda setup: _no_flush(setup) and setup.strategy.pipeline.chunks > 1,
         _NO_FLUSH + " --chunks {s.chunks} (interleaving)", "the no-flush lists are 1F1B with one stage per rank",
         "use --chunks 1"),
    Rule("no-flush-tp", "--schedule pipedream|pipedream-2bw with tp > 1",
         lambda setup: _no_flush(setup) and setup.strategy.tp > 1,
         _NO_FLUSH + " --tp {s.tp}", "tensor-parallel stages with two weight versions are not supported yet (the "
         "older version would need saving as slices)", "use --tp 1"),
    Rule("no-flush-recompute", "--schedule pipedream|pipedream-2bw with --recompute or --memory-budget-mb",
         lambda setup: _no_flush(setup) and (setup.strategy.pipeline.recompute != "none"
                                             or setup.strategy.pipeline.memory_budget_mb is not None),
         _NO_FLUSH + " recomputation (--recompute {s.recompute}, --memory-budget-mb {s.memory_budget_mb})",
         "SCP's ingredient is not supported with the no-flush lists yet", "use --recompute none"),
    Rule("no-flush-sparse", "--schedule pipedream|pipedream-2bw with sparse embeddings or sparse-adam",
         lambda setup: _no_flush(setup) and setup.sparse,
         _NO_FLUSH + " sparse embeddings / sparse-adam", "their deferred rows assume synchronous steps",
         "use dense embeddings"),
    Rule("two-bw-whole-model-resume", "--schedule pipedream-2bw with pp = 1 and --resume",
         lambda setup: setup.strategy.pipeline.schedule == "pipedream-2bw" and setup.strategy.pp == 1
         and bool(setup.config.resume),
         _NO_FLUSH + " --resume with pp=1", "the whole-model 2BW rule keeps its older version outside the "
         "checkpoint", "resume a pipelined (pp > 1) run"),
    # ---- data-parallel-only modes
    Rule("gossip-data-parallel-only", "--dp-mode gossip with pp > 1 or tp > 1",
         lambda setup: setup.strategy.replicas.mode == "gossip" and (setup.strategy.pp > 1 or setup.strategy.tp > 1),
         "--dp-mode gossip is data-parallel only, got pp={s.pp} tp={s.tp}",
         "every replica holds the whole model and averages it with its neighbours",
         "use pp=1 tp=1, or --dp-mode allreduce"),
    Rule("parameter-server-whole-model", "--dp-mode async with pp > 1 or tp > 1",
         lambda setup: setup.strategy.replicas.mode == "async" and (setup.strategy.pp > 1 or setup.strategy.tp > 1),
         "dp_mode=async with pp={s.pp} tp={s.tp}", "it trains the whole model on every worker; it does not "
         "combine with pp={s.pp} tp={s.tp}", "use pp=1 tp=1 (or dp_mode=allreduce)"),
    Rule("parameter-server-workers", "--dp-mode async with --servers >= the number of processes",
         lambda setup: setup.strategy.replicas.mode == "async" and setup.strategy.replicas.servers >= setup.world,
         "--servers {s.servers} with {setup.world} process(es) leaves no worker",
         "the parameter server takes {s.servers} process(es) and needs at least one more to train",
         "use --servers <= {most} or --nproc >= {least}",
         detail=lambda setup: {"most": max(1, setup.world - 1), "least": setup.strategy.replicas.servers + 1}),
    Rule("parameter-server-sgd", "--dp-mode async with an optimizer other than sgd",
         lambda setup: setup.strategy.replicas.mode == "async" and setup.config.optimizer != "sgd",
         "dp_mode=async", "the servers apply every pushed gradient with plain SGD (the rule asynchronous SGD is "
         "defined for), got --optimizer {c.optimizer}",
         "use --optimizer sgd"),
    Rule("parameter-server-runs-once", "--dp-mode async with --resume, --checkpoint-every or --eval-every",
         lambda setup: setup.strategy.replicas.mode == "async" and _async_unsupported(setup) is not None,
         "dp_mode=async does not support {flag} yet, got {value!r}",
         "workers run ahead of each other; the run evaluates and checkpoints once, at the end",
         "drop {flag}", detail=lambda setup: dict(zip(("flag", "value"), _async_unsupported(setup) or ("", "")))),
    Rule("sparse-data-parallel-only", "--sparse-embeddings allgather|embrace with pp > 1 or tp > 1",
         lambda setup: setup.strategy.sparse.mode != "dense" and (setup.strategy.pp > 1
                                                                        or setup.strategy.tp > 1),
         "--sparse-embeddings {s.sparse_embeddings} with pp={s.pp} tp={s.tp}",
         "sparse tables work with data parallelism only", "use pp=1 tp=1 or --sparse-embeddings dense"),
    Rule("sparse-cpu-only", "sparse embeddings or sparse-adam with --device cuda",
         lambda setup: setup.sparse and setup.config.device != "cpu",
         "--sparse-embeddings / sparse-adam with device {c.device}", "they run on CPU (gloo) in this version",
         "use --device cpu"),
    Rule("sparse-schedule-clipping", "--sparse-schedule with --grad-clip > 0",
         lambda setup: setup.strategy.sparse.schedule and setup.strategy.sparse.mode == "embrace"
         and setup.config.grad_clip > 0,
         "--sparse-schedule with --grad-clip {c.grad_clip}", "it defers part of the table gradient past the step, "
         "so the global gradient norm is not known when clipping would need it", "use --grad-clip 0"),
    Rule("sparse-resume", "sparse embeddings or sparse-adam with --resume",
         lambda setup: setup.sparse and bool(setup.config.resume),
         "--resume with --sparse-embeddings {s.sparse_embeddings} / --optimizer {c.optimizer}",
         "checkpoints hold per-rank table shards, which cannot be resumed yet", "start a new run"),
    Rule("traced-forward", "a custom forward_fn with pp > 1 or tp > 1",
         lambda setup: setup.custom_forward and (setup.strategy.pp > 1 or setup.strategy.tp > 1),
         "a custom forward_fn cannot be used with pp={s.pp} tp={s.tp}", "the model is traced as the default forward calls it "
         "(main input 'input_ids' or 'inputs', every other non-label field as a keyword)",
         "drop forward_fn, or use data parallelism only"),
    Rule("pretrained-synchronous", "pretrained weights with --dp-mode gossip|async or sparse embeddings",
         lambda setup: setup.pretrained and (setup.strategy.replicas.mode != "allreduce"
                                             or setup.strategy.sparse.mode != "dense"),
         "pretrained weights with dp_mode={s.dp_mode!r} sparse_embeddings={s.sparse_embeddings!r}",
         "pretrained weights load under synchronous layouts (dp, tp, pp and their products)",
         "use --dp-mode allreduce --sparse-embeddings dense"),
    # ---- micro-batches (these read the batch split, so they come last)
    Rule("pipedream-one-microbatch", "--schedule pipedream with more than one micro-batch per replica",
         lambda setup: setup.spec.microbatches == "one" and setup.microbatches != 1,
         "schedule {s.schedule!r} with global batch {c.global_batch_size}: {setup.microbatches} micro-batches of "
         "{setup.micro_config.micro_batch_size} per replica (dp={s.dp})", "it updates after every micro-batch "
         "(the paper's semantics: one optimizer step is one micro-batch per replica)",
         "set --global-batch-size to micro-batch size x dp = {one_each}",
         detail=lambda setup: {"one_each": setup.micro_config.micro_batch_size * setup.strategy.dp}),
    Rule("tp-subbatches-need-tp", "--tp-subbatches > 1 with tp = 1",
         lambda setup: setup.strategy.pipeline.tp_subbatches > 1 and setup.strategy.tp == 1,
         "strategy.tp_subbatches={s.tp_subbatches} with tp=1", "it splits tensor-parallel stages",
         "use --tp 2 or more, or --tp-subbatches 1"),
    Rule("tp-subbatches-divide", "--tp-subbatches that does not divide the micro-batch size",
         lambda setup: setup.strategy.pipeline.tp_subbatches > 1
         and setup.micro_config.micro_batch_size % setup.strategy.pipeline.tp_subbatches != 0,
         "strategy.tp_subbatches={s.tp_subbatches} does not divide micro_batch_size={size}",
         "each sub-batch must hold whole samples", "use one of {divisors} (or change the micro-batch size)",
         detail=lambda setup: {"size": (size := setup.micro_config.micro_batch_size),
                               "divisors": [d for d in range(1, size + 1) if size % d == 0]}),
    Rule("schedule-chunks", "a schedule with a --chunks it does not run",
         lambda setup: setup.pipelined and not setup.spec.accepts_chunks(setup.strategy.pipeline.chunks),
         "--schedule {s.schedule} with --chunks {s.chunks}", "it runs {runs} chunk(s) per rank", "{fix}",
         detail=lambda setup: {"runs": setup.spec.chunks_text(), "fix": _chunks_fix(setup)}),
    Rule("schedule-microbatches", "a schedule with fewer micro-batches per replica than it needs",
         lambda setup: setup.pipelined and setup.microbatches < setup.spec.minimum_microbatches(setup.strategy.pp),
         "--schedule {s.schedule} with pp={s.pp} and {setup.microbatches} micro-batch(es) per replica per step",
         "it needs at least pp={s.pp} micro-batches per replica per step ({reason})",
         "raise --global-batch-size or lower --micro-batch-size so that global_batch / (micro_batch * dp) >= "
         "{s.pp}", detail=lambda setup: {"reason": setup.spec.microbatches_why}),
    Rule("schedule-microbatch-groups", "interleaved 1F1B with micro-batches that are not a multiple of pp",
         lambda setup: setup.pipelined and setup.spec.microbatches == "multiple of pp"
         and setup.microbatches % setup.strategy.pp != 0,
         "--schedule {s.schedule} with pp={s.pp}",
         "it runs micro-batches in groups of pp={s.pp}, so num_microbatches must be a multiple of {s.pp}, got "
         "{setup.microbatches} per replica per step",
         "use e.g. {multiple} micro-batches per replica",
         detail=lambda setup: {"multiple": -(-setup.microbatches // setup.strategy.pp) * setup.strategy.pp}),
    # ---- interleaving needs something to interleave
    Rule("interleaved-one-chunk", "--schedule interleaved-1f1b with --chunks 1",
         lambda setup: setup.strategy.pp > 1 and setup.spec.generator == "interleaved" and setup.strategy.pipeline.chunks < 2,
         "--schedule {s.schedule} with --chunks {s.chunks} (pp={s.pp})",
         "interleaving alternates two or more stages (chunks) on each rank; with one chunk per rank it is plain "
         "1F1B under another name", "use --chunks 2 (or more), or --schedule 1f1b"),
    # ---- sequence parallelism (--sp: tensor_parallel/sequence.py)
    Rule("sp-needs-tp", "--sp with tp = 1",
         lambda setup: setup.strategy.sp and setup.strategy.tp == 1 and not _stage_tp(setup.strategy),
         "strategy.sp (--sp) with tp={s.tp}", "it splits the sequence over the tensor-parallel ranks",
         "use --tp 2 or more with --sp, or drop --sp"),
    Rule("sp-stage-tp", "--sp with --stage-tp",
         lambda setup: setup.strategy.sp and _stage_tp(setup.strategy),
         _STAGE_TP + " --sp", "stage boundaries between different tp degrees move whole tensors",
         "use one --tp for every stage, or drop --sp"),
    Rule("sp-subbatches", "--sp with --tp-subbatches > 1",
         lambda setup: setup.strategy.sp and setup.strategy.pipeline.tp_subbatches > 1,
         "strategy.sp (--sp) with --tp-subbatches {s.tp_subbatches}",
         "sub-pipelining splits the micro-batch, sequence parallelism the sequence, and the two are not "
         "written to combine", "use --tp-subbatches 1 with --sp, or drop --sp"),
    Rule("sp-boundary", "--sp with --boundary other than direct",
         lambda setup: setup.strategy.sp and setup.strategy.pipeline.boundary != "direct",
         "strategy.sp (--sp) with " + _BOUNDARY, "planned boundaries assume every tp rank holds the whole tensor, "
         "and under --sp each holds its slice of the sequence", "use --boundary direct with --sp"),
    # ---- expert parallelism (--ep)
    Rule("ep-divides-dp", "--ep that does not divide dp",
         lambda setup: setup.strategy.ep > 1 and setup.strategy.dp is not None
         and setup.strategy.dp % setup.strategy.ep != 0,
         "--ep {s.ep} with dp={s.dp}", "the ep ranks of an expert group are taken from the data-parallel ranks, "
         "so ep must divide dp", "use an --ep that divides {s.dp} (e.g. --ep {fit}), or change --nproc",
         detail=lambda setup: {"fit": max(d for d in range(1, setup.strategy.dp + 1)
                                          if setup.strategy.dp % d == 0 and d <= setup.strategy.ep)}),
    Rule("ep-within-uniform-stages", "--ep > 1 with --stage-tp, --cp, --sp, --tp-subbatches or a split-backward "
         "schedule",
         lambda setup: setup.strategy.ep > 1 and (setup.strategy.stage_tps is not None or setup.strategy.cp > 1
                                                  or setup.strategy.sp or setup.strategy.pipeline.tp_subbatches > 1
                                                  or setup.spec.split_backward),
         "--ep {s.ep} with {other}", "expert parallelism composes with dp, pp and tp of equal stages: its all-to-all "
         "needs every rank of an expert group to run the same stage on whole micro-batches, with one autograd node "
         "per exchange", "drop {other}, or use --ep 1",
         detail=lambda setup: {"other": "--stage-tp" if setup.strategy.stage_tps is not None else
                               f"--cp {setup.strategy.cp}" if setup.strategy.cp > 1 else "--sp" if setup.strategy.sp
                               else f"--tp-subbatches {setup.strategy.pipeline.tp_subbatches}"
                               if setup.strategy.pipeline.tp_subbatches > 1
                               else f"--schedule {setup.strategy.pipeline.schedule}"}),
    Rule("ep-synchronous-dense", "--ep > 1 with ZeRO, gossip, the parameter server, sparse embeddings or PipeDream",
         lambda setup: setup.strategy.ep > 1 and (setup.strategy.replicas.zero > 0 or setup.other_dp_mode is not None
                                                  or setup.strategy.pipeline.schedule in ("pipedream", "pipedream-2bw")),
         "--ep {s.ep} with {other}", "expert parallelism runs in the synchronous data-parallel and pipeline engines, "
         "whose dense gradients are all-reduced whole", "drop {other}, or use --ep 1",
         detail=lambda setup: {"other": setup.other_dp_mode or (f"--zero {setup.strategy.replicas.zero}"
                                                                 if setup.strategy.replicas.zero else
                                                                 f"--schedule {setup.strategy.pipeline.schedule}")}),
    Rule("ep-fp32-weights", "--ep > 1 with --dtype bf16",
         lambda setup: setup.strategy.ep > 1 and setup.config.dtype == "bf16",
         "--ep {s.ep} with --dtype bf16", "the expert-parallel engine keeps fp32 weights (bf16 weights need the "
         "fp32 masters of ZeRO's sharded optimizer, which it does not use)", "use --dtype bf16-autocast or fp32"),
    # ---- --compile (train/compile.py): what a compiled region cannot run under
    Rule("compile-split-backward", "--compile with a split-backward schedule (zb-h1, zbv)",
         lambda setup: setup.config.compile and setup.spec.split_backward,
         "--compile with --schedule {s.schedule}",
         "its input- and weight-gradient passes (I, W) are cut from each matmul's own autograd node and its saved "
         "tensors, and a compiled block is one autograd node whose backward computes both at once",
         f"use one of {_names(lambda spec: spec.flushes and not spec.split_backward)}, or leave out --compile"),
    Rule("compile-no-flush", "--compile with --schedule pipedream|pipedream-2bw",
         lambda setup: setup.config.compile and not setup.spec.flushes,
         "--compile with --schedule {s.schedule}",
         "its stages swap stashed weight versions into the modules between micro-batches, which the compiled "
         "regions' guards would see as new modules (a recompilation per version)",
         "use a synchronous schedule (1f1b, gpipe, ...), or leave out --compile"),
    # ---- context parallelism (--cp): the sequence split over ranks
    Rule("cp-plan", "--cp > 1 with --plan",
         lambda setup: setup.strategy.cp > 1 and setup.strategy.planning.plan is not None,
         "--cp {s.cp} with --plan", "a plan file holds its own degrees, cp among them",
         "drop --cp (the plan's cp runs), or use --strategy auto --cp {s.cp} to search the rest", phase="search"),
    Rule("cp-tp", "--cp > 1 with --stage-tp or --tp-subbatches > 1",
         lambda setup: setup.strategy.cp > 1 and (setup.strategy.stage_tp is not None
                                                  or setup.strategy.pipeline.tp_subbatches > 1),
         "--cp {s.cp} with {flag}", "context parallelism composes with one tp degree for every stage, each tp rank's "
         "heads exchanged within its cp group; per-stage degrees and sub-pipelined tp are not checked with it yet",
         "use one --tp for all stages, without --tp-subbatches",
         detail=lambda setup: {"flag": f"--stage-tp {setup.strategy.stage_tp}" if setup.strategy.stage_tp
                               else f"--tp-subbatches {setup.strategy.pipeline.tp_subbatches}"}),
    Rule("cp-engine", "--cp > 1 with ZeRO, gossip or asynchronous replicas, PipeDream or zero-bubble schedules or "
         "sparse embeddings", lambda setup: setup.strategy.cp > 1 and _cp_conflict(setup) is not None,
         "--cp {s.cp} with {flag}", "context parallelism runs in the synchronous pipeline engine with whole "
         "backward passes, summing gradients over dp x cp; that choice is not checked with it yet", "use {want}",
         detail=lambda setup: dict(zip(("flag", "want"), _cp_conflict(setup) or ("", "")))),
    Rule("cp-loss", "--cp > 1 with a loss_fn of the Trainer's own",
         lambda setup: setup.strategy.cp > 1 and setup.custom_loss,
         "--cp {s.cp} with a loss_fn of one's own", "each cp rank holds part of every sequence, and a loss_fn is a "
         "mean over whole samples", "drop loss_fn (the built-in token loss follows the split) or use --cp 1"),
    Rule("cp-forward", "--cp > 1 with a forward_fn of the Trainer's own",
         lambda setup: setup.strategy.cp > 1 and setup.custom_forward,
         "--cp {s.cp} with a custom forward_fn", "the traced model runs on each rank's share of the sequence, and a "
         "forward of one's own would see whole batches", "drop forward_fn (batch fields reach the model as keywords)"),
    # ---- uneven batch shares per replica (data/shares.py)
    Rule("dp-shares-data-parallel", "--dp-shares other than even with --chunks, tp, cp, ep, --stage-tp, "
         "--tp-subbatches, --boundary, ZeRO, gossip or asynchronous replicas, sparse embeddings, a schedule other "
         "than 1f1b, gpipe or eager-1f1b, or --strategy auto",
         lambda setup: setup.strategy.replicas.shares != "even" and _shares_conflict(setup) is not None,
         "--dp-shares {s.dp_shares} with {flag}", "uneven shares give replicas (whole models or pipelines of "
         "tp=1 stages) "
         "different numbers of micro-batches, whose gradients are summed; that choice is not checked with it yet",
         "use {want}, or --dp-shares even",
         detail=lambda setup: dict(zip(("flag", "want"), _shares_conflict(setup) or ("", ""))), phase="search"),
)


def _shares_conflict(setup: Setup) -> tuple[str, str] | None:
    """The first choice uneven replica shares do not run with, as (flag with value, what would work)."""
    s = setup.strategy
    for flag, value, want in (("--chunks", s.pipeline.chunks, 1), ("--tp", s.tp, 1), ("--cp", s.cp, 1),
                              ("--ep", s.ep, 1),
                              ("--tp-subbatches", s.pipeline.tp_subbatches, 1), ("--boundary", s.pipeline.boundary,
                                                                                  "direct"),
                              ("--stage-tp", s.stage_tp, None), ("--dp-mode", s.replicas.mode, "allreduce"),
                              ("--sparse-embeddings", s.sparse.mode, "dense"), ("--strategy", s.planning.mode,
                                                                                "manual")):
        if value != want:
            return f"{flag} {value}", f"{flag} {want}"
    if s.replicas.zero:
        return f"--zero {s.replicas.zero}", "--zero 0"
    if s.pipeline.schedule not in ("1f1b", "gpipe", "eager-1f1b"):
        return f"--schedule {s.pipeline.schedule}", "--schedule 1f1b, gpipe or eager-1f1b"
    if setup.sparse:
        return f"--optimizer {setup.config.optimizer}", "--optimizer adamw"
    return None


def _outside_search(setup: Setup) -> tuple[str, str] | None:
    """The first choice outside the search's space, as (flag with value, what would work)."""
    s, c = setup.strategy, setup.config
    for flag, value, want in (("--dp-mode", s.replicas.mode, "allreduce"), ("--sparse-embeddings", s.sparse.mode,
                              "dense"), ("--tp-subbatches", s.pipeline.tp_subbatches, 1),
                              ("--boundary", s.pipeline.boundary, "direct")):
        if value != want:
            return f"{flag} {value}", str(want)
    if s.pipeline.recompute == "all-but-last":
        return "--recompute all-but-last", "none or all"
    if s.pipeline.memory_budget_mb is not None:
        return f"--memory-budget-mb {s.pipeline.memory_budget_mb}", "unset (use --memory-per-device-gb)"
    if c.optimizer == "sparse-adam":
        return "--optimizer sparse-adam", "adamw"
    return None


def _cp_conflict(setup: Setup) -> tuple[str, str] | None:
    """The first choice context parallelism does not run with, as (flag with value, what would work)."""
    s = setup.strategy
    plain = not setup.spec.flushes or (setup.spec.split_backward and setup.pipelined)  # (zero-bubble: untested)
    for flag, value, want in (("--zero", s.replicas.zero, 0), ("--dp-mode", s.replicas.mode, "allreduce"),
                              ("--schedule", s.pipeline.schedule, "1f1b" if plain else s.pipeline.schedule),
                              ("--sparse-embeddings", s.sparse.mode, "dense")):
        if value != want:
            return f"{flag} {value}", f"{flag} {want}"
    if setup.sparse:
        return f"--optimizer {setup.config.optimizer}", "--optimizer adamw"
    return None


def _async_unsupported(setup: Setup) -> tuple[str, Any] | None:
    for name, flag in (("resume", "--resume"), ("checkpoint_every", "--checkpoint-every"),
                       ("eval_every", "--eval-every")):
        if getattr(setup.config, name):
            return flag, getattr(setup.config, name)
    return None


def _chunks_fix(setup: Setup) -> str:
    chunks = setup.strategy.pipeline.chunks
    others = [spec.name for spec in SCHEDULE_TABLE if spec.flushes and spec.accepts_chunks(chunks)]
    return f"use --chunks {setup.spec.chunks[0]}" + (f", or a schedule for {chunks} chunks per rank: "
                                                     f"{', '.join(others)}" if others else "")
