"""What a Hugging Face folder holds besides weights: the files that make an export usable at once.

`from_pretrained` of a folder with config.json, weights and tokenizer.json alone gives a tokenizer without
an end or padding token, no generation settings, and (training turns the key/value cache off) a model that
generates without its cache. The run keeps these from its sources when it starts (the model folder's
generation_config.json, the tokenizer folder's tokenizer_config.json, special_tokens_map.json and chat
template, the source's own `use_cache`) under RUN/hf/, and the export writes them, or, where a source had
none (a tokenizer trained here, an architecture built by name), writes them from the tokenizer and config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATES = ("chat_template.jinja", "chat_template.json")
TOKENIZER_SIDE_FILES = (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, *CHAT_TEMPLATES)
RUN_FOLDER_PREFIX = "hf/"  # where a run keeps them (beside hf/config.json)


def source_use_cache(config: Any, source_folder: str | Path | None) -> bool | None:
    """The `use_cache` of the model's source: its folder's config.json, else the config class's default."""
    if source_folder is not None:
        try:
            saved = json.loads((Path(source_folder) / "config.json").read_text())
        except (OSError, ValueError):
            saved = {}
        if isinstance(saved.get("use_cache"), bool):
            return saved["use_cache"]
    try:
        return getattr(type(config)(), "use_cache", None)  # the architecture's default (True for causal LMs)
    except Exception:  # a config class that needs arguments: leave the value as it is
        return None


def source_side_files(model_folder: str | Path | None, tokenizer_path: str | Path | None) -> dict[str, str]:
    """{RUN/hf/ name: text} of the side files the sources have: the model folder's generation_config.json and
    the tokenizer folder's settings and chat template (a tokenizer.json file's folder is its tokenizer folder)."""
    files = {}
    if model_folder is not None and (Path(model_folder) / GENERATION_CONFIG).is_file():
        files[RUN_FOLDER_PREFIX + GENERATION_CONFIG] = (Path(model_folder) / GENERATION_CONFIG).read_text()
    if tokenizer_path is not None:
        folder = Path(tokenizer_path) if Path(tokenizer_path).is_dir() else Path(tokenizer_path).parent
        for name in TOKENIZER_SIDE_FILES:
            if (folder / name).is_file():
                files[RUN_FOLDER_PREFIX + name] = (folder / name).read_text()
    return files
