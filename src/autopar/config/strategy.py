"""The [strategy] section: how the model is spread over processes, and the choices it is checked against.

Kept apart from the other sections (config/__init__.py) because it is the largest and the one the
strategy table, the search and every engine read; the valid choices are named here once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, choices
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
    tied_delay: int | None = _f(None, "--schedule pipedream: how many steps late a weight tied across stages (an "
                                      "embedding and output head) takes its summed gradient; default pp - 1, so its "
                                      "owners never wait for each other; 0 sums each step's at once (they meet every "
                                      "step)")
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
    batchnorm: str = _f("exact", f"BatchNorm statistics: {'|'.join(BATCHNORM_MODES)}. exact: one process's over the "
                                 "same micro-batches (each normalised with its own statistics; the running buffers "
                                 "updated once per micro-batch of the global batch, in order, on every rank). sync: "
                                 "micro-batch i of every replica normalised together, with their joint statistics "
                                 "(as torch's SyncBatchNorm, on any device; one process running dp x the "
                                 "micro-batch size when each replica has one micro-batch)")
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
                                   "name; default: --strategy auto measures this machine once and caches it "
                                   "(cpu-local: the rough preset, never measured), --boundary auto cpu-local")
    memory_per_device_gb: float | None = _f(None, "memory per device to plan for (GiB): --strategy auto's search "
                                                  "(default: the cluster's) and the memory check of a strategy set "
                                                  "by hand (default: this host's available memory over its ranks, "
                                                  "or the GPU's)")
    confirm: int | None = _f(None, "--strategy auto: run the top K plans (the default layout among them) for a few "
                                   "steps each and keep the fastest measured; unset: measure the plans whose "
                                   "predictions are within the model's error of each other; 0: never measure")
    # Context parallelism (context_parallel/): the sequence split over cp ranks.
    cp: int = _f(1, "context-parallel degree: every sequence split over cp ranks (between dp and tp); attention "
                    "runs over the whole sequence by --cp-mode, positions and masks follow each rank's tokens")
    cp_mode: str = _f("ring", "how attention sees the whole sequence under --cp: ring (key/value blocks passed "
                              "around, load-balanced causal chunks) | all-to-all (sequence swapped for heads; "
                              "heads divisible by cp)")

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
        if self.batchnorm not in BATCHNORM_MODES:
            raise ConfigError(f"strategy.batchnorm (--batchnorm) must be one of {choices(BATCHNORM_MODES)}, "
                              f"got {self.batchnorm!r}")
        if self.stage_tp is not None:
            return self._resolved_stage_tp(world_size)
        for name in ("tp", "pp"):
            _check_positive_int(f"strategy.{name}", getattr(self, name))
        if self.dp is not None:
            _check_positive_int("strategy.dp", self.dp)
        _check_positive_int("strategy.chunks", self.chunks)
        _check_positive_int("strategy.tp_subbatches", self.tp_subbatches)
        schedule_spec(self.schedule)  # an unknown name is refused with the schedule table's names
        if self.partition not in PARTITION_METHODS:
            raise ConfigError(f"unknown partition method {self.partition!r}; use one of {choices(PARTITION_METHODS)}")
        if self.gossip_order not in GOSSIP_ORDERS:
            raise ConfigError(f"strategy.gossip_order must be one of {choices(GOSSIP_ORDERS)}, "
                              f"got {self.gossip_order!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"strategy.recompute must be one of {choices(RECOMPUTE_MODES)}, got {self.recompute!r}")
        if self.dp_mode not in DP_MODES:
            raise ConfigError(f"strategy.dp_mode must be one of {choices(DP_MODES)}, got {self.dp_mode!r}")
        if self.search not in SEARCH_MODES:
            raise ConfigError(f"strategy.search (--strategy) must be one of {choices(SEARCH_MODES)}, got {self.search!r}")
        if self.confirm is not None:
            _check_nonnegative_int("strategy.confirm", self.confirm)
        _check_nonnegative_int("strategy.staleness", self.staleness)  # parameter server (async_sgd/)
        if self.tied_delay is not None:
            _check_nonnegative_int("strategy.tied_delay", self.tied_delay)
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
        _check_positive_int("strategy.cp", self.cp)
        if self.cp_mode not in CP_MODES:
            raise ConfigError(f"strategy.cp_mode (--cp-mode) must be one of {choices(CP_MODES)}, got {self.cp_mode!r}")
        others = self.tp * self.pp * self.cp
        dp = self.dp if self.dp is not None else world_size // others
        if dp * others != world_size or dp < 1:
            cp_text = "*cp" if self.cp > 1 else ""
            raise ConfigError(
                f"dp*tp*pp{cp_text} = {self.dp if self.dp is not None else '?'}*{self.tp}*{self.pp}"
                f"{f'*{self.cp}' if self.cp > 1 else ''} does not equal "
                f"the number of processes ({world_size}); choose degrees whose product is {world_size}, "
                f"e.g. dp={max(1, world_size // others)} tp={self.tp} pp={self.pp}"
                f"{f' cp={self.cp}' if self.cp > 1 else ''}, or change --nproc"
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
        return dataclasses.replace(checked, stage_tp=",".join(map(str, degrees)), dp=dp, boundary=self.boundary)


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
