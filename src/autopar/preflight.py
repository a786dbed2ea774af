"""Checks of a `train` job that need more than numbers, run once in the launching process before any rank starts.

`strategies.resolve` checks the strategy (degrees, schedule, batch sizes) from numbers alone. The
checks here need the job's files or its model: the `--resume` folder, the model's name and arguments,
its context length and its vocabulary against the tokenizer. Every rank would find the same errors,
but only after N copies of Python and torch had started (seconds each on a small machine), and the
user would read N copies of the message instead of one line before the launch.

What needs the model traced (tensor-parallel splits, pipeline stage counts) is checked by `autopar
train` (cli._check_traced_model) with the very functions the ranks call, on a sample of the job's own
data, so the two cannot disagree; the memory budget's recomputation plan stays with the ranks (it
depends on each stage's saved bytes per micro-batch). Jobs whose tokenizer must first be trained on the
data (`bpe`) or whose data must first be read (`--data`), and Hugging Face models (importing
transformers alone takes seconds), are left to the ranks: building them twice would cost what this
saves. A pretrained folder (`hf:PATH`) is still checked here as files, without transformers: the folder,
its config.json and its safetensors weights (single file, or an index whose shards are all present);
whether the weights match the model's parameters needs the model, and stays with the ranks.
"""

from __future__ import annotations

from .config import JobConfig

CHEAP_TOKENIZERS = ("byte",)


def check_before_launch(job: JobConfig) -> None:
    """Raise the error a rank would raise for this job's resume folder or model, here, once."""
    if job.train.resume:
        from .train.manifest import choose_checkpoint
        choose_checkpoint(job.train.resume)  # no such folder, no complete checkpoint, a damaged one
    check_data_files(job)
    check_export_folder(job)
    check_pretrained_folder(job.model.name)
    if job.strategy.cp > 1:  # every sequence is cut into 2 x cp equal chunks (context_parallel/layout.py)
        from .context_parallel.layout import check_divisible
        check_divisible(job.data.seq_len, job.strategy.cp, job.strategy.tp if job.strategy.sp else 1)
    if not cheap_to_build(job):
        return
    from .data import build_tokenizer, padded_vocab_size
    from .models import build_model
    tokenizer = build_tokenizer(job.data.tokenizer)
    _, info = build_model(job.model.name, job.model.args, vocab_size=padded_vocab_size(tokenizer.vocab_size),
                          device="meta")
    check_model_fits(info, tokenizer, job.data.seq_len)


def check_data_files(job: JobConfig) -> None:
    """--data and --eval-data name files that exist, each error naming the flag the path was given with."""
    from pathlib import Path
    from .errors import DataError
    if job.data.eval_data is not None and job.data.data is None:
        raise DataError(f"--eval-data {job.data.eval_data!r} is the held-out file of --data, which is not set (the "
                        f"embedded corpus holds out its own split); add --data FILE or drop --eval-data")
    for flag, path in (("--data", job.data.data), ("--eval-data", job.data.eval_data)):
        if path is not None and not Path(path).exists():
            raise DataError(f"{flag} {path!r}: no such file or folder (looked in {str(Path.cwd())!r} for a "
                            f"relative path)")


def check_export_folder(job: JobConfig) -> None:
    """--export-hf names a folder that holds no earlier export: an export never overwrites one (a resumed run
    keeps its --export-hf from config.toml, so a second export there is refused here, before any step)."""
    from .train.hf_export import in_use
    if job.train.export_hf and in_use(job.train.export_hf):
        from .errors import ConfigError
        raise ConfigError(f"--export-hf {job.train.export_hf!r} already holds files (an earlier export?) and an "
                          f"export never overwrites; pass --export-hf with a new folder, or delete that one first")


def schedule_warnings(job: JobConfig) -> list[str]:
    """What about the learning-rate schedule runs but is probably not what was meant (said once, before start)."""
    from .config import TrainConfig
    train = job.train
    default = " (the default)" if train.warmup_steps == TrainConfig().warmup_steps else ""
    if train.warmup_steps > train.steps:
        return [f"--warmup-steps {train.warmup_steps}{default} is longer than --steps {train.steps}: the learning rate "
                f"rises to {train.steps}/{train.warmup_steps} of --lr {train.lr:g} and never reaches it (nor "
                f"decays); use --warmup-steps {max(1, train.steps // 10)} (a tenth of the run) or more --steps"]
    return []


def cheap_to_build(job: JobConfig) -> bool:
    """A built-in model on the byte tokenizer and the embedded corpus: built here in a fraction of a rank's start."""
    return job.data.data is None and job.data.tokenizer in CHEAP_TOKENIZERS and not job.model.name.startswith("hf:")


def check_model_fits(info, tokenizer, seq_len: int) -> None:
    """The model's vocabulary holds the tokenizer's, and its context the sequence length (ranks check it too)."""
    from .errors import ConfigError
    if info.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"the {tokenizer.name} tokenizer has {tokenizer.vocab_size} tokens but the model "
                          f"{info.name} only {info.vocab_size} (vocab_size); use a tokenizer of at most "
                          f"{info.vocab_size} tokens, or a model with vocab_size >= {tokenizer.vocab_size}")
    if seq_len > info.max_seq_len:
        raise ConfigError(f"seq_len={seq_len} is longer than {info.name}'s context of {info.max_seq_len} "
                          f"positions; use --seq-len <= {info.max_seq_len} or a larger max_seq_len model argument")


def check_pretrained_folder(model_name: str) -> None:
    """`hf:PATH`: the folder exists and holds config.json and readable safetensors weights (headers only)."""
    if not model_name.startswith("hf:"):
        return
    from .models.hf import is_folder_name
    if not is_folder_name(model_name):
        return
    from pathlib import Path
    from .errors import ModelError
    from .models.pretrained import SafetensorsFolder
    folder = Path(model_name[3:])
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise ModelError(f"{model_name}: {str(folder)!r} is not a pretrained model folder (no config.json); save one "
                         f"with model.save_pretrained(PATH), or name an architecture as hf:<model_type>")
    SafetensorsFolder(folder).close()  # no such folder, no weights, an index naming missing shards


def layouts_for(graph, world: int, chunks: int = 1) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) of `world` processes the traced model runs: tp planned on it (heads, width,
    vocabulary) and pp x chunks stages cut from its blocks, with the functions the ranks call."""
    from .config.degrees import factorisations
    from .errors import AutoparError, ConfigError
    from .pipeline.build import check_stage_count
    from .tensor_parallel import plan_tensor_parallel
    tp_ok: dict[int, bool] = {}
    layouts = []
    for dp, tp, pp in factorisations(world):
        if tp not in tp_ok:
            try:
                tp_ok[tp] = tp == 1 or bool(plan_tensor_parallel(graph, tp).params)  # one that splits nothing: no
            except AutoparError:
                tp_ok[tp] = False
        try:
            if pp * chunks > 1:
                check_stage_count(graph, pp, chunks)
        except ConfigError:
            continue
        if tp_ok[tp]:
            layouts.append((dp, tp, pp))
    return layouts


def with_layouts_of_the_model(job: JobConfig, build, exc):
    """A degree error (config.degrees.DegreesDoNotFit) with the layouts this model runs on nproc processes,
    where the job is cheap to build and trace here; else the error as it was (its suggestions hold for any model)."""
    from .config.degrees import DegreesDoNotFit
    if job.strategy.stage_tp is not None or not cheap_to_build(job):
        return exc
    from .trace import trace
    from .train.fields import example_call
    parts = build()
    graph = trace(parts.model, *example_call(parts.model, parts.train_data))
    return DegreesDoNotFit(exc.world, exc.dp, exc.tp, exc.pp, layouts_for(graph, exc.world, job.strategy.pipeline.chunks),
                           model=parts.name)


def layouts_text_for(graph, job: JobConfig, strategy, name: str) -> str:
    """Which dp x tp x pp of the job's processes the traced model runs (the way out of a refused degree)."""
    from .config.degrees import layouts_text
    return layouts_text(layouts_for(graph, job.launch.nproc, strategy.pipeline.chunks), job.launch.nproc, strategy.tp,
                        strategy.pp, name)
