"""The files of an export besides weights and config.json: tokenizer settings, chat template, generation settings.

The run kept its sources' own files under RUN/hf/ (models/hf_side_files.py); they are written as they were,
with the end and padding tokens the run trained with added where a source did not name them. A tokenizer
trained here, or a model built by name, had none: they are written from the run's tokenizer.json and the
model's config. Without them `AutoTokenizer.from_pretrained` has no eos or pad token and `generate()` does
not know where to stop.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ..models.hf_side_files import (CHAT_TEMPLATES, GENERATION_CONFIG, RUN_FOLDER_PREFIX, SPECIAL_TOKENS_MAP,
                                    TOKENIZER_CONFIG)

TOKENIZER_FILE = "tokenizer.json"


def write_side_files(run_dir: Path, out: Path, config: dict[str, Any]) -> None:
    """tokenizer.json and its settings (when the run has a tokenizer.json) and generation_config.json, into `out`."""
    kept = run_dir / RUN_FOLDER_PREFIX
    specials: dict[str, str] = {}
    if (run_dir / TOKENIZER_FILE).is_file():
        tokenizer_json = (run_dir / TOKENIZER_FILE).read_text()
        shutil.copyfile(run_dir / TOKENIZER_FILE, out / TOKENIZER_FILE)
        specials = special_tokens(tokenizer_json, config)
        source = _read_json(kept / TOKENIZER_CONFIG)  # the source's own, with what training added to it
        settings = {**source, **_missing(source, specials)} if source else {**tokenizer_config(config), **specials}
        _write_json(out / TOKENIZER_CONFIG, settings)
        token_map = _read_json(kept / SPECIAL_TOKENS_MAP) or {}
        _write_json(out / SPECIAL_TOKENS_MAP, {**specials, **token_map})
        for name in CHAT_TEMPLATES:
            if (kept / name).is_file():
                shutil.copyfile(kept / name, out / name)
    ids = _token_ids(run_dir, specials)
    generation = _read_json(kept / GENERATION_CONFIG) or generation_config(config, ids)
    _write_json(out / GENERATION_CONFIG, generation)


def special_tokens(tokenizer_json: str, config: dict[str, Any]) -> dict[str, str]:
    """{eos_token, pad_token, bos_token, unk_token: text} of a tokenizer.json: by the model config's ids where it
    names them (the ids the model was trained with), else as the run's tokenizer found them (data/hf_tokenizer.py:
    the usual names; padding falls back to the end token, as training padded)."""
    import tokenizers

    from ..data.hf_tokenizer import HFTokenizer
    tokenizer = HFTokenizer(tokenizers.Tokenizer.from_str(tokenizer_json), "export")
    raw = tokenizer.tokenizer

    def text(token_id: Any) -> str | None:
        token_id = token_id[0] if isinstance(token_id, list) and token_id else token_id
        return raw.id_to_token(token_id) if isinstance(token_id, int) else None

    eos = text(config.get("eos_token_id")) or text(tokenizer.eos_id)
    found = {"eos_token": eos, "pad_token": text(config.get("pad_token_id")) or text(tokenizer.pad_id) or eos,
             "bos_token": text(config.get("bos_token_id")), "unk_token": text(raw.token_to_id("<unk>"))}
    return {key: value for key, value in found.items() if value is not None}


def tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    """A tokenizer_config.json for a tokenizer.json that came without one: the fast tokenizer class any
    tokenizer.json loads with, and the model's context as its longest input."""
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    context = next((config[k] for k in ("max_position_embeddings", "n_positions") if isinstance(config.get(k), int)),
                   None)
    if context is not None:
        settings["model_max_length"] = context
    return settings


def generation_config(config: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    """generation_config.json from the model config's token ids, the tokenizer's where the config has none."""
    out: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key) if config.get(key) is not None else ids.get(key)
        if value is not None:
            out[key] = value
    return out


def _missing(settings: dict[str, Any], specials: dict[str, str]) -> dict[str, str]:
    """The end and padding tokens a source's tokenizer_config.json did not name (training used them)."""
    return {k: specials[k] for k in ("eos_token", "pad_token") if k in specials and settings.get(k) is None}


def _token_ids(run_dir: Path, specials: dict[str, str]) -> dict[str, int]:
    if not specials:
        return {}
    import tokenizers
    raw = tokenizers.Tokenizer.from_file(str(run_dir / TOKENIZER_FILE))
    ids = {f"{k[:-len('_token')]}_token_id": raw.token_to_id(v) for k, v in specials.items()}
    return {k: v for k, v in ids.items() if v is not None}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
