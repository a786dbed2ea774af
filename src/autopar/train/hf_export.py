"""Export a run's checkpoint as a Hugging Face folder that `AutoModelFor*.from_pretrained` loads.

Checkpoints hold whole tensors under the model's own names (tensor-parallel slices were gathered
when they were saved, train/checkpoint.py), which are the names Hugging Face stores. The export
streams them shard by shard: each output file is read from the DCP checkpoint, written and freed,
so no process ever holds more than one shard (`max_shard_bytes`), and several ranks can write
different shards at once (`rank`, `world`). A tied weight (an embedding shared with the head) is
written once, under its first name, as `save_pretrained` does; tensors transformers converts on load (an
MoE layer's batched experts) are written in the layout `save_pretrained` writes (hf_export_layout.py). The
run folder's `hf/config.json` (written at training time) becomes the folder's config.json; a tokenizer
saved with the run is copied with its settings and the generation settings (hf_export_files.py).
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import CheckpointError, ModelError
from ..models.hf import import_transformers, quiet_transformers
from ..models.materialize import tied_groups
from ..models.pretrained import INDEX_FILE, SINGLE_FILE
from .checkpoint import find_checkpoint
from .hf_export_files import write_side_files
from .hf_export_layout import SavedLayout

HF_CONFIG = "hf/config.json"
TOKENIZER_FILE = "tokenizer.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30


def _run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent  # RUN/checkpoints/step_N


def _model_names(config_dir: Path) -> tuple[list[str], dict[str, list[str]], set[str], torch.nn.Module]:
    """The names to write (a tied group once, under its first name), every alias of each, the parameters, and
    the model on meta."""
    transformers = import_transformers("export")
    with quiet_transformers(transformers):
        config = transformers.AutoConfig.from_pretrained(str(config_dir))
        named = (config.architectures or [None])[0]
        model_cls = getattr(transformers, named, None) if named else None
        with torch.device("meta"):  # the class that was trained (architectures), else the causal LM of the type
            model = model_cls(config) if model_cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    aliases = {name: [name] for name in model.state_dict()}
    for group in tied_groups(model)[0] + tied_groups(model)[1]:
        for name in group[1:]:
            aliases.pop(name, None)
        aliases[group[0]] = list(group)
    names = [name for name in model.state_dict() if name in aliases]
    return names, aliases, {name for name, _ in model.named_parameters()}, model


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive tensors grouped into files of at most `max_shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def export_hf(source: str | Path, out: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              rank: int = 0, world: int = 1) -> Path:
    """Write `out` (config.json, safetensors shards, index) from a run folder or checkpoint folder.

    Every one of `world` callers passes its `rank`; rank r writes shards r, r + world, ... and rank 0 the
    config and index (call a barrier after it before reading `out`). No process group is needed.
    """
    from safetensors.torch import save_file

    checkpoint = find_checkpoint(source)
    run_dir = _run_dir_of(checkpoint)
    config_path = run_dir / HF_CONFIG
    if not config_path.is_file():
        raise ModelError(f"export --to hf: {str(run_dir)!r} has no {HF_CONFIG}; only runs of Hugging Face models "
                         f"(--model hf:...) can be exported to the Hugging Face format")
    names, aliases, params, model = _model_names(config_path.parent)
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    stored, sizes = {}, []
    for name in names:
        key = next((f"model.{a}" for a in aliases[name] if f"model.{a}" in metadata), None)
        if key is None:
            continue  # a buffer the checkpoint does not hold (non-persistent): the model rebuilds it
        meta = metadata[key]
        if not hasattr(meta, "size"):
            raise CheckpointError(f"checkpoint {str(checkpoint)!r}: {key} is not a tensor")
        stored[name] = (key, tuple(meta.size), meta.properties.dtype)
        sizes.append((name, torch.Size(meta.size).numel() * torch.empty((), dtype=meta.properties.dtype).element_size()))
    lost = [n for n in names if n not in stored and n in params]
    if lost:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} lacks {len(lost)} parameter(s) of the model in "
                              f"{HF_CONFIG}: {', '.join(lost[:5])}")
    shards = plan_shards(sizes, max_shard_bytes)
    layout = SavedLayout(model, [{n: stored[n][1] for n in shard} for shard in shards])  # as save_pretrained names them
    files = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for k in range(rank, len(shards), world):
        state = {"model": {stored[n][0][len("model."):]: torch.empty(stored[n][1], dtype=stored[n][2])
                           for n in shards[k]}}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
        tensors = layout.convert({n: state["model"][stored[n][0][len("model."):]].contiguous() for n in shards[k]})
        save_file(tensors, str(out / files[k]), metadata={"format": "pt"})
        del state, tensors
    if rank == 0:
        shutil.copyfile(config_path, out / "config.json")
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(size for _, size in sizes)},
                     "weight_map": {n: files[k] for k, shard in enumerate(shards)
                                    for n in layout.names({name: stored[name][1] for name in shard})}}
            (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        write_side_files(run_dir, out, json.loads(config_path.read_text()))  # tokenizer and generation settings
    return out



def in_use(out: str | Path) -> bool:
    """`out` already holds something an export would write over (a file, or a folder that is not empty)."""
    out = Path(out)
    return out.exists() and (not out.is_dir() or any(out.iterdir()))


def unused_folder(out: str | Path) -> Path:
    """`out`, or when it holds files already the first of OUT-2, OUT-3, ... that does not: never overwritten."""
    out, k = Path(out), 2
    candidate = out
    while in_use(candidate):
        candidate, k = out.with_name(f"{out.name}-{k}"), k + 1
    return candidate


def export_hf_together(run_dir: Path, out: str | Path) -> Path:
    """`export_hf` of the run's latest checkpoint, every rank writing some of the shards (collective); rank 0
    says where the folder is. A folder that holds files already (an earlier export: `autopar train` refuses it
    before start, but a run started otherwise may meet one) is left as it is: the export goes to a new one."""
    chosen = [str(unused_folder(out)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    if dist.get_rank() == 0 and Path(chosen[0]) != Path(out):
        print(f"autopar: warning: {out} already holds files (an earlier export?); exporting to {chosen[0]} "
              f"instead, nothing overwritten", file=sys.stderr, flush=True)
    dist.barrier()
    path = export_hf(run_dir, chosen[0], rank=dist.get_rank(), world=dist.get_world_size())
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"exported to {path} (Hugging Face format)", flush=True)
    return path
