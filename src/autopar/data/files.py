"""Training data from local files: text, JSONL, parquet, or a `datasets.save_to_disk` folder.

Files are read with Hugging Face `datasets` (no readers of our own). Plain text (`text_field`
documents) is tokenized once, documents joined by the tokenizer's end-of-text token, and packed into
`seq_len` windows (data/datasets.py's CausalLMWindows). Records with a prompt and a response field are
instruction data: one padded sample per record, the loss on the response tokens only (labels -100 on
the prompt and the padding). Tokens are cached in a folder under a fingerprint of the file contents,
the tokenizer and the settings, so a second run (and every rank of one) skips tokenizing. Samples are a
pure function of their index, so the global batch order (data/sampler.py) is the same for every layout.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..errors import DataError
from .datasets import IGNORE_INDEX, CausalLMWindows

SUFFIX_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                   ".parquet": "parquet", ".csv": "csv"}
CACHE_VERSION = 1


@dataclass(frozen=True)
class DataFiles:
    """What to read and how (the [data] settings that concern files)."""

    path: str
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    eval_path: str | None = None
    eval_fraction: float = 0.1
    cache_dir: str | None = None


def _datasets():
    try:
        import datasets
    except ImportError as exc:
        raise DataError("--data needs the datasets package: pip install datasets") from exc
    datasets.disable_progress_bars()
    return datasets


def read_records(path: str | Path, cache_dir: str | None = None, flag: str = "--data"):
    """A `datasets.Dataset` of the file or folder at `path` (datasets' own arrow cache under `cache_dir`);
    errors name `flag`, the option the user gave the path with."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{flag} {str(path)!r}: no such file or folder")
    datasets = _datasets()
    if path.is_dir():
        if not ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
                or (path / "state.json").is_file()):
            raise DataError(f"{flag} {str(path)!r}: a folder must be one written by datasets' save_to_disk; "
                            f"or pass a .txt, .jsonl, .parquet or .csv file")
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            split = "train" if "train" in loaded else next(iter(loaded))
            loaded = loaded[split]
        return loaded
    if path.stat().st_size == 0:
        raise DataError(f"{flag} {str(path)!r} is empty: it holds no records")
    builder = SUFFIX_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{flag} {str(path)!r}: unknown file type {path.suffix!r}; use one of "
                        f"{', '.join(sorted(SUFFIX_BUILDERS))} or a save_to_disk folder")
    extra = {"sample_by": "document"} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir, **extra)
    except Exception as exc:  # datasets wraps parse errors in many types
        raise DataError(f"{flag} {str(path)!r} cannot be read as {builder}: {' '.join(str(exc).split())[:300]}") \
            from None


def _content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _kind(records, files: DataFiles, path: str, flag: str = "--data") -> str:
    columns = list(records.column_names)
    if len(records) == 0:
        raise DataError(f"{flag} {path!r} is empty: it holds no records")
    if files.text_field in columns:
        return "text"
    if files.prompt_field in columns and files.response_field in columns:
        return "instruction"
    raise DataError(f"{flag} {path!r} has no field {files.text_field!r} (--text-field) and no "
                    f"{files.prompt_field!r}/{files.response_field!r} pair (--prompt-field/--response-field); "
                    f"its fields are {columns}")


def training_text(files: DataFiles) -> str:
    """The training file's text (what a BPE tokenizer learns): documents, or prompts and responses."""
    records = read_records(files.path, str(_cache_root(files) / "datasets"))
    kind = _kind(records, files, files.path)
    if kind == "text":
        return "\n".join(str(t) for t in records[files.text_field])
    return "\n".join(f"{p}{r}" for p, r in zip(records[files.prompt_field], records[files.response_field]))


class InstructionSamples(Dataset):
    """One sample per prompt/response record: labels are the next tokens of the response (and its end), -100
    on the prompt and on padding; too long records are cut at seq_len.

    No attention_mask: the padding is on the right and causal attention never lets a real position see a later
    one, and positions count from 0 either way, so every logit the loss reads is the unpadded record's
    (tests/test_hf_io.py). A mask would be one more field to trace and carry through every pipeline stage."""

    label_convention = "aligned"  # labels are the next tokens already (data/datasets.py)

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor):
        self.input_ids, self.labels = input_ids, labels

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index].long(), "labels": self.labels[index].long()}


def instruction_tensors(prompts: list[list[int]], responses: list[list[int]], *, seq_len: int, eos_id: int | None,
                        pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, seq_len] inputs and labels; the loss sees only response tokens (and the end token)."""
    inputs = torch.full((len(prompts), seq_len), pad_id, dtype=torch.int32)
    labels = torch.full((len(prompts), seq_len), IGNORE_INDEX, dtype=torch.int32)
    for k, (prompt, response) in enumerate(zip(prompts, responses)):
        ids = (prompt + response + ([eos_id] if eos_id is not None else []))[:seq_len + 1]
        n = len(ids) - 1
        if n <= 0:
            continue
        inputs[k, :n] = torch.tensor(ids[:-1], dtype=torch.int32)
        target = torch.tensor(ids[1:], dtype=torch.int32)
        target[:max(len(prompt) - 1, 0)] = IGNORE_INDEX  # position t predicts token t+1: prompt tokens are given
        labels[k, :n] = target
    return inputs, labels


def _cache_root(files: DataFiles) -> Path:
    return Path(files.cache_dir) if files.cache_dir else Path.home() / ".cache" / "autopar" / "data"


def _cache_path(files: DataFiles, path: str, tokenizer, seq_len: int) -> Path:
    """Where the tokens of `path` are kept: named by its contents, the tokenizer and every setting that matters."""
    key = json.dumps({"v": CACHE_VERSION, "content": _content_hash(Path(path)), "tokenizer": _tokenizer_key(tokenizer),
                      "fields": [files.text_field, files.prompt_field, files.response_field], "seq_len": seq_len})
    return _cache_root(files) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"


def _tokenizer_key(tokenizer) -> str:
    return getattr(tokenizer, "fingerprint", None) or f"{tokenizer.name}-{tokenizer.vocab_size}"


def _encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_many"):
        return tokenizer.encode_many(texts)
    return [tokenizer.encode(t).tolist() for t in texts]


def _tokenize(records, files: DataFiles, kind: str, tokenizer, seq_len: int) -> dict[str, torch.Tensor]:
    eos = getattr(tokenizer, "eos_id", None)
    if kind == "text":
        stream: list[int] = []
        for ids in _encode_many(tokenizer, [str(t) for t in records[files.text_field]]):
            stream.extend(ids)
            if eos is not None:
                stream.append(eos)
        return {"tokens": torch.tensor(stream, dtype=torch.int32)}
    prompts = _encode_many(tokenizer, [str(p) for p in records[files.prompt_field]])
    responses = _encode_many(tokenizer, [str(r) for r in records[files.response_field]])
    inputs, labels = instruction_tensors(prompts, responses, seq_len=seq_len, eos_id=eos, pad_id=tokenizer.pad_id)
    return {"input_ids": inputs, "labels": labels}


def tokenized(path: str, files: DataFiles, tokenizer, seq_len: int,
              flag: str = "--data") -> tuple[str, dict[str, torch.Tensor], bool]:
    """(kind, tensors, read from cache) of one file, tokenized once and cached by fingerprint (a cached file is
    not parsed again)."""
    if Path(path).exists():
        cache = _cache_path(files, path, tokenizer, seq_len)
        if cache.is_file():
            saved = torch.load(cache, weights_only=True)
            return saved["kind"], saved["tensors"], True
    records = read_records(path, str(_cache_root(files) / "datasets"), flag)
    kind = _kind(records, files, path, flag)
    tensors = _tokenize(records, files, kind, tokenizer, seq_len)
    if kind == "instruction" and not bool((tensors["labels"] != IGNORE_INDEX).any()):
        raise DataError(f"{flag} {path!r}: no record has a response token within --seq-len {seq_len} (every prompt "
                        f"fills it); use a longer --seq-len or shorter prompts")
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    torch.save({"kind": kind, "tensors": tensors}, tmp)
    os.replace(tmp, cache)  # atomic: ranks tokenizing at once write the same bytes
    return kind, tensors, False


def _datasets_of(kind: str, tensors: dict[str, torch.Tensor], seq_len: int) -> Dataset:
    if kind == "text":
        return CausalLMWindows(tensors["tokens"], seq_len)
    return InstructionSamples(tensors["input_ids"], tensors["labels"])


def build_file_datasets(files: DataFiles, tokenizer, *, seq_len: int) -> tuple[Dataset, Dataset, dict]:
    """Train and eval datasets from files; the eval split is `eval_path`, or the last `eval_fraction` of the
    training file (of its token stream, or of its records). Returns also facts for run.json."""
    if not 0 < files.eval_fraction < 1:
        raise DataError(f"--eval-fraction must be in (0, 1), got {files.eval_fraction}")
    kind, tensors, cached = tokenized(files.path, files, tokenizer, seq_len)
    if files.eval_path is not None:
        eval_kind, eval_tensors, _ = tokenized(files.eval_path, files, tokenizer, seq_len, "--eval-data")
        if eval_kind != kind:
            raise DataError(f"--eval-data {files.eval_path!r} holds {eval_kind} records but --data {files.path!r} "
                            f"holds {kind} records; give both the same fields")
        train, held_out = tensors, eval_tensors
    else:
        key = "tokens" if kind == "text" else "input_ids"
        total = tensors[key].shape[0]
        cut = total - max(1, int(total * files.eval_fraction))
        if cut < 1:
            raise DataError(f"--data {files.path!r} is too small to hold out an eval split ({total} "
                            f"{'tokens' if kind == 'text' else 'records'}); pass --eval-data FILE")
        train = {k: v[:cut] for k, v in tensors.items()}
        held_out = {k: v[cut:] for k, v in tensors.items()}
    try:
        train_data = _datasets_of(kind, train, seq_len)
        eval_data = _datasets_of(kind, held_out, seq_len)
    except DataError as exc:
        raise DataError(f"--data {files.path!r}: {exc}") from None
    facts = {"data": files.path, "data_kind": kind, "data_cached": cached,
             "train_samples": len(train_data), "eval_samples": len(eval_data)}
    return train_data, eval_data, facts
