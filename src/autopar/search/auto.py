"""`--strategy auto` and `--plan`: the search's winner as a concrete Strategy, saved as a plan and read back.

`plan_auto` profiles the model (one trace at micro-batch 1), scores every configuration the
search space allows on the cluster model (search.py), keeps the ones the runtime accepts, and
returns a `Plan`: the winning Strategy fields, the micro-batch settings, the prediction and the
runners-up. `resolve_choice` is the one place where a Strategy that says `search = "auto"` or
names a `plan` becomes a concrete one; strategies.resolve() calls it, in the CLI before any
process starts and in the Trainer on every rank, so a bad plan fails the same way everywhere.

A plan is plain JSON (the `autopar plan --auto --json` output is one), so it can be read,
edited, kept and rerun; after a run the Trainer adds what it measured beside the prediction.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..config import Strategy, TrainConfig
from ..errors import ConfigError
from .calibration_cache import STALE_ERROR, mark_stale, note, search_cluster
from .coverage import not_covered
from .command import plan_dict
from .cluster_pricing import even_shares, plan_cluster, step_model
from .cost import Candidate
from .measure_profile import measure_module_blocks, with_cost_model
from .profile import profile_graph
from .decision import decide, default_layout, kept_plans
from .plan_text import configuration as _configuration
from .plan_text import costs as _costs
from .plan_text import milliseconds, same_plan, versus
from .search import SearchSpace, divisors, enumerate_candidates, exhaustive, require_fit

TOP_K = 5  # plans kept in plan.json (the winner and its runners-up; decision.kept_plans)
Example = Callable[[], tuple[tuple, dict]]  # (args, kwargs) of one sample, as the model is traced


@dataclass
class Plan:
    """A chosen strategy and why: `.strategy`, `.train` (TrainConfig updates), the prediction, the runners-up.

    `record` is the JSON form, kept whole so a saved plan round-trips exactly.
    """

    record: dict
    source: str = "plan"  # where it was read from, for error messages

    @property
    def strategy(self) -> Strategy:
        return Strategy(**self.record["strategy"])

    @property
    def train(self) -> dict[str, Any]:
        return dict(self.record["train"])

    @property
    def nproc(self) -> int:
        s = self.record["strategy"]
        return int(self.record.get("nproc") or s["dp"] * s.get("tp", 1) * s.get("pp", 1) * s.get("cp", 1))

    @property
    def step_time_s(self) -> float | None:
        return self.record.get("prediction", {}).get("step_time_s")

    def __str__(self) -> str:
        return self.describe()

    def configuration(self) -> str:
        """The chosen strategy in one phrase: degrees, schedule, micro-batches, recomputation, cut."""
        return _configuration(self.record)

    def describe(self) -> str:
        """The one-line banner: what runs, what it should cost, against the best structurally different
        runner-up and the default layout (numbers that differ), and what was measured."""
        searched = self.source in ("the search", "the confirmed search")
        record, prediction = self.record, self.record.get("prediction")
        default = record.get("default_layout") or {}
        is_default = bool(default.get("runnable")) and same_plan(default, record)
        verb = ("auto: runs the default layout" if is_default else "auto: picked") if searched else \
            f"plan {self.source}: runs"
        text = f"{verb} {_configuration(record)}"
        if prediction:
            text += f"; predicted {_costs(prediction)}"
        alternatives = record.get("alternatives") or []
        if alternatives and prediction:
            faster = alternatives[0]["prediction"]["step_time_s"] < prediction["step_time_s"]
            label = "the search's best" if faster else "runner-up"
            text += f"; {label} {_configuration(alternatives[0])}, {versus(alternatives[0]['prediction'], prediction)}"
        shown = alternatives[:1]
        if searched and prediction and default.get("runnable") and not is_default and \
                not any(same_plan(default, r) for r in shown):
            text += f"; default layout {_configuration(default)}, " + (
                versus(default["prediction"], prediction) if default.get("fits", True) else
                f"over the memory ({max(default['prediction']['peak_memory_bytes_per_rank']) / 2**20:.1f} MiB/rank)")
        decision = record.get("decision") or {}
        if decision.get("runs") == "default" and "model_error" in decision:
            text += f" (within the model's {decision['model_error']:.0%} error: the default stays)"
        confirmed = record.get("confirm")
        if confirmed:
            ran = sorted((c for c in confirmed if "measured_step_time_s" in c), key=lambda c: c["measured_step_time_s"])
            fastest = milliseconds(ran[0]["measured_step_time_s"])
            if decision.get("kept_default"):  # the fastest measured beat the default by no more than the noise
                kept = next(c for c in ran if c.get("default_layout"))
                text += (f"; measured {len(confirmed)}, kept the default ({milliseconds(kept['measured_step_time_s'])}"
                         f" ms/step): the fastest, {_configuration(ran[0])}, {fastest} ms/step, is within the "
                         f"measurement's {decision['measured_margin']:.0%} noise")
            else:
                text += f"; kept the fastest of {len(confirmed)} measured ({fastest} ms/step"
                if len(ran) > 1:
                    text += f"; next {_configuration(ran[1])}, {milliseconds(ran[1]['measured_step_time_s'])} ms/step"
                text += ")"
        mixed = record.get("cluster_plan")
        if mixed:  # a cluster with per-device speeds: where each rank runs (cluster_pricing.py)
            text += f"; ranks on cluster devices {' '.join(str(k) for k in mixed['placement'])}"
        calibration = note(self.record.get("search", {}).get("calibration"))
        if calibration:
            text += f"; priced on {calibration}"
        return text

    def measured_vs_predicted(self) -> str:
        """The end-of-run line: measured step time and peak memory beside the prediction (plan.json's `measured`)."""
        measured, predicted = self.record.get("measured"), self.record.get("prediction")
        if not measured or not predicted:
            return "plan: nothing measured to compare with the prediction"
        took, said = measured["median_step_time_s"], predicted["step_time_s"]
        text = (f"plan: measured {milliseconds(took)} ms/step against {milliseconds(said)} predicted "
                f"({took / said - 1:+.0%})")
        peak = max(measured.get("peak_memory_bytes_per_pipeline_rank") or [0])
        tensors = max(measured.get("peak_tensor_bytes_per_pipeline_rank") or [0])
        planned = max(predicted.get("peak_memory_bytes_per_rank") or [0])
        whole = "ru_maxrss" in measured.get("peak_memory_source", "")
        if tensors and planned:  # like with like: live tensor bytes, counted, against the tensors predicted
            text += (f"; peak live tensors {tensors / 2**20:.1f} MiB/rank against {planned / 2**20:.1f} MiB "
                     f"predicted ({tensors / planned - 1:+.0%})"
                     + (f"; whole process {peak / 2**20:.1f} MiB/rank (RSS)" if whole and peak else ""))
        elif peak and planned:
            text += (f"; peak memory {peak / 2**20:.1f} MiB/rank against {planned / 2**20:.1f} MiB predicted"
                     + (" (measured: the whole process; predicted: tensors)" if whole else
                        f" ({peak / planned - 1:+.0%})"))
        trial = next((c for c in self.record.get("confirm") or []
                      if same_plan(c, self.record) and "measured_step_time_s" in c), None)
        if trial is not None:  # the same plan as the measuring launch timed it, before the run
            text += (f"; the measuring launch timed it at {milliseconds(trial['measured_step_time_s'])} ms/step "
                     f"(the slowest rank's step from a common start; here: rank 0's steps, back to back)")
        return text

    # ------------------------------------------------------------------ files

    def record_measured(self, measured: Measured, run_dir: Path) -> None:
        """plan.json gets what the run measured beside the prediction, and the console the comparison."""
        self.record["measured"] = measured.to_dict()
        self.save(run_dir / "plan.json")
        print(self.measured_vs_predicted(), flush=True)
        took, said = self.record["measured"]["median_step_time_s"], (self.step_time_s or 0.0)
        calibration = self.record.get("search", {}).get("calibration")
        if said > 0 and mark_stale(calibration, took / said - 1, self.nproc):
            print(f"plan: this machine's cached calibration ({calibration['cache']}) is off by more than "
                  f"{STALE_ERROR:.0%} for this run; the next search measures it again", flush=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.record, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"--plan {str(path)!r} does not exist; give a run folder's plan.json or the output of "
                              f"`autopar plan --auto --json`") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--plan {str(path)!r} is not a readable JSON plan: {exc}") from None
        return cls.from_record(record, source=str(path))

    @classmethod
    def from_record(cls, record: Any, *, source: str = "plan") -> Plan:
        """Check the fields a run needs, naming the first that is missing or wrong."""
        if not isinstance(record, dict):
            raise ConfigError(f"{source}: a plan is a JSON object, got {type(record).__name__}")
        for table, required in (("strategy", ("dp", "tp", "pp")), ("train", ("global_batch_size", "micro_batch_size"))):
            values = record.get(table)
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: missing table {table!r} (a plan holds 'strategy' and 'train')")
            for key in required:
                if not isinstance(values.get(key), int) or values[key] < 1:
                    raise ConfigError(f"{source}: field {table}.{key} must be a positive integer, got "
                                      f"{values.get(key)!r}")
        strategy_keys = {f.name for f in Strategy.flat_fields()}
        train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
        for table, known in (("strategy", strategy_keys), ("train", train_keys)):
            unknown = sorted(set(record[table]) - known)
            if unknown:
                raise ConfigError(f"{source}: unknown field {table}.{unknown[0]}; a plan's {table} table holds "
                                  f"{table.capitalize() if table == 'strategy' else 'TrainConfig'} fields")
        plan = cls(record=record, source=source)
        if plan.strategy.planning.mode != "manual" or plan.strategy.planning.plan:
            raise ConfigError(f"{source}: field strategy.search / strategy.plan: a plan holds a concrete strategy, "
                              f"not another search or plan")
        return plan

    # ------------------------------------------------------------------ applying

    def check_for(self, world: int, num_params: int | None = None, model_name: str | None = None) -> None:
        """Refuse a plan made for another process count or another model, naming both."""
        if self.nproc != world:
            raise ConfigError(f"{self.source} was made for {self.nproc} processes, this run has {world}; rerun "
                              f"`--strategy auto` (or `autopar plan --auto --nproc {world}`) for {world}")
        planned = self.record.get("num_params")
        if num_params is not None and planned is not None and planned != num_params:
            raise ConfigError(f"{self.source} was made for {self.record.get('model', 'another model')} "
                              f"({planned:,} parameters), this run trains {model_name or 'a model'} with "
                              f"{num_params:,} parameters; plan this model with --strategy auto")

    def apply(self, strategy: Strategy, config: TrainConfig) -> tuple[Strategy, TrainConfig]:
        """The plan's fields over `strategy` and `config`; a value the user set that contradicts it is refused.

        'Set' means different from the field's default (a flag or a config value), so `--steps`,
        `--lr` or `--out` combine with any plan, and `--pp 2` with a plan for pp=2.
        """
        chosen = dict(self.record["strategy"])
        train = self.train
        _refuse_conflicts(self.source, "strategy", strategy, chosen)
        _refuse_conflicts(self.source, "train", config, train)
        cluster = plan_cluster(self.record, strategy.planning.cluster, self.source)  # a mixed cluster's cut
        strategy = dataclasses.replace(strategy, **chosen, search="manual", plan=None, confirm=0, cluster=cluster)
        return strategy, dataclasses.replace(config, **train)

    def to_json(self) -> str:
        return json.dumps(self.record, indent=2)


def _refuse_conflicts(source: str, table: str, given: Any, planned: dict) -> None:
    def flat(obj: Any) -> dict[str, Any]:  # a Strategy by its flat option names, a TrainConfig by its fields
        return obj.flat() if isinstance(obj, Strategy) else vars(obj)
    mine_all, defaults = flat(given), flat(type(given)())
    for key, value in planned.items():
        mine = mine_all[key]
        if mine != defaults[key] and mine != value:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"{flag} {mine} contradicts {source}, which has {table}.{key} = {value}; drop {flag} "
                              f"to run the plan, or drop the plan to choose yourself")


# ---------------------------------------------------------------------- the search, constrained


def fixed_fields(strategy: Strategy, config: TrainConfig) -> dict[str, Any]:
    """What the user fixed beside `--strategy auto`: every searched field set away from its default."""
    given, defaults, train_defaults = strategy.flat(), Strategy().flat(), TrainConfig()
    fixed = {k: given[k] for k in ("dp", "tp", "pp", "schedule", "chunks", "partition", "recompute", "zero", "ep",
                                   "sp", "cp", "cp_mode") if given[k] != defaults[k]}
    if config.compile:
        fixed["compile"] = True
    for k in ("micro_batch_size", "micro_batches"):
        if getattr(config, k) != getattr(train_defaults, k):
            fixed[k] = getattr(config, k)
    return fixed


def _matches(c: Candidate, fixed: dict[str, Any]) -> bool:
    for key, value in fixed.items():
        if key == "micro_batches":
            ok = c.num_microbatches == value
        elif key == "recompute":
            ok = c.recompute == value
        elif key == "micro_batch_size":
            ok = c.micro_batch_size == value
        else:
            ok = getattr(c, key) == value
        if not ok:
            return False
    return True


def plan_auto(model: nn.Module, nproc: int, *, example: Example, global_batch_size: int, name: str | None = None,
              cluster: str | None = None, memory_per_device_gb: float | None = None, dtype: str = "fp32",
              fixed: dict[str, Any] | None = None, accept: Callable[[Strategy, TrainConfig], None] | None = None,
              config: TrainConfig | None = None, top: int = TOP_K, cost_model: str = "auto") -> Plan:
    """Search the strategies for `model` on `nproc` devices and return the best as a Plan.

    `example()` gives the traced call of one sample; `fixed` holds fields the user chose (they
    stay); `accept(strategy, config)` raises for a configuration the runtime refuses (the
    strategy table's checks), so only runnable plans are returned. `cost_model`: "auto" measures the
    blocks on this machine where the cluster is this machine and the model fits (measure_profile.py),
    "flops" scores traced FLOPs at the cluster's rate, "measured" insists on measuring.
    """
    from ..trace import trace
    fixed = dict(fixed or {})
    cl, calibration = search_cluster(cluster, nproc=nproc, memory_per_device_gb=memory_per_device_gb)
    args, kwargs = example()
    seq_len = int(args[0].shape[-1]) if args[0].dim() >= 2 else 1
    name = name or type(model).__name__
    tps = tuple(d for d in divisors(nproc) if d <= cl.devices_per_node)
    if "tp" in fixed:
        tps = tuple(sorted({1, fixed["tp"]}))
    profile = profile_graph(trace(model, args, kwargs), name=name, seq_len=seq_len, tp_degrees=tps, model=model)
    profile, costs = with_cost_model(profile, cl, cost_model, lambda: _measure(model, args, kwargs, seq_len))
    if fixed.get("tp", 1) > 1 and fixed["tp"] not in profile.tp:
        raise ConfigError(f"--tp {fixed['tp']} cannot be used for {name}: {profile.tp_refused.get(fixed['tp'])}")
    step = step_model(profile, cl, global_batch_size=global_batch_size, dtype=dtype,  # priced with the run's optimizer
                      optimizer=config.optimizer if config is not None else "adamw",
                      clip_gradients=config.grad_clip > 0 if config is not None else True)
    step.run_steps = config.steps if config is not None else None  # what a compile time is amortised over
    space = SearchSpace(nproc=nproc)
    if "schedule" in fixed:
        space = dataclasses.replace(space, schedules=(fixed["schedule"],))
    if "chunks" in fixed:
        space = dataclasses.replace(space, chunks=(fixed["chunks"],))
    if "compile" in fixed:  # --compile beside auto: compiled candidates only (priced eager where not measured)
        space = dataclasses.replace(space, compile=(True,))
    candidates = [c for c in enumerate_candidates(step, space) if _matches(c, fixed)]
    if not candidates:
        given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in fixed.items())
        raise ConfigError(f"--strategy auto found no configuration of {name} on {nproc} processes with global batch "
                          f"{global_batch_size}" + (f" and {given}" if given else "")
                          + "; fix fewer fields, or use a global batch size divisible by more degrees")
    result = exhaustive(step, space, candidates)
    require_fit(result, step)
    train = config or TrainConfig(global_batch_size=global_batch_size)

    def runnable(estimate) -> tuple[dict | None, str | None]:
        record = plan_dict(estimate, step)
        if accept is not None:
            try:
                accept(Plan(record).strategy, dataclasses.replace(train, **record["train"]))
            except ConfigError as exc:
                return None, str(exc)
        return record, None

    chosen, refusals = kept_plans(result.ranked, runnable, top)
    if not chosen:
        raise ConfigError(f"--strategy auto: every configuration that fits was refused by the runtime, e.g. "
                          f"{refusals[0]}")
    default = default_layout(even_shares(step), nproc, global_batch_size, fixed, train, runnable)
    record = decide(chosen, default, step)
    record.update(nproc=nproc, num_params=profile.num_params,
                  search={"evaluated": result.evaluated, "collapsed_equivalent": result.collapsed,
                          "pruned_memory": result.pruned, "refused_by_runtime": len(refusals), "fixed": fixed,
                          "cluster_source": cl.source, "calibration": calibration, "costs": costs,
                          "memory_per_device_gb": cl.memory_per_device_gb, "not_covered": not_covered()})
    return Plan(record, source="the search")


def _measure(model: nn.Module, args: tuple, kwargs: dict, seq_len: int):
    """Measured block costs where the model is called on token ids alone (the blocks are run on those)."""
    if kwargs or len(args) != 1 or args[0].dim() != 2 or args[0].is_floating_point():
        raise ConfigError("the model is not called on one (batch, sequence) tensor of token ids, which is what "
                          "the block measurement feeds it")
    return measure_module_blocks(model, seq_len=seq_len)


def resolve_choice(strategy: Strategy, config: TrainConfig, world: int, *, model: nn.Module | None = None,
                   example: Example | None = None, plan: Plan | None = None, model_name: str | None = None,
                   accept: Callable[[Strategy, TrainConfig], None] | None = None,
                   ) -> tuple[Strategy, TrainConfig, Plan | None]:
    """A concrete (strategy, config) from a plan, a search, or as given; with the plan that chose it."""
    if plan is None and strategy.planning.plan:
        plan = Plan.load(strategy.planning.plan)
    if plan is not None:
        num_params = _count_parameters(model) if model is not None else None
        plan.check_for(world, num_params, model_name)
        strategy, config = plan.apply(strategy, config)
        return strategy, config, plan
    if strategy.planning.mode != "auto":
        return strategy, config, None
    # what the search covers is the rule table's (config/rules.py, phase "search"), checked by resolve()
    fixed_product = (strategy.dp or 1) * strategy.tp * strategy.pp
    if world % fixed_product:  # (a product that divides but leaves no valid rest: plan_auto names it)
        raise ConfigError(f"--strategy auto with dp={strategy.dp or '?'} tp={strategy.tp} pp={strategy.pp}: the "
                          f"degrees fixed multiply to {fixed_product}, which does not divide the {world} processes; "
                          f"fix degrees whose product divides {world}, or fix fewer")
    if model is None or example is None:
        raise ConfigError("--strategy auto needs the model to search for; pass it to the Trainer (or run autopar "
                          "train), or give a saved plan with --plan")
    config.validate()
    fixed = fixed_fields(strategy, config)
    found = plan_auto(model, world, example=example, global_batch_size=config.global_batch_size, name=model_name,
                      cluster=strategy.planning.cluster, memory_per_device_gb=strategy.planning.memory_per_device_gb, dtype=config.dtype,
                      fixed=fixed, accept=accept, config=config)
    strategy, config = found.apply(strategy, config)  # the fixed fields agree with the plan by construction
    return strategy, config, found


def _count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@dataclass
class Measured:
    """What a run measured, to set beside the prediction in plan.json."""

    step_times_s: list[float]
    peak_memory_bytes_per_rank: list[int]
    peak_memory_source: str
    pp: int
    ranks_per_stage: int  # dp x tp ranks share a pipeline rank (pp is the outermost mesh dimension)
    extra: dict = field(default_factory=dict)
    peak_tensor_bytes_per_rank: list[int] | None = None  # live tensors, counted during one step (live_memory.py)
    tensor_step: int | None = None  # that step's place in step_times_s: slowed by the counting, left out of the median

    def to_dict(self) -> dict:
        # the first step warms caches and allocators; the step counted for tensor memory ran slower
        times = [t for i, t in enumerate(self.step_times_s) if i and i != self.tensor_step] or self.step_times_s
        over = "the only step" if len(self.step_times_s) == 1 else "steps after the first" + (
            ", but the one counted for tensor memory" if self.tensor_step else "")
        out = {"median_step_time_s": statistics.median(times), "step_times_s": self.step_times_s, "median_over": over,
               "peak_memory_bytes_per_rank": self.peak_memory_bytes_per_rank,
               "peak_memory_bytes_per_pipeline_rank": self._per_pipeline_rank(self.peak_memory_bytes_per_rank),
               "peak_memory_source": self.peak_memory_source}
        if self.peak_tensor_bytes_per_rank is not None:
            out.update(peak_tensor_bytes_per_rank=self.peak_tensor_bytes_per_rank,
                       peak_tensor_bytes_per_pipeline_rank=self._per_pipeline_rank(self.peak_tensor_bytes_per_rank),
                       peak_tensor_source=f"live tensor storages, counted during step {(self.tensor_step or 0) + 1} "
                                          f"of this run (search/live_memory.py): the quantity the memory model predicts")
        return {**out, **self.extra}

    def _per_pipeline_rank(self, per_rank: list[int]) -> list[int]:
        return [max(per_rank[r * self.ranks_per_stage:(r + 1) * self.ranks_per_stage]) for r in range(self.pp)]
