"""The [strategy] section: how the model is spread over processes, and the choices it is checked against.

Kept apart from the other sections (config/__init__.py) because it is the largest and the one the
strategy table, the search and every engine read; the valid choices are named here once.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, choices
from .degrees import DegreesDoNotFit
from .fields import _check_nonnegative_int, _check_positive_int, _f
from .schedules import ASYNC_SCHEDULES, SCHEDULES, STAGE_TP_SCHEDULES, schedule_spec  # noqa: F401


# Valid choices, named once: the help texts below, the checks and the packages that implement
# them (pipeline/schedules.py, partition/plan.py, gossip/) all read these. The schedules' names and
# facts are the schedule table's (config/schedules.py).
PARTITION_METHODS = ("uniform", "parameters", "time")
RECOMPUTE_MODES = ("none", "all", "all-but-last")
GOSSIP_TOPOLOGIES = ("ring", "torus", "exponential", "complete")
GOSSIP_ORDERS = ("dpsgd", "atc")
DP_MODES = ("allreduce", "gossip", "async")
SPARSE_EMBEDDING_MODES = ("dense", "allgather", "embrace")
OPTIMIZERS = ("adamw", "sgd", "adagrad", "adam", "sparse-adam")
OPTIMIZER_KERNELS = ("fused", "foreach")  # how the update runs (train/optim.py)
SPARSE_SHARDINGS = ("column", "row")
DEFAULT_CHECKPOINT_EVERY = 100  # steps; a restart or a preemption loses at most this much work
SEARCH_MODES = ("manual", "auto")
ZERO_LEVELS = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16", "bf16-autocast")
# How pipeline boundary tensors move (pipeline/hetero_boundary.py; the methods are resharding/planner.py's).
BOUNDARY_TRANSFERS = ("direct", "send_recv", "scatter_gather", "broadcast", "auto")
# BatchNorm statistics (running_stats/): exact is one process's over the same micro-batches; sync normalises
# with the statistics of the replicas' micro-batches together (torch's SyncBatchNorm).
BATCHNORM_MODES = ("exact", "sync")
CP_MODES = ("ring", "all-to-all")  # how attention sees the whole sequence under --cp (context_parallel/)


@dataclass(kw_only=True)
class PipelineOptions:
    """How a pipeline runs: its schedule, the cut into stages, recomputation and boundary transfers."""

    schedule: str = _f("1f1b", f"pipeline schedule: {'|'.join(SCHEDULES + ASYNC_SCHEDULES)}")
    chunks: int = _f(1, "pipeline stages per rank (virtual stages; interleaved-1f1b needs >= 2, zbv exactly 2)")
    partition: str = _f("time", f"how to cut the model into stages: {'|'.join(PARTITION_METHODS)}")
    recompute: str = _f("none", f"whole-stage recomputation scheduled by the pipeline: {'|'.join(RECOMPUTE_MODES)}")
    memory_budget_mb: float | None = _f(None, "per-rank memory budget (MiB): recompute the fewest blocks of each "
                                              "stage that fit it (stage-aware recomputation)")
    tp_subbatches: int = _f(1, "sub-pipelined tensor parallelism: split each micro-batch of a tensor-parallel "
                                  "stage into K sub-batches so each tp all-reduce overlaps the next sub-batch's "
                                  "compute (Merak); must divide the micro-batch size")
    boundary: str = _f("direct", f"pipeline boundary transfers: {'|'.join(BOUNDARY_TRANSFERS)} (direct: whole tensor "
                                 "from one sender per receiver; the others are planned resharding, between --stage-tp "
                                 "stages or equal tp stages alike, auto the cheapest predicted on --cluster)")
    vertical_sync: bool = _f(False, "--schedule pipedream: every stage runs a micro-batch on the weight version "
                                    "stage 0 used for it (one delay for all stages; up to pp versions per stage)")
    tied_delay: int | None = _f(None, "--schedule pipedream: how many steps late a weight tied across stages (an "
                                      "embedding and output head) takes its summed gradient; default pp - 1, so its "
                                      "owners never wait for each other; 0 sums each step's at once (they meet every "
                                      "step)")


@dataclass(kw_only=True)
class ReplicaOptions:
    """How data-parallel replicas hold and combine their state: the mode (with gossip's and the parameter
    server's options), ZeRO sharding and BatchNorm statistics."""

    mode: str = _f("allreduce", "how replicas combine gradients: allreduce (synchronous) | gossip (D-PSGD: "
                                "average with neighbours only) | async (parameter server, bounded staleness)",
                   flat="dp_mode")
    zero: int = _f(0, "ZeRO level over each dp group: 0 (replicated), 1 (optimizer state sharded), 2 (and "
                      "gradients), 3 (and parameters, FSDP2; dp only)")
    batchnorm: str = _f("exact", f"BatchNorm statistics: {'|'.join(BATCHNORM_MODES)}. exact: one process's over the "
                                 "same micro-batches (each normalised with its own statistics; the running buffers "
                                 "updated once per micro-batch of the global batch, in order, on every rank). sync: "
                                 "micro-batch i of every replica normalised together, with their joint statistics "
                                 "(as torch's SyncBatchNorm, on any device; one process running dp x the "
                                 "micro-batch size when each replica has one micro-batch)")
    topology: str = _f("ring", f"gossip graph: {'|'.join(GOSSIP_TOPOLOGIES)} (Metropolis weights), or a text file "
                               "holding the n x n doubly-stochastic mixing matrix, one row per line")
    gossip_order: str = _f("dpsgd", "gossip update order: dpsgd (gradient at the local model while mixing, "
                                    "Lian et al.) | atc (adapt, then combine)")
    staleness: int = _f(0, "parameter server: how many steps a worker's parameters may lag (0: synchronous)")
    servers: int = _f(1, "parameter server: processes holding parameter shards (taken from nproc)")
    shares: str = _f("even", "samples of each global batch per replica: even | auto (in proportion to each "
                              "replica's device speed in the --cluster file) | one weight per replica, e.g. 3,1; "
                              "the result still equals one process (data/shares.py)", flat="dp_shares")


@dataclass(kw_only=True)
class SparseOptions:
    """How embedding tables' gradients travel between replicas (EmbRace); the sparse engine's options."""

    mode: str = _f("dense", "embedding-table exchange: dense (all-reduce) | allgather (sparse all-gather) | embrace "
                            "(sharded tables, AlltoAll lookups)", flat="sparse_embeddings")
    threshold: float = _f(0.1, "a table whose measured fraction of rows touched per step is below this is sparse",
                          flat="sparse_threshold")
    sharding: str = _f("column", f"how embrace shards sparse tables over replicas: {'|'.join(SPARSE_SHARDINGS)}",
                       flat="sparse_sharding")
    schedule: bool = _f(False, "embrace: 2D communication scheduling (rows the next step reads are exchanged and "
                               "updated first, the rest deferred; needs grad_clip 0)", flat="sparse_schedule")


@dataclass(kw_only=True)
class PlanningOptions:
    """Letting autopar choose (search/auto.py): the search, a saved plan, the cluster priced and its memory."""

    mode: str = _f("manual", f"{'|'.join(SEARCH_MODES)}: auto searches dp, tp, pp, micro-batching, schedule, chunks, "
                             "recomputation and cut for this model and nproc before any process starts (degrees "
                             "and a schedule given beside it stay fixed) and writes plan.json into the run folder",
                   flat="search", flag="--strategy")
    plan: str | None = _f(None, "a saved plan (plan.json of a run folder, or `autopar plan --auto --json` output) to "
                                "run as it is; flags that contradict it are refused")
    cluster: str | None = _f(None, "--strategy auto and --boundary auto: cluster TOML (autopar calibrate) or preset "
                                   "name; default: --strategy auto measures this machine once and caches it "
                                   "(cpu-local: the rough preset, never measured), --boundary auto cpu-local")
    memory_per_device_gb: float | None = _f(None, "memory per device to plan for (GiB): --strategy auto's search "
                                                  "(default: the cluster's) and the memory check of a strategy set "
                                                  "by hand (default: this host's available memory over its ranks, "
                                                  "or the GPU's)")
    confirm: int | None = _f(None, "--strategy auto: run the top K plans (the default layout among them) for a few "
                                   "steps each and keep the fastest measured; unset: measure the pick and the "
                                   "default layout when they differ, and the plans within the model's error of "
                                   "the fastest; 0: never measure")

    @property
    def searched(self) -> bool:
        """The strategy is the search's to choose (--strategy auto without a saved plan)."""
        return self.mode == "auto" and not self.plan


# The strategy's groups, in the order the flags and TOML list their fields.
GROUPS: dict[str, type] = {"pipeline": PipelineOptions, "replicas": ReplicaOptions, "sparse": SparseOptions,
                           "planning": PlanningOptions}


@dataclass(frozen=True)
class FlatField:
    """One option as flags and TOML name it (flat), and where it lives in the grouped Strategy."""

    name: str  # the flat name: TOML key, `--name` flag, Strategy(name=...) keyword
    field: dataclasses.Field
    hint: Any  # its type
    group: str | None  # None: a degree on Strategy itself
    attr: str  # the attribute inside the group (or on Strategy)


@dataclass(kw_only=True, init=False)
class Strategy:
    """How the model is spread over processes: degrees of data, tensor and pipeline parallelism, and the
    options of each concern in its own group (`pipeline`, `replicas`, `sparse`, `planning`).

    dp * tp * pp must equal the number of processes. Leave `dp` as None to use every process not taken
    by tp and pp for data parallelism. Flags, TOML and the constructor name every option flat
    (`Strategy(pp=2, schedule="gpipe", dp_mode="gossip")`, `[strategy] schedule = "gpipe"`); each field's
    metadata maps its flat name to its group (`flat_fields()`); engines receive their group.
    """

    dp: int | None = _f(None, "data-parallel degree (replicas); default: nproc / (tp * pp)")
    tp: int = _f(1, "tensor-parallel degree (shards of each layer; adjacent ranks)")
    pp: int = _f(1, "pipeline-parallel degree (stages)")
    stage_tp: str | None = _f(None, "per-stage tensor-parallel degrees, e.g. 2,4 (stage 0 tp=2, stage 1 tp=4): pp is "
                                    "the list's length and nproc = dp * their sum; all equal is the same as --tp")
    sp: bool = _f(False, "sequence parallelism within tensor parallelism: norms, dropout and residual adds between "
                         "a row and the next column layer run on 1/tp of the sequence (reduce-scatter and "
                         "all-gather instead of all-reduce); needs tp > 1")
    # expert parallelism (experts/, train/expert_engine.py)
    ep: int = _f(1, "expert parallelism: the experts of each mixture-of-experts layer sharded over N ranks taken "
                    "from the data-parallel ranks (N divides dp and the expert count; tokens travel to their "
                    "expert's rank by all-to-all); 1: every rank holds every expert")
    # Context parallelism (context_parallel/): the sequence split over cp ranks.
    cp: int = _f(1, "context-parallel degree: every sequence split over cp ranks (between dp and tp); attention "
                    "runs over the whole sequence by --cp-mode, positions and masks follow each rank's tokens")
    cp_mode: str = _f("ring", "how attention sees the whole sequence under --cp: ring (key/value blocks passed "
                              "around, load-balanced causal chunks) | all-to-all (sequence swapped for heads; "
                              "heads divisible by cp)")
    pipeline: PipelineOptions = dataclasses.field(default_factory=PipelineOptions, metadata={"group": True})
    replicas: ReplicaOptions = dataclasses.field(default_factory=ReplicaOptions, metadata={"group": True})
    sparse: SparseOptions = dataclasses.field(default_factory=SparseOptions, metadata={"group": True})
    planning: PlanningOptions = dataclasses.field(default_factory=PlanningOptions, metadata={"group": True})

    def __init__(self, **options: Any):
        """Options by their flat names (`Strategy(pp=2, schedule="gpipe")`); groups may also be given whole
        (`pipeline=PipelineOptions(...)`), and flat names then change single options in them (which is
        also how `dataclasses.replace(strategy, schedule=...)` works)."""
        given = {name: options.pop(name, None) for name in GROUPS}
        changes: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        where = _flat_index()
        for key, value in options.items():
            if key not in where:
                raise TypeError(f"Strategy got an unknown option {key!r}; valid: {choices(sorted(where))}")
            if where[key].group is not None:
                changes[where[key].group][where[key].attr] = value
        for f in where.values():
            if f.group is None:  # a degree: given or its default
                setattr(self, f.name, options.get(f.name, f.field.default))
        for name, cls in GROUPS.items():
            base = given[name] if given[name] is not None else cls()
            setattr(self, name, dataclasses.replace(base, **changes[name]) if changes[name] else base)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not attributes: point a flat name to its group.
        where = _flat_index().get(name)
        if where is not None and where.group is not None:
            raise AttributeError(f"Strategy.{name} lives in its group: Strategy.{where.group}.{where.attr}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def flat_fields(cls) -> list[FlatField]:
        """Every option under its flat name, degrees first, then each group's fields in order."""
        return list(_flat_index().values())

    def flat(self) -> dict[str, Any]:
        """{flat name: value} of every option (what TOML and plan records hold)."""
        return {f.name: getattr(self if f.group is None else getattr(self, f.group), f.attr)
                for f in self.flat_fields()}

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
        if self.pipeline.boundary not in BOUNDARY_TRANSFERS:
            raise ConfigError(f"strategy.boundary (--boundary) must be one of {choices(BOUNDARY_TRANSFERS)}, "
                              f"got {self.pipeline.boundary!r}")
        if self.replicas.batchnorm not in BATCHNORM_MODES:
            raise ConfigError(f"strategy.batchnorm (--batchnorm) must be one of {choices(BATCHNORM_MODES)}, "
                              f"got {self.replicas.batchnorm!r}")
        if self.stage_tp is not None:
            return self._resolved_stage_tp(world_size)
        for name in ("tp", "pp"):
            _check_positive_int(f"strategy.{name}", getattr(self, name))
        if self.dp is not None:
            _check_positive_int("strategy.dp", self.dp)
        _check_positive_int("strategy.chunks", self.pipeline.chunks)
        _check_positive_int("strategy.tp_subbatches", self.pipeline.tp_subbatches)
        _check_positive_int("strategy.ep", self.ep)
        schedule_spec(self.pipeline.schedule)  # an unknown name is refused with the schedule table's names
        if self.pipeline.partition not in PARTITION_METHODS:
            raise ConfigError(f"unknown partition method {self.pipeline.partition!r}; use one of {choices(PARTITION_METHODS)}")
        if self.replicas.gossip_order not in GOSSIP_ORDERS:
            raise ConfigError(f"strategy.gossip_order must be one of {choices(GOSSIP_ORDERS)}, "
                              f"got {self.replicas.gossip_order!r}")
        if self.pipeline.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"strategy.recompute must be one of {choices(RECOMPUTE_MODES)}, got {self.pipeline.recompute!r}")
        if self.replicas.mode not in DP_MODES:
            raise ConfigError(f"strategy.dp_mode must be one of {choices(DP_MODES)}, got {self.replicas.mode!r}")
        if self.planning.mode not in SEARCH_MODES:
            raise ConfigError(f"strategy.search (--strategy) must be one of {choices(SEARCH_MODES)}, got {self.planning.mode!r}")
        if self.planning.confirm is not None:
            _check_nonnegative_int("strategy.confirm", self.planning.confirm)
        _check_nonnegative_int("strategy.staleness", self.replicas.staleness)  # parameter server (async_sgd/)
        if self.pipeline.tied_delay is not None:
            _check_nonnegative_int("strategy.tied_delay", self.pipeline.tied_delay)
        _check_positive_int("strategy.servers", self.replicas.servers)
        if self.replicas.zero not in ZERO_LEVELS:
            raise ConfigError(f"strategy.zero must be one of {choices(ZERO_LEVELS)}, got {self.replicas.zero!r}")
        if self.sparse.mode not in SPARSE_EMBEDDING_MODES:
            raise ConfigError(f"strategy.sparse_embeddings must be one of {choices(SPARSE_EMBEDDING_MODES)}, "
                              f"got {self.sparse.mode!r}")
        if self.sparse.sharding not in SPARSE_SHARDINGS:
            raise ConfigError(f"strategy.sparse_sharding must be one of {choices(SPARSE_SHARDINGS)}, "
                              f"got {self.sparse.sharding!r}")
        if isinstance(self.sparse.threshold, bool) or not isinstance(self.sparse.threshold, (int, float)) \
                or not 0 <= self.sparse.threshold <= 1:
            raise ConfigError(f"strategy.sparse_threshold is a fraction of rows and must be in [0, 1], got "
                              f"{self.sparse.threshold!r}; e.g. 0.1 (tables touching < 10% of rows per step are sparse)")
        _check_positive_int("strategy.cp", self.cp)
        if self.cp_mode not in CP_MODES:
            raise ConfigError(f"strategy.cp_mode (--cp-mode) must be one of {choices(CP_MODES)}, got {self.cp_mode!r}")
        others = self.tp * self.pp * self.cp
        dp = self.dp if self.dp is not None else world_size // others
        if (dp * others != world_size or dp < 1) and self.cp == 1:
            raise DegreesDoNotFit(world_size, self.dp, self.tp, self.pp)
        if dp * others != world_size or dp < 1:
            raise ConfigError(
                f"dp*tp*pp*cp = {self.dp if self.dp is not None else '?'}*{self.tp}*{self.pp}*{self.cp} does not "
                f"equal the number of processes ({world_size}); choose degrees whose product is {world_size}, "
                f"e.g. dp={max(1, world_size // others)} tp={self.tp} pp={self.pp} cp={self.cp}, or change --nproc"
            )
        return dataclasses.replace(self, dp=dp)

    def _resolved_stage_tp(self, world_size: int) -> Strategy:
        """--stage-tp: pp from the list, dp from nproc / sum; all-equal degrees become the uniform --tp.
        What it combines with is the rule table's (config/rules.py)."""
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
        checked = dataclasses.replace(self, stage_tp=None, tp=1, pp=len(degrees), dp=None,
                                      boundary="direct").resolved(len(degrees))
        return dataclasses.replace(checked, stage_tp=",".join(map(str, degrees)), dp=dp, boundary=self.pipeline.boundary)



_FLAT_INDEX: dict[str, FlatField] = {}


def _flat_index() -> dict[str, FlatField]:
    """{flat name: FlatField}, built once from the fields' metadata (a group field's `flat` name, else its own)."""
    if not _FLAT_INDEX:
        hints = typing.get_type_hints(Strategy)
        for f in dataclasses.fields(Strategy):
            if not f.metadata.get("group"):
                _FLAT_INDEX[f.name] = FlatField(f.name, f, hints[f.name], None, f.name)
        for group, cls in GROUPS.items():
            group_hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                name = f.metadata.get("flat", f.name)
                if name in _FLAT_INDEX:
                    raise TypeError(f"two strategy options are named {name!r} flat; give one a `flat` name")
                _FLAT_INDEX[name] = FlatField(name, f, group_hints[f.name], group, f.name)
    return _FLAT_INDEX


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
