"""Typed run configuration.

A run is described by plain dataclasses, one per concern; every field carries its own
help text in `metadata["help"]`, from which the command-line flags and `--help` are
generated (see `cli.py`), so the docs and the flags cannot drift apart. A TOML file and
command-line flags compose: defaults < file < flags. Validation happens before any
process group exists, so every rank reports the same clear error and nobody hangs.

    [model]            name, args (a table of model arguments)
    [data]             corpus, tokenizer, seq_len
    [strategy]         dp, tp, pp
    [train]            steps, batch sizes, optimizer, schedule, checkpointing, output
    [launch]           nproc
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w

from .errors import ConfigError, choices


def _f(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with a default and its help text (shown by `--help`)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


# Valid choices, named once: the help texts below, the checks and the packages that implement
# them (pipeline/schedules.py, partition/plan.py, gossip/) all read these.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "eager-1f1b", "scp", "zb-h1", "zbv")
# No-flush schedules with stale weights (pipeline/async_schedules.py): not synchronous SGD, so
# never candidates of the strategy search, which reads SCHEDULES only.
ASYNC_SCHEDULES = ("pipedream-2bw", "pipedream")
PARTITION_METHODS = ("uniform", "parameters", "time")
RECOMPUTE_MODES = ("none", "all", "all-but-last")
GOSSIP_TOPOLOGIES = ("ring", "torus", "exponential", "complete")
GOSSIP_ORDERS = ("dpsgd", "atc")
DP_MODES = ("allreduce", "gossip", "async")
SPARSE_EMBEDDING_MODES = ("dense", "allgather", "embrace")
OPTIMIZERS = ("adamw", "sgd", "adagrad", "adam", "sparse-adam")
SPARSE_SHARDINGS = ("column", "row")
DEFAULT_CHECKPOINT_EVERY = 100  # steps; a restart or a preemption loses at most this much work
SEARCH_MODES = ("manual", "auto")
ZERO_LEVELS = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16", "bf16-autocast")
# How pipeline boundary tensors move (pipeline/hetero_boundary.py; the methods are resharding/planner.py's).
BOUNDARY_TRANSFERS = ("direct", "send_recv", "scatter_gather", "broadcast", "auto")


@dataclass(kw_only=True)
class Strategy:
    """How the model is spread over processes: degrees of data, tensor and pipeline parallelism.

    dp * tp * pp must equal the number of processes. Leave `dp` as None to use every
    process not taken by tp and pp for data parallelism.
    """

    dp: int | None = _f(None, "data-parallel degree (replicas); default: nproc / (tp * pp)")
    tp: int = _f(1, "tensor-parallel degree (shards of each layer; adjacent ranks)")
    pp: int = _f(1, "pipeline-parallel degree (stages)")
    stage_tp: str | None = _f(None, "per-stage tensor-parallel degrees, e.g. 2,4 (stage 0 tp=2, stage 1 tp=4): pp is "
                                    "the list's length and nproc = dp * their sum; all equal is the same as --tp")
    boundary: str = _f("direct", f"pipeline boundary transfers: {'|'.join(BOUNDARY_TRANSFERS)} (direct: whole tensor "
                                 "from one sender per receiver; the others are planned resharding, between --stage-tp "
                                 "stages or equal tp stages alike, auto the cheapest predicted on --cluster)")
    schedule: str = _f("1f1b", f"pipeline schedule: {'|'.join(SCHEDULES + ASYNC_SCHEDULES)}")
    vertical_sync: bool = _f(False, "--schedule pipedream: every stage runs a micro-batch on the weight version "
                                    "stage 0 used for it (one delay for all stages; up to pp versions per stage)")
    chunks: int = _f(1, "pipeline stages per rank (virtual stages; interleaved-1f1b needs >= 2, zbv exactly 2)")
    partition: str = _f("time", f"how to cut the model into stages: {'|'.join(PARTITION_METHODS)}")
    recompute: str = _f("none", f"whole-stage recomputation scheduled by the pipeline: {'|'.join(RECOMPUTE_MODES)}")
    memory_budget_mb: float | None = _f(None, "per-rank memory budget (MiB): recompute the fewest blocks of each "
                                              "stage that fit it (stage-aware recomputation)")
    tp_subbatches: int = _f(1, "sub-pipelined tensor parallelism: split each micro-batch of a tensor-parallel "
                                  "stage into K sub-batches so each tp all-reduce overlaps the next sub-batch's "
                                  "compute (Merak); must divide the micro-batch size")
    zero: int = _f(0, "ZeRO level over each dp group: 0 (replicated), 1 (optimizer state sharded), 2 (and "
                      "gradients), 3 (and parameters, FSDP2; dp only)")
    # How data-parallel replicas combine their work (synchronous all-reduce by default).
    dp_mode: str = _f("allreduce", "how replicas combine gradients: allreduce (synchronous) | gossip (D-PSGD: "
                                   "average with neighbours only) | async (parameter server, bounded staleness)")
    topology: str = _f("ring", f"gossip graph: {'|'.join(GOSSIP_TOPOLOGIES)} (Metropolis weights), or a text file "
                               "holding the n x n doubly-stochastic mixing matrix, one row per line")
    gossip_order: str = _f("dpsgd", "gossip update order: dpsgd (gradient at the local model while mixing, "
                                    "Lian et al.) | atc (adapt, then combine)")
    staleness: int = _f(0, "parameter server: how many steps a worker's parameters may lag (0: synchronous)")
    servers: int = _f(1, "parameter server: processes holding parameter shards (taken from nproc)")
    # How embedding tables' gradients travel between replicas (EmbRace).
    sparse_embeddings: str = _f("dense", "embedding-table exchange: dense (all-reduce) | allgather (sparse "
                                         "all-gather) | embrace (sharded tables, AlltoAll lookups)")
    sparse_threshold: float = _f(0.1, "a table whose measured fraction of rows touched per step is below this "
                                      "is sparse")
    sparse_sharding: str = _f("column", f"how embrace shards sparse tables over replicas: {'|'.join(SPARSE_SHARDINGS)}")
    sparse_schedule: bool = _f(False, "embrace: 2D communication scheduling (rows the next step reads are exchanged "
                                      "and updated first, the rest deferred; needs grad_clip 0)")
    # Letting autopar choose (search/auto.py): the fields above that are left at their defaults are searched.
    search: str = _f("manual", f"{'|'.join(SEARCH_MODES)}: auto searches dp, tp, pp, micro-batching, schedule, chunks, "
                               "recomputation and cut for this model and nproc before any process starts (degrees "
                               "and a schedule given beside it stay fixed) and writes plan.json into the run folder",
                     flag="--strategy")
    plan: str | None = _f(None, "a saved plan (plan.json of a run folder, or `autopar plan --auto --json` output) to "
                                "run as it is; flags that contradict it are refused")
    cluster: str | None = _f(None, "--strategy auto and --boundary auto: cluster TOML (autopar calibrate) or preset "
                                   "name; default cpu-local")
    memory_per_device_gb: float | None = _f(None, "--strategy auto: memory per device to plan for (GiB); default: "
                                                  "the cluster's")
    confirm: int = _f(0, "--strategy auto: run the top K plans for a few steps each and keep the fastest measured")

    @classmethod
    def auto(cls, *, cluster: str | None = None, memory_per_device_gb: float | None = None, **fixed: Any) -> Strategy:
        """A strategy the search picks when training starts (search/auto.py); `fixed` fields (e.g. pp=2) stay as
        given and the rest are searched: `Trainer(model, data, strategy=Strategy.auto(pp=2))`."""
        return cls(search="auto", cluster=cluster, memory_per_device_gb=memory_per_device_gb, **fixed)

    @property
    def stage_tps(self) -> tuple[int, ...] | None:
        """The per-stage tp degrees when they differ (after resolved()); None for a uniform tp."""
        return parse_stage_tp(self.stage_tp) if self.stage_tp is not None else None

    def resolved(self, world_size: int) -> Strategy:
        """Fill in dp from the world size and check that the degrees fit it."""
        if self.boundary not in BOUNDARY_TRANSFERS:
            raise ConfigError(f"strategy.boundary (--boundary) must be one of {choices(BOUNDARY_TRANSFERS)}, "
                              f"got {self.boundary!r}")
        if self.stage_tp is not None:
            return self._resolved_stage_tp(world_size)
        for name in ("tp", "pp"):
            _check_positive_int(f"strategy.{name}", getattr(self, name))
        if self.dp is not None:
            _check_positive_int("strategy.dp", self.dp)
        _check_positive_int("strategy.chunks", self.chunks)
        _check_positive_int("strategy.tp_subbatches", self.tp_subbatches)
        if self.boundary != "direct":
            self._check_planned_boundary()
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"strategy.recompute must be one of {choices(RECOMPUTE_MODES)}, got {self.recompute!r}")
        if self.dp_mode not in DP_MODES:
            raise ConfigError(f"strategy.dp_mode must be one of {choices(DP_MODES)}, got {self.dp_mode!r}")
        if self.search not in SEARCH_MODES:
            raise ConfigError(f"strategy.search (--strategy) must be one of {choices(SEARCH_MODES)}, got {self.search!r}")
        _check_nonnegative_int("strategy.confirm", self.confirm)
        _check_nonnegative_int("strategy.staleness", self.staleness)  # parameter server (async_sgd/)
        if self.vertical_sync and self.schedule != "pipedream":
            raise ConfigError(f"strategy.vertical_sync (--vertical-sync) belongs to --schedule pipedream (weight "
                              f"stashing), got --schedule {self.schedule}; drop it or use --schedule pipedream")
        _check_positive_int("strategy.servers", self.servers)
        if self.zero not in ZERO_LEVELS:
            raise ConfigError(f"strategy.zero must be one of {choices(ZERO_LEVELS)}, got {self.zero!r}")
        if self.sparse_embeddings not in SPARSE_EMBEDDING_MODES:
            raise ConfigError(f"strategy.sparse_embeddings must be one of {choices(SPARSE_EMBEDDING_MODES)}, "
                              f"got {self.sparse_embeddings!r}")
        if self.sparse_sharding not in SPARSE_SHARDINGS:
            raise ConfigError(f"strategy.sparse_sharding must be one of {choices(SPARSE_SHARDINGS)}, "
                              f"got {self.sparse_sharding!r}")
        if isinstance(self.sparse_threshold, bool) or not isinstance(self.sparse_threshold, (int, float)) \
                or not 0 <= self.sparse_threshold <= 1:
            raise ConfigError(f"strategy.sparse_threshold is a fraction of rows and must be in [0, 1], got "
                              f"{self.sparse_threshold!r}; e.g. 0.1 (tables touching < 10% of rows per step are sparse)")
        if self.sparse_schedule and self.sparse_embeddings != "embrace":
            raise ConfigError(f"--sparse-schedule schedules the row exchange of sharded tables, so it needs "
                              f"--sparse-embeddings embrace, got {self.sparse_embeddings!r}")
        if self.sparse_embeddings != "dense" and (self.pp > 1 or self.tp > 1):
            raise ConfigError(f"--sparse-embeddings {self.sparse_embeddings} works with data parallelism only, got "
                              f"pp={self.pp} tp={self.tp}; use pp=1 tp=1 or --sparse-embeddings dense")
        dp = self.dp if self.dp is not None else world_size // (self.tp * self.pp)
        if dp * self.tp * self.pp != world_size or dp < 1:
            raise ConfigError(
                f"dp*tp*pp = {self.dp if self.dp is not None else '?'}*{self.tp}*{self.pp} does not equal "
                f"the number of processes ({world_size}); choose degrees whose product is {world_size}, "
                f"e.g. dp={max(1, world_size // (self.tp * self.pp))} tp={self.tp} pp={self.pp}, "
                f"or change --nproc"
            )
        return dataclasses.replace(self, dp=dp)

    def _check_planned_boundary(self) -> None:
        """--boundary other than direct on a uniform pipeline (Megatron's scatter-gather between equal
        layouts): the planned transport (pipeline/hetero_boundary.py) runs one stage per rank."""
        given = f"--boundary {self.boundary} (planned transfers between pipeline stages)"
        if self.pp < 2:
            raise ConfigError(f"{given} needs a pipeline, got pp={self.pp}; use --pp 2 or more (or --stage-tp), "
                              f"or --boundary direct")
        if self.chunks != 1:
            raise ConfigError(f"{given} cannot be combined with --chunks {self.chunks} (it moves one stage per "
                              f"rank); use --chunks 1 or --boundary direct")
        if self.schedule not in STAGE_TP_SCHEDULES:
            raise ConfigError(f"{given} cannot be combined with --schedule {self.schedule}; use one of "
                              f"{choices(STAGE_TP_SCHEDULES)} or --boundary direct")

    def _resolved_stage_tp(self, world_size: int) -> Strategy:
        """--stage-tp: pp from the list, dp from nproc / sum; all-equal degrees become the uniform --tp."""
        degrees = parse_stage_tp(self.stage_tp)
        given = f"--stage-tp {','.join(map(str, degrees))}"
        if self.pp != 1 and self.pp != len(degrees):
            raise ConfigError(f"{given} lists {len(degrees)} stages but --pp is {self.pp}; drop --pp (it is the "
                              f"list's length) or list {self.pp} degrees")
        if self.tp != 1:
            raise ConfigError(f"{given} gives every stage its tp degree; --tp {self.tp} beside it is ambiguous: "
                              f"drop --tp (or drop --stage-tp and use --tp {self.tp})")
        if len(set(degrees)) == 1:  # uniform: exactly the --tp code path
            return dataclasses.replace(self, stage_tp=None, tp=degrees[0], pp=len(degrees)).resolved(world_size)
        ranks = sum(degrees)
        dp = self.dp if self.dp is not None else world_size // ranks
        if dp < 1 or dp * ranks != world_size:
            raise ConfigError(f"{given} needs dp * {ranks} processes (one pipeline is {'+'.join(map(str, degrees))} "
                              f"= {ranks} ranks), but nproc is {world_size}"
                              f"{f' with dp={self.dp}' if self.dp is not None else ''}; use --nproc "
                              f"{max(1, dp) * ranks} (dp={max(1, dp)}) or change the degrees")
        refusals = [
            (self.chunks > 1, f"--chunks {self.chunks} (interleaving puts several stages, so several tp degrees, "
             f"on one rank); use --chunks 1"),
            (self.schedule not in STAGE_TP_SCHEDULES, f"--schedule {self.schedule}; use one of "
             f"{choices(STAGE_TP_SCHEDULES)}"),
            (self.tp_subbatches > 1, f"--tp-subbatches {self.tp_subbatches}; use 1"),
            (self.zero != 0, f"--zero {self.zero} (not tested across stages of different degrees yet); use --zero 0"),
            (self.dp_mode != "allreduce", f"--dp-mode {self.dp_mode}; use --dp-mode allreduce"),
            (self.sparse_embeddings != "dense", f"--sparse-embeddings {self.sparse_embeddings}; use dense"),
            (self.search != "manual" or self.plan is not None, "--strategy auto / --plan (the search does not "
             "choose per-stage degrees yet); give the degrees by hand"),
            (self.memory_budget_mb is not None, "--memory-budget-mb; use --recompute instead"),
        ]
        for refused, why in refusals:
            if refused:
                raise ConfigError(f"{given} (stages of different tp degrees) cannot be combined with {why}")
        checked = dataclasses.replace(self, stage_tp=None, tp=1, pp=len(degrees), dp=None,
                                      boundary="direct").resolved(len(degrees))
        return dataclasses.replace(checked, stage_tp=",".join(map(str, degrees)), dp=dp, boundary=self.boundary)


STAGE_TP_SCHEDULES = ("gpipe", "1f1b", "eager-1f1b")


def parse_stage_tp(value: Any) -> tuple[int, ...]:
    """'2,4' (CLI, TOML) or a sequence of ints (Python) -> (2, 4); anything else is refused clearly."""
    items = value.split(",") if isinstance(value, str) else value
    try:
        degrees = tuple(int(str(v).strip()) for v in items)
    except (TypeError, ValueError):
        degrees = ()
    if len(degrees) < 1 or any(d < 1 for d in degrees):
        raise ConfigError(f"strategy.stage_tp (--stage-tp) must list positive tp degrees, one per pipeline stage, "
                          f"e.g. 2,4; got {value!r}")
    return degrees


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to train (the built-in job; the Python API takes an nn.Module instead)."""

    name: str = _f("gpt-mini", "model name: gpt-tiny|gpt-mini|gpt-small|gpt-medium|word-lstm|word-gpt|hf:gpt2|hf:llama|hf:bert",
                   flag="--model")
    args: dict = _f({}, "model argument KEY=VALUE overriding the size table (repeatable)", flag="--model-arg")


@dataclass(kw_only=True)
class DataConfig:
    """The built-in data: an embedded corpus cut into fixed-length token windows."""

    corpus: str = _f("stdlib", "embedded text corpus (stdlib: the Python standard library's source)")
    tokenizer: str = _f("byte", "tokenizer: byte (UTF-8 bytes plus special tokens) | word (words of the training text, "
                                "vocab_size of them) | bpe (byte-level BPE of vocab_size tokens learned from the "
                                "training text) | hf:PATH (a tokenizer.json, or a folder holding one)")
    vocab_size: int = _f(32768, "trained tokenizers (word, bpe): vocabulary size (word: the most frequent words of the "
                                "training text; the rest become <unk>)")
    seq_len: int = _f(128, "tokens per training sequence")
    data: str | None = _f(None, "train on a local file instead of the corpus: .txt, .jsonl/.json, .parquet, .csv, or "
                                "a datasets.save_to_disk folder; records with prompt/response fields are instruction "
                                "data (loss on the response only)")
    text_field: str = _f("text", "--data: the field holding each document's text")
    prompt_field: str = _f("prompt", "--data: instruction records' prompt field")
    response_field: str = _f("response", "--data: instruction records' response field")
    eval_data: str | None = _f(None, "--data: held-out file (default: the last --eval-fraction of --data)")
    eval_fraction: float = _f(0.1, "--data: fraction of the tokens (or records) held out for evaluation")
    data_cache: str | None = _f(None, "--data: folder of tokenized files, keyed by content and tokenizer "
                                      "(default ~/.cache/autopar/data)")


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop: batch sizes, optimizer, schedule, evaluation, checkpoints, output."""

    steps: int = _f(200, "optimizer steps to train")
    global_batch_size: int = _f(32, "sequences per optimizer step, over all data-parallel replicas")
    micro_batch_size: int = _f(8, "sequences per forward/backward on one replica (gradients accumulate)")
    micro_batches: int | None = _f(None, "micro-batches per replica per step; if set, micro_batch_size = "
                                         "global_batch_size / (dp * micro_batches)")
    optimizer: str = _f("adamw", "optimizer: adamw|adam|sgd|adagrad|sparse-adam (SparseAdam on sparse embedding "
                                           "tables, Adam on the rest)")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr (cosine decay)")
    warmup_steps: int = _f(20, "steps of linear learning-rate warm-up")
    weight_decay: float = _f(0.1, "AdamW weight decay (not applied to biases, norms or embeddings' 1-D params)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    adam_eps: float = _f(1e-8, "Adam/AdamW epsilon, added to the second moment's root")
    grad_clip: float = _f(1.0, "clip gradients to this global L2 norm; 0 disables clipping")
    seed: int = _f(0, "seed for initialisation and data order")
    eval_every: int = _f(0, "evaluate every N steps (0: only at the end)")
    eval_batches: int = _f(4, "global batches of held-out data per evaluation")
    checkpoint_every: int | None = _f(None, f"save a checkpoint every N steps (default: every "
                                            f"{DEFAULT_CHECKPOINT_EVERY}; 0: only at the end and when interrupted)")
    keep_checkpoints: int = _f(0, "keep only the newest K complete checkpoints, deleting older ones (0: keep all)")
    max_bad_steps: int = _f(0, "skip a step whose loss or gradient norm is not finite (no update on any rank) and "
                               "stop after K such steps in a row; 0: stop at the first one")
    hang_timeout_s: float = _f(0.0, "if no step finishes for this many seconds, report which operation each rank "
                                    "is in, dump every thread's stack into the run folder and stop (0: off)")
    log_every: int = _f(1, "write metrics every N steps")
    out: str | None = _f(None, "run folder (default runs/<timestamp>/)")
    resume: str | None = _f(None, "resume from a run folder or a checkpoint folder")
    device: str = _f("cpu", "cpu or cuda")
    dtype: str = _f("fp32", "fp32 | bf16 (bf16 parameters, gradients and communication; fp32 master weights, "
                            "optimizer state and accumulation) | bf16-autocast (fp32 parameters, bf16 autocast)")
    timeout_s: float = _f(300.0, "seconds any collective may wait before the run fails (no hangs)")
    progress: bool = _f(True, "show a progress bar on rank 0")
    trace: bool = _f(False, "write the last step's measured pipeline timeline to timeline.json (Chrome trace)")
    export_hf: str | None = _f(None, "after training, write the final model to this folder in the Hugging Face "
                                     "format (config.json + safetensors; hf: models only)")

    def validate(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size", "log_every", "eval_batches"):
            _check_positive_int(f"train.{name}", getattr(self, name))
        for name in ("warmup_steps", "eval_every", "seed", "keep_checkpoints", "max_bad_steps"):
            _check_nonnegative_int(f"train.{name}", getattr(self, name))
        if self.checkpoint_every is not None:
            _check_nonnegative_int("train.checkpoint_every", self.checkpoint_every)
        if not self.hang_timeout_s >= 0:
            raise ConfigError(f"train.hang_timeout_s must be >= 0 (0: no watchdog), got {self.hang_timeout_s}")
        if self.hang_timeout_s and self.hang_timeout_s >= self.timeout_s:
            raise ConfigError(f"train.hang_timeout_s={self.hang_timeout_s} must be below timeout_s={self.timeout_s} "
                              f"(a collective fails on its own after timeout_s); lower --hang-timeout-s or raise "
                              f"--timeout-s")
        if not self.lr > 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.adam_eps > 0:
            raise ConfigError(f"train.adam_eps must be > 0 (e.g. 1e-8), got {self.adam_eps}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer must be one of {choices(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"train.device must be one of {{cpu, cuda}}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"train.dtype must be one of {choices(DTYPES)}, got {self.dtype!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"train.timeout_s must be > 0, got {self.timeout_s}")

    @property
    def checkpoint_interval(self) -> int:
        """Steps between checkpoints (0: only at the end and when interrupted)."""
        return DEFAULT_CHECKPOINT_EVERY if self.checkpoint_every is None else self.checkpoint_every

    def with_micro_batches(self, dp: int) -> TrainConfig:
        """Resolve `micro_batches` into a micro-batch size (an error if it does not divide)."""
        if self.micro_batches is None:
            return self
        _check_positive_int("train.micro_batches", self.micro_batches)
        if self.global_batch_size % (dp * self.micro_batches):
            raise ConfigError(f"global_batch_size={self.global_batch_size} cannot be split into dp*micro_batches = "
                              f"{dp}*{self.micro_batches} equal micro-batches; use a global batch size that is a "
                              f"multiple of {dp * self.micro_batches}")
        return dataclasses.replace(self, micro_batch_size=self.global_batch_size // (dp * self.micro_batches))

    def accumulation_steps(self, dp: int) -> int:
        """Micro-batches per replica per optimizer step; errors if the batch sizes do not divide."""
        per_step = dp * self.micro_batch_size
        if self.global_batch_size % per_step:
            per_replica = self.global_batch_size / dp
            hint = (f"a micro_batch_size that divides {int(per_replica)}" if per_replica.is_integer()
                    else f"a global batch size divisible by dp={dp}")
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not divisible by dp*micro_batch_size = "
                f"{dp}*{self.micro_batch_size} = {per_step}; use a global batch size that is a multiple of "
                f"{per_step} (e.g. {per_step * -(-self.global_batch_size // per_step)}) or {hint}"
            )
        return self.global_batch_size // per_step


@dataclass(kw_only=True)
class LaunchConfig:
    """How processes are started when autopar launches them itself (ignored under torchrun)."""

    nproc: int = _f(4, "local processes to start (one CPU thread each); ignored under torchrun")
    max_restarts: int = _f(0, "when a rank dies, stop every rank and restart the job from its latest complete "
                              "checkpoint, at most N times (under torchrun, use torchrun's --max-restarts)")


@dataclass(kw_only=True)
class JobConfig:
    """Everything `autopar train` needs; written to the run folder as config.toml."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: Strategy = field(default_factory=Strategy)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def validate(self) -> None:
        _check_positive_int("launch.nproc", self.launch.nproc)
        _check_nonnegative_int("launch.max_restarts", self.launch.max_restarts)
        _check_positive_int("data.seq_len", self.data.seq_len)
        self.train.validate()


SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "strategy": Strategy,
                 "train": TrainConfig, "launch": LaunchConfig}


# ---------------------------------------------------------------------------- conversion


def to_dict(config: Any) -> dict:
    """A dataclass as nested plain dicts, with None values left out (TOML has no null)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        if value is not None:
            out[f.name] = value
    return out


def to_toml(config: JobConfig) -> str:
    return tomli_w.dumps(to_dict(config))


def from_dict(data: dict, *, source: str = "config") -> JobConfig:
    """Build a JobConfig from nested dicts, rejecting unknown sections and keys by name."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a table of sections, got {type(data).__name__}")
    sections = {}
    for section, values in data.items():
        if section not in SECTION_TYPES:
            raise ConfigError(f"{source}: unknown section [{section}]; valid sections: {choices(SECTION_TYPES)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table, got {values!r}")
        sections[section] = _section_from_dict(SECTION_TYPES[section], values, f"{source}: [{section}]")
    return JobConfig(**sections)


def _section_from_dict(cls: type, values: dict, where: str) -> Any:
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}; valid keys: {choices(sorted(known))}")
        kwargs[key] = coerce(value, hints[key], f"{where} {key}")
    return cls(**kwargs)


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check (and for strings from the command line, convert) a value against a field type."""
    kinds = _kinds(annotation)
    if value is None and type(None) in kinds:
        return None
    if isinstance(value, str) and str not in kinds:
        value = parse_literal(value)
    if bool in kinds and isinstance(value, bool):
        return value
    if int in kinds and isinstance(value, int) and not isinstance(value, bool):
        return value
    if float in kinds and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if str in kinds and isinstance(value, str):
        return value
    if dict in kinds and isinstance(value, dict):
        return dict(value)
    wanted = " or ".join(k.__name__ for k in kinds if k is not type(None))
    raise ConfigError(f"{where}: expected {wanted}, got {value!r}")


def _kinds(annotation: Any) -> set[type]:
    args = getattr(annotation, "__args__", None)
    if args:
        return {a for a in args if isinstance(a, type)}
    return {annotation} if isinstance(annotation, type) else {object}


def parse_literal(text: str) -> Any:
    """Read a command-line value as a TOML scalar (4, 0.1, true, "x"); fall back to the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_toml(path: str | Path) -> JobConfig:
    """Read a config file; an unreadable or malformed file gets an error naming it."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    return from_dict(data, source=str(path))


def merge(base: JobConfig, overrides: dict[str, dict[str, Any]]) -> JobConfig:
    """Return `base` with the given {section: {key: value}} overrides applied (flags win)."""
    sections = {}
    for section, cls in SECTION_TYPES.items():
        current = getattr(base, section)
        changes = overrides.get(section, {})
        if section == "model" and "args" in changes:  # model arguments add up, they do not replace
            changes = {**changes, "args": {**current.args, **changes["args"]}}
        sections[section] = dataclasses.replace(current, **changes) if changes else current
    return JobConfig(**sections)


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_nonnegative_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
