"""What a run folder's config.toml must pin down: where its files are, and what its checkpoints were trained on.

Paths are written absolute (the ones typed, relative to the directory the run started in, are kept as a
comment), so `--resume RUN` and `--config RUN/config.toml` work from any directory. A run's model,
tokenizer, data and vocabulary are its identity: its checkpoints hold weights of that model over that
vocabulary, so resuming it with another one would load or rename the wrong thing; a flag that contradicts
the folder is refused with both values, as a plan's contradicting flag is.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# (section, key, flag) of every value that names a file or folder; hf: values only when they name a path
PATH_FIELDS = (("model", "name", "--model"), ("data", "tokenizer", "--tokenizer"), ("data", "data", "--data"),
               ("data", "eval_data", "--eval-data"), ("data", "data_cache", "--data-cache"),
               ("train", "export_hf", "--export-hf"), ("strategy", "plan", "--plan"),
               ("strategy", "cluster", "--cluster"), ("strategy", "topology", "--topology"))
NAME_OR_FILE = ("cluster", "topology")  # a preset or graph name, or a file: only an existing file is a path
IDENTITY_FIELDS = (("model", "name", "--model"), ("data", "tokenizer", "--tokenizer"), ("data", "data", "--data"),
                   ("data", "eval_data", "--eval-data"), ("data", "corpus", "--corpus"),
                   ("data", "vocab_size", "--vocab-size"))
TRAINED_TOKENIZERS = ("word", "bpe")  # the ones --vocab-size sizes


def _value(section: Any, key: str) -> Any:
    """A section's option by the name TOML gives it (a Strategy's options are named flat, see Strategy.flat)."""
    return section.flat()[key] if hasattr(section, "flat_fields") else getattr(section, key)


def absolute(key: str, value: Any) -> Any:
    """`value` with its path made absolute (hf:PATH keeps its prefix; hf:<model_type> and plain names stay)."""
    if not isinstance(value, str) or not value:
        return value
    if key in ("name", "tokenizer"):
        if not value.startswith("hf:"):
            return value
        rest = value[3:]
        if key == "name" and not ("/" in rest or rest.startswith(".") or Path(rest).exists()):
            return value  # an architecture by name (hf:llama), not a folder
        return "hf:" + str(Path(rest).expanduser().resolve())
    if key in NAME_OR_FILE and not Path(value).is_file():
        return value
    return str(Path(value).expanduser().resolve())


def with_absolute_paths(job: Any) -> tuple[Any, dict[str, str]]:
    """The job with every path absolute, and {section.key: value as given} of those that changed."""
    given, sections = {}, {}
    for section, key, _ in PATH_FIELDS:
        value = _value(getattr(job, section), key)
        resolved = absolute(key, value)
        if resolved != value:
            given[f"{section}.{key}"] = value
            sections.setdefault(section, {})[key] = resolved
    changed = {name: dataclasses.replace(getattr(job, name), **values) for name, values in sections.items()}
    return dataclasses.replace(job, **changed), given


def given_paths_comment(given: dict[str, str]) -> str:
    """TOML comment lines naming the paths as typed (readers of the file see both; tomllib ignores them)."""
    if not given:
        return ""
    lines = [f"# paths are stored absolute; as given, relative to {Path.cwd()}:"]
    lines += [f"#   {name} = {value!r}" for name, value in given.items()]
    return "\n".join(lines) + "\n"


def check_same_run(job: Any, stored: Any, source: str, typed: dict[str, dict[str, Any]]) -> None:
    """Refuse a job whose model, tokenizer, data or vocabulary differ from the run folder's config.toml
    (`stored`, read from `source`); `typed`: the flags given on the command line, {section: {key: value}}."""
    for section, key, flag in IDENTITY_FIELDS:
        if key == "vocab_size" and stored.data.tokenizer not in TRAINED_TOKENIZERS:
            continue  # only a tokenizer trained by the run is sized by it
        if key == "corpus" and stored.data.data is not None:
            continue  # the embedded corpus is not read when files are
        mine, theirs = (absolute(key, _value(getattr(c, section), key)) for c in (job, stored))
        if mine == theirs:
            continue
        how = flag if key in typed.get(section, {}) else f"{section}.{key} of the configuration"
        raise ConfigError(f"{how} {mine!r} contradicts {source}, which has {section}.{key} = {theirs!r}: a run "
                          f"folder's model, tokenizer, data and vocabulary are what its checkpoints were trained "
                          f"on; drop {flag} to resume that run, or start a new run (without --resume) to train "
                          f"with {mine!r}")
