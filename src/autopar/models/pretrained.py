"""Pretrained weights read straight from a folder's safetensors files, slice by slice.

A Hugging Face folder (`save_pretrained`) holds `model.safetensors`, or several
`model-0000k-of-0000n.safetensors` named by `model.safetensors.index.json`. Each rank builds the
model on meta, keeps only its stage (and its tensor-parallel slices), and then reads exactly
those bytes with `safe_open(...).get_slice(...)`: no rank ever loads the whole model. The bytes
each rank read are counted (`bytes_read`), so a test and the benchmark can show it.

Names are the model's own parameter names; a tied weight (GPT-2's embedding and head) is stored
once under any of its names, as `save_pretrained` writes it. Batched expert parameters stored one
tensor per expert (as `save_pretrained` writes MoE models) are read through views (pretrained_experts.py).

Under ZeRO-3 a parameter is FSDP2's DTensor shard: rows of dim 0 (torch.chunk's split over the
dp replicas) of the tensor or of its tensor-parallel slice; only those rows are read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..errors import ModelError
from .materialize import tied_groups
from .pretrained_experts import expert_views

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

SliceFn = Callable[[str], "tuple[int, list[tuple[int, int]]] | None"]
"""fqn -> (dim, [(start, length), ...]) of this rank's tensor-parallel slices, or None for the whole tensor."""


def _safetensors():
    try:
        import safetensors
    except ImportError as exc:
        raise ModelError("loading pretrained weights needs the safetensors package: pip install safetensors") from exc
    return safetensors


class SafetensorsFolder:
    """Where each tensor of a folder lives, its stored shape, and reads of whole tensors or slices."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ModelError(f"pretrained model folder {str(self.folder)!r} does not exist")
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise ModelError(f"{index}: not a safetensors index (no weight_map): {exc}") from None
            self.files = {name: self.folder / file for name, file in weight_map.items()}
            missing = sorted({str(f.name) for f in self.files.values() if not f.is_file()})
            if missing:
                raise ModelError(f"{index} names weight files that are not in the folder: {', '.join(missing)}")
        elif (self.folder / SINGLE_FILE).is_file():
            self.files = {}
            with self._open(self.folder / SINGLE_FILE) as f:
                self.files = {name: self.folder / SINGLE_FILE for name in f.keys()}
        else:
            found = sorted(p.name for p in self.folder.iterdir())
            raise ModelError(f"pretrained model folder {str(self.folder)!r} has no weights: expected {SINGLE_FILE} "
                             f"or {INDEX_FILE} with its shards (as save_pretrained writes them; .bin files are not "
                             f"read), found {found[:10]}")
        self.bytes_read = 0
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._handles: dict[Path, object] = {}
        self._virtual: dict[str, object] = {}  # name -> a view composed of stored tensors (batched experts)
        self._replaced: set[str] = set()  # stored names only those views read

    def add_views(self, views: dict[str, object], replaced: set[str]) -> None:
        """Serve `views` under their names instead of the stored tensors `replaced` they read."""
        self._virtual.update(views)
        self._replaced |= set(replaced)

    def view(self, name: str):
        return self._virtual[name] if name in self._virtual else self._handle(name).get_slice(name)

    def _open(self, path: Path):
        return _safetensors().safe_open(str(path), framework="pt", device="cpu")

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._open(path).__enter__()
        return self._handles[path]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def names(self) -> set[str]:
        return (set(self.files) - self._replaced) | set(self._virtual)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            self._shapes[name] = tuple(self.view(name).get_shape())
        return self._shapes[name]

    def read(self, name: str, dim: int = 0, slices: Iterable[tuple[int, int]] | None = None,
             rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `name`, or the concatenation along `dim` of the given (start, length) slices of it;
        `rows` (start, length): only those rows of dim 0 as well (a ZeRO-3 shard of a slice along dim > 0)."""
        if rows is not None and slices is not None and dim == 0:
            raise ValueError("rows and slices of dim 0 together: pass the rows' slices instead")
        view = self.view(name)
        first = slice(None) if rows is None else slice(rows[0], rows[0] + rows[1])
        if slices is None:
            pieces = [view[first]]
        else:
            pieces = []
            for start, length in slices:
                index = tuple([first] + [slice(None)] * (dim - 1) + [slice(start, start + length)]) if dim > 0 \
                    else (slice(start, start + length),)
                pieces.append(view[index])
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
        self.bytes_read += out.numel() * out.element_size()
        return out


def _alias_map(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter/buffer: name -> all names sharing its tensor (itself first)."""
    names = {name: [name] for name in model.state_dict(keep_vars=True)}
    for group in (*tied_groups(model)[0], *tied_groups(model)[1]):
        for name in group:
            names[name] = [name, *[g for g in group if g != name]]
    return names


class PretrainedWeights:
    """A pretrained folder checked against a (meta) model: every tensor present, every shape right.

    `check` reads only the file headers, so every rank can run it before any process group exists
    and fail the same way. `load_into` then fills a rank's module (whole model, a pipeline stage, or
    tensor-parallel slices of one) with just the bytes it needs.
    """

    def __init__(self, folder: str | Path, model: nn.Module):
        self.folder = Path(folder)
        self.source = SafetensorsFolder(folder)
        self.aliases = _alias_map(model)
        self.shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
        self.stored: dict[str, str] = {}  # model name -> the name it is stored under
        self.source.add_views(*expert_views(self.shapes, self.source.names(), self.source.view))
        self._check(model)

    def _check(self, model: nn.Module) -> None:
        on_file = self.source.names()
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        missing, wrong = [], []
        for name, shape in self.shapes.items():
            stored = next((a for a in self.aliases[name] if a in on_file), None)
            if stored is None:
                if name in params:
                    missing.append(name)
                continue  # a buffer the file does not hold: the model's own init sets it
            self.stored[name] = stored
            found = self.source.shape(stored)
            if found != shape:
                wrong.append(f"{stored}: the file holds {list(found)}, the model expects {list(shape)}")
        if wrong:
            raise ModelError(f"the weights in {str(self.folder)!r} do not match the model's config: "
                             f"{'; '.join(wrong[:5])}{f' and {len(wrong) - 5} more' if len(wrong) > 5 else ''}")
        if missing:
            raise ModelError(f"the weights in {str(self.folder)!r} lack {len(missing)} parameter(s) of the model: "
                             f"{', '.join(missing[:5])}; is config.json the one these weights were saved with?")
        known = {a for names in self.aliases.values() for a in names}
        unexpected = sorted(on_file - known)
        if unexpected:
            raise ModelError(f"the weights in {str(self.folder)!r} hold {len(unexpected)} tensor(s) the model does not "
                             f"have: {', '.join(unexpected[:5])}; is config.json the one these weights were saved with?")

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read

    @torch.no_grad()
    def load_into(self, module: nn.Module, slices: SliceFn | None = None) -> int:
        """Copy the stored values into every parameter/buffer of `module` (named as in the model); returns
        the bytes read. `slices` gives the tensor-parallel slices of a sharded parameter."""
        before, done = self.source.bytes_read, set()
        for name, target in module.state_dict(keep_vars=True).items():
            stored = self.stored.get(name)
            if stored is None or id(target) in done:  # a tied weight is read once
                continue
            done.add(id(target))
            part = slices(name) if slices is not None else None
            if isinstance(target, DTensor):  # ZeRO-3: only this rank's dp rows of its (tp slice of the) tensor
                target, rows = target.to_local(), _dp_rows(name, target)
                if rows[1] == 0:
                    continue  # an empty shard (fewer rows than replicas)
                value = self._read_rows(stored, part, rows)
            else:
                value = self.source.read(stored) if part is None else self.source.read(stored, part[0], part[1])
            if tuple(value.shape) != tuple(target.shape):
                raise ModelError(f"{name}: read {list(value.shape)} from {str(self.folder)!r} for a local tensor of "
                                 f"{list(target.shape)}")
            target.copy_(value)
        self.source.close()
        return self.source.bytes_read - before

    def _read_rows(self, stored: str, part: tuple[int, list[tuple[int, int]]] | None,
                   rows: tuple[int, int]) -> torch.Tensor:
        """Rows [start, start + length) of dim 0 of the tensor, or of its tensor-parallel slice `part`."""
        if part is None:
            return self.source.read(stored, 0, [rows])
        dim, pieces = part
        if dim > 0:
            return self.source.read(stored, dim, pieces, rows=rows)
        wanted, offset, start, end = [], 0, rows[0], rows[0] + rows[1]  # rows of the concatenated slices
        for piece_start, length in pieces:
            low, high = max(start, offset), min(end, offset + length)
            if low < high:
                wanted.append((piece_start + low - offset, high - low))
            offset += length
        return self.source.read(stored, 0, wanted)


def _dp_rows(name: str, target: DTensor) -> tuple[int, int]:
    """(first row, rows) of dim 0 that this rank's FSDP2 shard holds: torch.chunk's split over the replicas."""
    if len(target.placements) != 1 or not isinstance(target.placements[0], Shard) or target.placements[0].dim != 0:
        raise ModelError(f"{name}: expected a parameter sharded on dim 0 over one mesh dimension (FSDP2), "
                         f"got placements {target.placements}")
    size, replicas, rank = target.shape[0], target.device_mesh.size(), target.device_mesh.get_local_rank()
    chunk = -(-size // replicas)
    start = min(rank * chunk, size)
    rows = min(chunk, size - start)
    if rows != target.to_local().shape[0]:
        raise ModelError(f"{name}: this rank's shard has {target.to_local().shape[0]} rows, expected {rows} "
                         f"(rows {start}:{start + rows} of {size} over {replicas} replicas)")
    return start, rows
