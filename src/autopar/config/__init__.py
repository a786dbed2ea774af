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

from ..errors import ConfigError, choices
from .fields import _check_nonnegative_int, _check_positive_int, _f
from .log_targets import logger_names
from .strategy import (  # noqa: F401 (re-exported: autopar.config is where callers look)
    SCHEDULES,
    ASYNC_SCHEDULES,
    PARTITION_METHODS,
    RECOMPUTE_MODES,
    GOSSIP_TOPOLOGIES,
    GOSSIP_ORDERS,
    DP_MODES,
    SPARSE_EMBEDDING_MODES,
    OPTIMIZERS,
    OPTIMIZER_KERNELS,
    SPARSE_SHARDINGS,
    DEFAULT_CHECKPOINT_EVERY,
    SEARCH_MODES,
    ZERO_LEVELS,
    DTYPES,
    BATCHNORM_MODES,
    BOUNDARY_TRANSFERS,
    STAGE_TP_SCHEDULES,
    FlatField,
    PipelineOptions,
    PlanningOptions,
    ReplicaOptions,
    SparseOptions,
    Strategy,
    parse_stage_tp,
)


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


COMPILE_BACKENDS = ("inductor", "aot_eager")
DEFAULT_MICRO_BATCH_SIZE = 8  # the most sequences per micro-batch when the user sets no micro-batching


def default_micro_batch_size(global_batch_size: int, dp: int) -> int:
    """The micro-batch size of a run that sets none, once dp is known: the per-replica batch up to
    DEFAULT_MICRO_BATCH_SIZE (min(8, per-replica batch)), or, where 8 does not divide a larger per-replica
    batch, its largest divisor below 8, so that the default always runs where the batch splits over dp.
    (A batch dp does not divide, which only uneven --dp-shares accept, gets a divisor of the whole batch.)
    The one definition: the runtime, the search's default layout and re-planning all resolve through it."""
    per_replica = global_batch_size // dp
    whole = per_replica if global_batch_size % dp == 0 else global_batch_size
    return max(d for d in range(1, max(1, min(DEFAULT_MICRO_BATCH_SIZE, per_replica)) + 1) if whole % d == 0)


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop: batch sizes, optimizer, schedule, evaluation, checkpoints, output."""

    steps: int = _f(200, "optimizer steps to train")
    global_batch_size: int = _f(32, "sequences per optimizer step, over all data-parallel replicas")
    micro_batch_size: int | None = _f(None, "sequences per forward/backward on one replica (gradients accumulate); "
                                            f"unset: the per-replica batch (global_batch_size / dp) up to "
                                            f"{DEFAULT_MICRO_BATCH_SIZE}, its largest divisor up to "
                                            f"{DEFAULT_MICRO_BATCH_SIZE} when it is larger")
    micro_batches: int | None = _f(None, "micro-batches per replica per step; if set, micro_batch_size = "
                                         "global_batch_size / (dp * micro_batches)")
    optimizer: str = _f("adamw", "optimizer: adamw|adam|sgd|adagrad|sparse-adam (SparseAdam on sparse embedding "
                                           "tables, Adam on the rest)")
    optimizer_kernel: str = _f("fused", "how the update runs: fused (one torch kernel per parameter group, where torch "
                                        "has one: CPU/CUDA float parameters, dense gradients; else foreach) | foreach")
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
    log_every: int = _f(1, "write a metrics record (metrics.jsonl, each --log target) and, when stdout is not a "
                           "terminal or the bar is off, a plain log line every N steps")
    log: str = _f("", "also log every metric to: a comma-separated list of csv (metrics.csv), tensorboard (event "
                      "files in RUN/tensorboard), wandb (offline in RUN/wandb unless W&B is configured)")
    out: str | None = _f(None, "run folder (default runs/<timestamp>/)")
    resume: str | None = _f(None, "resume from a run folder or a checkpoint folder")
    device: str = _f("cpu", "cpu or cuda")
    dtype: str = _f("fp32", "fp32 | bf16 (bf16 parameters, gradients and communication; fp32 master weights, "
                            "optimizer state and accumulation) | bf16-autocast (fp32 parameters, bf16 autocast)")
    timeout_s: float = _f(300.0, "seconds any collective may wait before the run fails (no hangs)")
    progress: bool = _f(True, "show a progress bar on rank 0 when stderr is a terminal (elsewhere: plain log lines)")
    trace: bool = _f(False, "write the last step's measured pipeline timeline to timeline.json (Chrome trace)")
    export_hf: str | None = _f(None, "after training, write the final model to this folder in the Hugging Face "
                                     "format (config.json + safetensors; hf: models only)")
    compile: bool = _f(False, "torch.compile each repeated block (pipeline and tensor-parallel stages: each block's "
                              "piece) and run the optimizer update as one fused kernel; equal to eager within fp32 "
                              "tolerance, dropout masks exact; compiled kernels cached across runs "
                              "(docs/features/compile.md)")
    compile_backend: str = _f("inductor", f"--compile: torch.compile backend: {'|'.join(COMPILE_BACKENDS)} (inductor: "
                                          "generated kernels; aot_eager: graphs captured forward and backward, run by "
                                          "torch's own kernels, to tell a capture problem from a kernel one)")

    def validate(self) -> None:
        for name in ("steps", "global_batch_size", "log_every", "eval_batches"):
            _check_positive_int(f"train.{name}", getattr(self, name))
        if self.micro_batch_size is not None:  # unset: resolved once dp is known (with_micro_batches)
            _check_positive_int("train.micro_batch_size", self.micro_batch_size)
        for name in ("warmup_steps", "eval_every", "seed", "keep_checkpoints", "max_bad_steps"):
            _check_nonnegative_int(f"train.{name}", getattr(self, name))
        if self.checkpoint_every is not None:
            _check_nonnegative_int("train.checkpoint_every", self.checkpoint_every)
        logger_names(self.log)
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
        if self.optimizer_kernel not in OPTIMIZER_KERNELS:
            raise ConfigError(f"train.optimizer_kernel must be one of {choices(OPTIMIZER_KERNELS)}, "
                              f"got {self.optimizer_kernel!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"train.device must be one of {{cpu, cuda}}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"train.dtype must be one of {choices(DTYPES)}, got {self.dtype!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"train.timeout_s must be > 0, got {self.timeout_s}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ConfigError(f"train.compile_backend must be one of {choices(COMPILE_BACKENDS)}, got "
                              f"{self.compile_backend!r}")

    @property
    def checkpoint_interval(self) -> int:
        """Steps between checkpoints (0: only at the end and when interrupted)."""
        return DEFAULT_CHECKPOINT_EVERY if self.checkpoint_every is None else self.checkpoint_every

    def with_micro_batches(self, dp: int) -> TrainConfig:
        """Resolve `micro_batches`, or an unset micro-batch size (default_micro_batch_size), into a micro-batch
        size over `dp` replicas (an error if `micro_batches` does not divide)."""
        if self.micro_batches is None:
            if self.micro_batch_size is None:
                return dataclasses.replace(self, micro_batch_size=default_micro_batch_size(self.global_batch_size, dp))
            return self
        _check_positive_int("train.micro_batches", self.micro_batches)
        if self.global_batch_size % (dp * self.micro_batches):
            raise ConfigError(f"global_batch_size={self.global_batch_size} cannot be split into dp*micro_batches = "
                              f"{dp}*{self.micro_batches} equal micro-batches; use a global batch size that is a "
                              f"multiple of {dp * self.micro_batches}")
        return dataclasses.replace(self, micro_batch_size=self.global_batch_size // (dp * self.micro_batches))

    def accumulation_steps(self, dp: int) -> int:
        """Micro-batches per replica per optimizer step, micro-batching resolved as with_micro_batches does;
        errors if the batch sizes do not divide (naming only what the user set)."""
        if self.micro_batch_size is None and self.micro_batches is None and self.global_batch_size % dp:
            raise ConfigError(f"global_batch_size={self.global_batch_size} does not split evenly over dp={dp} "
                              f"replicas; use a global batch size that is a multiple of {dp} (e.g. "
                              f"{dp * -(-self.global_batch_size // dp)})")
        micro_batch_size = self.with_micro_batches(dp).micro_batch_size
        per_step = dp * micro_batch_size
        if self.global_batch_size % per_step:
            per_replica = self.global_batch_size / dp
            hint = (f"a micro_batch_size that divides {int(per_replica)}" if per_replica.is_integer()
                    else f"a global batch size divisible by dp={dp}")
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not divisible by dp*micro_batch_size = "
                f"{dp}*{micro_batch_size} = {per_step}; use a global batch size that is a multiple of "
                f"{per_step} (e.g. {per_step * -(-self.global_batch_size // per_step)}) or {hint}"
            )
        return self.global_batch_size // per_step


RANK_LOSS_POLICIES = ("restart", "shrink")  # launch.on_rank_loss (rank_loss.py)


@dataclass(kw_only=True)
class LaunchConfig:
    """How processes are started when autopar launches them itself (ignored under torchrun)."""

    nproc: int = _f(4, "local processes to start (one CPU thread each); ignored under torchrun")
    max_restarts: int = _f(0, "when a rank dies, stop every rank and restart the job from its latest complete "
                              "checkpoint, at most N times (under torchrun, use torchrun's --max-restarts)")
    on_rank_loss: str = _f("restart", "when a rank is lost (killed by a signal, or preempted): restart (every rank "
                                      "again, at the same size) | shrink (go on with the surviving whole replicas, "
                                      "re-planned for them; needs dp >= 2 and --max-restarts)")


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
        if self.launch.on_rank_loss not in RANK_LOSS_POLICIES:
            raise ConfigError(f"launch.on_rank_loss must be one of {choices(RANK_LOSS_POLICIES)}, got "
                              f"{self.launch.on_rank_loss!r}")
        _check_positive_int("data.seq_len", self.data.seq_len)
        self.train.validate()


SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "strategy": Strategy,
                 "train": TrainConfig, "launch": LaunchConfig}


# ---------------------------------------------------------------------------- conversion


def section_fields(cls: type) -> list[FlatField]:
    """A section's options as flags and TOML name them: a Strategy's flat names, any other section's fields."""
    if cls is Strategy:
        return Strategy.flat_fields()
    hints = get_type_hints(cls)
    return [FlatField(f.name, f, hints[f.name], None, f.name) for f in dataclasses.fields(cls)]


def to_dict(config: Any) -> dict:
    """A dataclass as nested plain dicts, with None values left out (TOML has no null); a Strategy flat."""
    if isinstance(config, Strategy):
        return {k: v for k, v in config.flat().items() if v is not None}
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
    hints = {f.name: f.hint for f in section_fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{where}: unknown key {key!r}; valid keys: {choices(sorted(hints))}")
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
