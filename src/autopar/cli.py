"""The `autopar` command.

    autopar train [--config FILE.toml] [--model gpt-mini] [--dp 4] [--steps 200] ...
    autopar launch --nproc 4 my_script.py [script args]
    autopar models [--hf]
    autopar checkpoints RUN_DIR
    autopar export RUN_DIR --to hf OUT
    autopar plan --model gpt-mini --pp 4
    autopar reproduce embrace|dpsgd|delayed-sgd [study options]

`train` flags are generated from the config dataclasses (config.py), one per field, with
the field's own help text. Under torchrun (RANK/WORLD_SIZE set) `train` runs as one rank
of the job; otherwise it starts `--nproc` local ranks of itself through the launcher.
Errors caused by input print one line, `autopar: error: ...`, and exit with status 2; a run
stopped by SIGTERM/SIGINT after saving a checkpoint exits with 75 (errors.PREEMPTED_EXIT), one
stopped by the hang watchdog with 124 (errors.HANG_EXIT).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any

from .config import (BOUNDARY_TRANSFERS, PARTITION_METHODS, SECTION_TYPES, FlatField, JobConfig, coerce, load_toml,
                     merge, section_fields)
from .dist_env import DistEnv
from .errors import AutoparError, ConfigError, Preempted
from .launch import EXIT_STATUSES


def _flag(f: FlatField) -> str:
    return f.field.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="TOML config file; flags override its values")
    for section, cls in SECTION_TYPES.items():
        group = parser.add_argument_group(f"[{section}]", (cls.__doc__ or "").strip().splitlines()[0])
        for f in section_fields(cls):
            flag, dest, help_text = _flag(f), f"{section}.{f.name}", f.field.metadata.get("help", "")
            default = f.field.default if f.field.default is not dataclasses.MISSING else None
            if section == "model" and f.name == "args":
                group.add_argument(flag, dest=dest, action="append", metavar="KEY=VALUE", help=help_text,
                                   default=argparse.SUPPRESS)
            elif f.hint is bool:
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                   help=f"{help_text} (default: {default})", default=argparse.SUPPRESS)
            else:
                group.add_argument(flag, dest=dest, metavar=f.name.upper(), help=f"{help_text} (default: {default})",
                                   default=argparse.SUPPRESS)


def _overrides(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Flags given on the command line as {section: {key: typed value}}."""
    out: dict[str, dict[str, Any]] = {}
    for dest, raw in vars(ns).items():
        if "." not in dest:
            continue
        section, key = dest.split(".", 1)
        if section == "model" and key == "args":
            args = {}
            for item in raw:
                if "=" not in item:
                    raise ConfigError(f"--model-arg {item!r}: expected KEY=VALUE, e.g. --model-arg n_layer=4")
                name, value = item.split("=", 1)
                args[name.strip()] = value.strip()
            value = args
        else:
            field = _field(section, key)
            value = coerce(raw, field.hint, _flag(field))
        out.setdefault(section, {})[key] = value
    return out


def _field(section: str, key: str) -> FlatField:
    return next(f for f in section_fields(SECTION_TYPES[section]) if f.name == key)


def resolve_job(ns: argparse.Namespace) -> JobConfig:
    """defaults < --config FILE (or, with --resume RUN_DIR alone, the run's own config.toml) < flags."""
    overrides = _overrides(ns)
    run = None
    if ns.config:
        job = load_toml(ns.config)
        if _run_folder_of(Path(ns.config).parent) is not None:  # a run's config.toml: a new run, not that one,
            # with dp re-derived for this --nproc (the file holds the dp that run resolved)
            job = merge(job, {"train": {"out": None, "resume": None}, "strategy": {"dp": None}})
    else:
        job = JobConfig()
        resume = overrides.get("train", {}).get("resume")
        run = _run_folder_of(Path(resume)) if resume else None
        if run is not None and (run / "config.toml").is_file():
            job = load_toml(run / "config.toml")
            # continue in the run's own folder; dp is re-derived, so a different --nproc reshards
            job = merge(job, {"train": {"out": str(run), "resume": None}, "strategy": {"dp": None}})
    job = merge(job, overrides)
    if run is not None:  # a plan the search chose for another --nproc: search again for this one
        from .elastic_plan import replan_on_resume
        job = replan_on_resume(job, run, overrides)
    job.validate()
    _check_same_run(job, overrides)
    return job


def _check_same_run(job: JobConfig, typed: dict) -> None:
    """--resume RUN with a model, tokenizer, data or vocabulary other than RUN's config.toml: refused, both named."""
    from .config.run_identity import check_same_run
    run = _run_folder_of(Path(job.train.resume)) if job.train.resume else None
    if run is not None and (run / "config.toml").is_file():
        check_same_run(job, load_toml(run / "config.toml"), str(run / "config.toml"), typed)


def _run_folder_of(path: Path) -> Path | None:
    """The run folder `path` is, or whose checkpoint it is; None when it is neither."""
    from .checkpoint_names import step_of
    if step_of(path) is not None and path.parent.name == "checkpoints":
        return path.parent.parent
    return path if (path / "run.json").is_file() or (path / "checkpoints").is_dir() else None


def cmd_train(ns: argparse.Namespace, argv: list[str]) -> int:
    job = resolve_job(ns)
    env = DistEnv.from_environ()
    if env.launched and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and not job.train.out:
        raise ConfigError("under torchrun --max-restarts, pass --out RUN_DIR: a restarted job resumes from the "
                          "checkpoints in that folder, and without it each start would pick a new one")
    if env.launched:
        if getattr(ns, "dry_run", False):
            raise ConfigError("--dry-run checks a run before autopar starts its processes, and under torchrun they "
                              "are started; run `autopar train ... --nproc N --dry-run` without torchrun")
        from .elastic_plan import agree_on_plan, searches_on_the_ranks
        from .job import run_job
        if searches_on_the_ranks(job):  # rank 0 plans for this world (again, if it changed); every rank runs it
            run_job(job, agree_on_plan(job))
        else:
            run_job(job)
        return 0
    from .memory_gate import dry_run
    if getattr(ns, "dry_run", False):  # every check and the plan, no process
        build = _job_builder(job)
        dry_run(job, build, lambda checked: _check_shrink(checked, _check_before_start(checked, build)), force=ns.force)
        return 0
    job, argv, resolved = _prepare_start(job, argv, force=ns.force)
    if job.launch.nproc > 1 or job.launch.max_restarts > 0:
        from .launch import launch
        out = job.train.out or f"runs/{datetime.now():%Y%m%d-%H%M%S}"
        command = [sys.executable, "-m", "autopar", *argv, "--out", out]
        on_rank_loss = None
        if job.launch.on_rank_loss == "shrink":  # go on with the surviving replicas (rank_loss.py)
            from .rank_loss import ShrinkOnRankLoss
            on_rank_loss = ShrinkOnRankLoss(job, resolved.strategy, out,
                                            lambda args: _restart_command(args, out, force=ns.force))
        return launch(command, job.launch.nproc, max_restarts=job.launch.max_restarts, run_dir=out,
                      on_rank_loss=on_rank_loss)
    from .job import run_job
    run_job(job)
    return 0


def _check_shrink(job, resolved):
    """--on-rank-loss shrink refused where it could not go on (as the start refuses it); returns `resolved`."""
    if job.launch.on_rank_loss == "shrink":
        from .rank_loss import check_can_shrink
        check_can_shrink(job, resolved.strategy, job.launch.nproc)
    return resolved


def _prepare_start(job, argv: list[str], *, force: bool):
    """The plan (searched or read) and every check before the ranks start: (job, the ranks' argv, resolved)."""
    from .memory_gate import check_memory, is_hand_set
    build = _job_builder(job)
    hand_set = is_hand_set(job)  # before --strategy auto or --plan makes it a plan
    if job.strategy.planning.mode == "auto" or job.strategy.planning.plan:
        from .autoplan import choose_before_launch  # search (or read the plan) once, here; ranks get plan.json
        job, argv = choose_before_launch(job, argv)
        build = _job_builder(job)
    resolved = _check_before_start(job, build)  # every check a rank would make first, before any process
    if hand_set:  # the memory model gates a strategy set by hand; the search checked its own
        verdict = check_memory(job, resolved, build, force=force)
        for warning in (verdict.warning, verdict.refusal):
            if warning:
                print(f"autopar: warning: {warning}", file=sys.stderr, flush=True)
    return job, argv, resolved


def _restart_command(args: list[str], out: str, *, force: bool):
    """The ranks' command for `autopar train ARGS` (a resume of the run on fewer ranks), prepared as a start
    is (plan searched again, every check), and the strategy it resolved to."""
    ns = build_parser().parse_args(args)
    job, argv, resolved = _prepare_start(resolve_job(ns), list(args), force=force)
    return [sys.executable, "-m", "autopar", *argv, "--out", out], resolved.strategy


def _job_builder(job):
    """build_job(job), made once however many checks ask for it."""
    import functools

    from .job import build_job
    return functools.cache(lambda: build_job(job))


def _check_before_start(job, build):
    """strategies.resolve, the resume folder and the model (preflight), and the traced model's checks."""
    from .config.degrees import DegreesDoNotFit
    from .preflight import check_before_launch, schedule_warnings, with_layouts_of_the_model
    from .strategies import resolve
    try:
        resolved = resolve(job.strategy, job.train, job.launch.nproc)  # every strategy check, before any process
    except DegreesDoNotFit as exc:
        raise with_layouts_of_the_model(job, build, exc) from None
    check_before_launch(job)  # the resume folder and the model, once, here
    _check_traced_model(job, resolved.strategy, build)
    for warning in schedule_warnings(job):
        print(f"autopar: warning: {warning}", file=sys.stderr, flush=True)
    return resolved


def _check_traced_model(job, strategy, build=None) -> None:
    """The checks that need the model traced, before ranks start: every tp degree planned on it (heads, width,
    vocabulary) and its pipeline's stage count against its blocks, with the functions the ranks call.

    Each rank would raise the same error, but only after N copies of Python and torch had started. Uniform
    layouts are checked for jobs cheap to build here (preflight.cheap_to_build; the others' ranks check);
    --stage-tp always (its boundaries need every stage's plan)."""
    from .preflight import cheap_to_build, layouts_text_for
    degrees = strategy.stage_tps or (strategy.tp,)
    if (max(degrees) == 1 and strategy.pp * strategy.pipeline.chunks == 1) or (
            strategy.stage_tps is None and not cheap_to_build(job)):
        return
    from .job import build_job
    from .pipeline.build import check_stage_count
    from .tensor_parallel import plan_tensor_parallel
    from .trace import trace
    from .train.fields import example_call
    parts = build() if build is not None else build_job(job)
    graph = trace(parts.model, *example_call(parts.model, parts.train_data))
    for t in sorted(set(degrees)):
        if t > 1:
            try:
                plan_tensor_parallel(graph, t)
            except ConfigError as exc:
                if strategy.stage_tps is None:
                    raise ConfigError(f"{exc}; {layouts_text_for(graph, job, strategy, parts.name)}") from None
                raise ConfigError(f"--stage-tp {job.strategy.stage_tp}: stage degree {t}: {exc}") from None
    if strategy.pp * strategy.pipeline.chunks > 1:
        try:
            check_stage_count(graph, strategy.pp, strategy.pipeline.chunks)
        except ConfigError as exc:
            if strategy.stage_tps is not None:
                raise
            raise ConfigError(f"{exc}; {layouts_text_for(graph, job, strategy, parts.name)}") from None


def cmd_launch(ns: argparse.Namespace) -> int:
    from .launch import launch
    if not os.path.exists(ns.script):
        raise ConfigError(f"script {ns.script!r} does not exist")
    return launch([sys.executable, ns.script, *ns.args], ns.nproc)


def cmd_checkpoints(ns: argparse.Namespace) -> int:
    from .train.manifest import describe
    print(describe(Path(ns.run_dir)))
    return 0


EXPORT_FORMATS = ("hf", "torch")


def cmd_export(ns: argparse.Namespace) -> int:
    from .train.hf_export import export_hf, in_use
    if ns.to not in EXPORT_FORMATS:
        raise ConfigError(f"export --to {ns.to!r}: the formats are hf (a Hugging Face folder) and torch (one "
                          f"state_dict file, any model)")
    if ns.max_shard_mb <= 0:
        raise ConfigError(f"--max-shard-mb must be > 0, got {ns.max_shard_mb}")
    if in_use(ns.out):
        raise ConfigError(f"export to {ns.out!r}: it already holds {'files' if Path(ns.out).is_dir() else 'a file'} "
                          f"(an earlier export?) and an export never overwrites; name a new "
                          f"{'folder' if ns.to == 'hf' else 'file'}, or delete it first")
    if ns.to == "torch":
        from .train.torch_export import export_torch
        out, entries = export_torch(ns.run_dir, ns.out)
        print(f"exported {ns.run_dir} to {out} (a PyTorch state_dict of {entries} entries: "
              f"model.load_state_dict(torch.load({str(out)!r})))")
        return 0
    out = export_hf(ns.run_dir, ns.out, max_shard_bytes=int(ns.max_shard_mb * 2**20))
    print(f"exported {ns.run_dir} to {out} (Hugging Face format: AutoModelForCausalLM.from_pretrained({str(out)!r}), "
          f"AutoTokenizer.from_pretrained({str(out)!r}) when the run has a tokenizer.json)")
    return 0


def cmd_models(ns: argparse.Namespace) -> int:
    if getattr(ns, "hf", False):
        from .models.hf import causal_lm_types
        types = causal_lm_types()
        print(f"{len(types)} Hugging Face causal-LM model types, each usable as --model hf:<type> "
              f"(small defaults; size them with --model-arg), or --model hf:PATH for a pretrained folder:")
        for model_type in types:
            print(f"  hf:{model_type}")
        return 0
    from .config.model_catalog import catalog_lines  # a table checked against the builders: no torch to start
    print("\n".join(catalog_lines()))
    return 0


def cmd_plan(ns: argparse.Namespace) -> int:
    """`autopar plan`: the cut, the tp split, per-stage degrees or the search's ranking (plan_command.py)."""
    from .plan_command import plan
    args = _overrides(argparse.Namespace(**{"model.args": ns.model_arg or []})).get("model", {}).get("args", {})
    return plan(ns, args)


def cmd_reproduce(ns: argparse.Namespace) -> int:
    from .reproduce import STUDIES, run_study
    if ns.study is None:
        for name, (_, about) in STUDIES.items():
            print(f"{name:12s} {about}")
        return 0
    return run_study(ns.study, ns.args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Train unmodified PyTorch models with data, "
                                     "tensor and pipeline parallelism chosen and applied for you.",
                                     epilog="exit statuses: " + "; ".join(f"{status}: {meaning}" for status, meaning
                                                                         in EXIT_STATUSES.items()))
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (default: gpt-mini on the embedded corpus, 4 processes)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_train_flags(train)
    train.add_argument("--dry-run", action="store_true", help="resolve the config, run every check before start "
                       "and the memory estimate, print the plan, and stop: no process starts (exit 0 if the run "
                       "would start, 2 with the error if it would be refused)")
    train.add_argument("--force", action="store_true", help="start even when the memory model predicts the run "
                       "cannot fit in this machine's memory (or the GPU's)")
    launch = sub.add_parser("launch", help="run a script on N local processes (as torchrun would)")
    launch.add_argument("--nproc", type=int, default=2, help="number of processes")
    launch.add_argument("script", help="the Python script to run on every rank")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    models = sub.add_parser("models", help="list the built-in models")
    sub.add_parser("rules", help="print what combines with what: the compatibility matrix of the rule table")
    models.add_argument("--hf", action="store_true", help="list every Hugging Face model type --model hf:<type> "
                        "accepts")
    export = sub.add_parser("export", help="write a run's final checkpoint in another format (--to hf: a folder "
                            "AutoModelForCausalLM and AutoTokenizer.from_pretrained load; --to torch: one "
                            "state_dict file of any model); never over an earlier export")
    export.add_argument("run_dir", help="run folder (its latest checkpoint) or a checkpoints/step_* folder")
    export.add_argument("--to", default="hf", help="format: hf | torch")
    export.add_argument("out", help="output folder (hf) or file (torch, e.g. model.pt); must not hold an export")
    export.add_argument("--max-shard-mb", type=float, default=2048, help="largest safetensors file (MiB); a larger "
                        "model is written as several files and an index")
    checkpoints = sub.add_parser("checkpoints", help="list a run folder's checkpoints, each verified against its "
                                 "manifest (complete, damaged, interrupted), and which one --resume would use")
    checkpoints.add_argument("run_dir", metavar="RUN_DIR", help="the run folder")
    plan = sub.add_parser("plan", help="show how a model would be cut into pipeline stages and split over "
                          "tensor-parallel ranks (no training)",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    plan.add_argument("--model", default="gpt-mini", help="model name (see `autopar models`)")
    plan.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="model argument (repeatable)")
    plan.add_argument("--pp", type=int, default=None, help="number of pipeline stages (default 2)")
    plan.add_argument("--stage-tp", default=None, help="per-stage tp degrees, e.g. 2,4: show each stage's degree "
                      "and ranks and each boundary's transfer (pp is the list's length)")
    plan.add_argument("--boundary", default="direct", choices=BOUNDARY_TRANSFERS, help="with --stage-tp: the "
                      "boundary transfer to show, as train's --boundary (direct: whole-tensor routes; the others: "
                      "the resharding plan of each boundary tensor, activation and gradient; auto: the cheapest "
                      "predicted on --cluster); equal degrees (e.g. 2,2) show Megatron's scatter-gather too")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: show which layers are split how, "
                      "and which stay replicated and why")
    plan.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism too (train's --sp): which "
                      "sums become reduce-scatters over the sequence")
    plan.add_argument("--ep", type=int, default=1, help="expert-parallel degree: show each mixture-of-experts "
                      "layer found, how many experts a rank would hold, and routing left replicated and why")
    plan.add_argument("--method", default="time", choices=PARTITION_METHODS,
                      help="balance equal layers, parameter counts, or forward+backward time")
    plan.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    plan.add_argument("--micro-batch-size", type=int, default=None, help="sequences per micro-batch (default: 8; "
                      "with --auto, the default layout's is train's default: the per-replica batch up to 8)")
    plan.add_argument("--memory-cap-mb", type=float, default=None, help="per-stage memory cap (MiB)")
    plan.add_argument("--measure", action="store_true", help="time every block instead of estimating from FLOPs")
    plan.add_argument("--json", action="store_true", help="print the partition as JSON")
    auto = plan.add_argument_group("strategy search (--auto)")
    auto.add_argument("--auto", action="store_true", help="search dp x tp x pp, micro-batching, schedule, "
                      "recomputation and partition for --nproc devices; print the top plans")
    auto.add_argument("--nproc", type=int, default=None, help="devices to plan for")
    auto.add_argument("--cluster", default=None, help="cluster TOML file (autopar calibrate) or preset: "
                      "v100-16gb-nvlink|a100-40gb|a100-80gb|h100-80gb|rtx3090-24gb-pcie|cpu-local (rough, never "
                      "measured); default: this machine, measured once per torch version and --nproc and cached")
    auto.add_argument("--memory-per-device-gb", type=float, default=None, help="override the cluster's memory")
    auto.add_argument("--top", type=int, default=5, help="plans to show")
    auto.add_argument("--cost-model", default="auto", choices=["auto", "measured", "flops"],
                      help="block times: measured on this machine (auto: when the cluster is this machine and the "
                           "model fits its memory) or traced FLOPs at the cluster's rate (flops)")
    auto.add_argument("--global-batch-size", type=int, default=32, help="sequences per optimizer step")
    auto.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "bf16-autocast"],
                      help="training precision, as `train --dtype` (priced, never switched)")
    auto.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "adagrad"],
                      help="optimizer, as `train --optimizer` (its state is priced; ZeRO needs one with state)")
    auto.add_argument("--mcmc-steps", type=int, default=0, help="then refine the winner by an MCMC walk over "
                      "per-stage cuts and recomputation (0: off)")
    calibrate = sub.add_parser("calibrate", help="measure this machine (compute, gloo links, overhead), write "
                               "a cluster TOML for `--cluster FILE` and refresh the calibration `--strategy auto` "
                               "caches for --nproc")
    calibrate.add_argument("--nproc", type=int, default=2, help="local ranks to measure collectives with")
    calibrate.add_argument("--out", default="cluster.toml", help="where to write the cluster file")
    calibrate.add_argument("--per-rank", action="store_true", help="also each rank's own matmul rate and the link "
                           "between every pair of ranks, written as [[devices]] and [[links]] (heterogeneous.md)")
    reproduce = sub.add_parser("reproduce", help="rerun a paper's experiment and print its table "
                               "(`autopar reproduce` lists them; `autopar reproduce NAME --help` shows options)")
    reproduce.add_argument("study", nargs="?", help="which experiment")
    reproduce.add_argument("args", nargs=argparse.REMAINDER, help="options for the study")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    rank = DistEnv.from_environ()
    where = f" (rank {rank.rank} of {rank.world_size})" if rank.world_size > 1 else ""
    try:
        if ns.command == "train":
            code = cmd_train(ns, argv)
        elif ns.command == "launch":
            code = cmd_launch(ns)
        elif ns.command == "plan":
            code = cmd_plan(ns)
        elif ns.command == "calibrate":
            from .search.calibrate import cmd_calibrate
            code = cmd_calibrate(ns)
        elif ns.command == "reproduce":
            code = cmd_reproduce(ns)
        elif ns.command == "checkpoints":
            code = cmd_checkpoints(ns)
        elif ns.command == "export":
            code = cmd_export(ns)
        elif ns.command == "rules":
            from .config.rules_matrix import render_matrix
            print(render_matrix(), end="")
            code = 0
        else:
            code = cmd_models(ns)
    except Preempted as exc:  # a checkpoint was saved: resumable
        if rank.rank == 0:
            print(f"autopar: {exc}", file=sys.stderr, flush=True)
        _exit(exc.exit_code)
    except AutoparError as exc:
        print(f"autopar: error{where}: {exc}", file=sys.stderr, flush=True)
        _exit(2)
    except KeyboardInterrupt:
        _exit(130)
    except Exception as exc:  # a bug, or a failure on another rank: keep the traceback, add one summary line
        traceback.print_exc()
        print(f"autopar: failed{where}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr, flush=True)
        _exit(1)
    if "torch.distributed" in sys.modules:  # a command that never imported torch has no group to leave
        from .distributed import shutdown
        shutdown()
    return code


def _exit(code: int) -> None:
    """Leave at once: a failed rank must not wait in process-group teardown for peers that may be gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
