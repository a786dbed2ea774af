"""Embedded text corpora: real text that is on every machine with no download.

`stdlib` is the source of the Python standard library's top-level modules (about 4.7 MB
of real, varied text on CPython 3.11). Its exact content depends on the Python version,
so every run records the corpus fingerprint in its config: two runs are comparable step
by step when their fingerprints match. A path to a text file or a folder of text files
(.txt, .md, .py, .rst) is accepted too.

Held-out split: every `EVAL_EVERY`-th file goes to eval, so eval text is never trained on.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError

EVAL_EVERY = 20
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")


@dataclass(frozen=True)
class Corpus:
    name: str
    train: bytes
    eval: bytes
    num_files: int
    fingerprint: str  # sha256 of the files' names and contents, first 16 hex digits

    def describe(self) -> str:
        return (f"corpus {self.name}: {self.num_files} files, {len(self.train) / 1e6:.2f} MB train, "
                f"{len(self.eval) / 1e6:.2f} MB eval, fingerprint {self.fingerprint}")


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise DataError(f"corpus 'stdlib': no Python source files found in {root}; "
                        f"pass a text file or folder as the corpus instead")
    return files


def _path_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"corpus folder {str(path)!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return files


def load_corpus(name: str = "stdlib") -> Corpus:
    """Load a corpus by name ('stdlib') or path; the split is deterministic."""
    if name == "stdlib":
        files = _stdlib_files()
    elif Path(name).exists():
        files = _path_files(Path(name))
    else:
        raise DataError(f"unknown corpus {name!r}; use 'stdlib' or the path of a text file or folder")
    digest = hashlib.sha256()
    train, held_out = [], []
    for index, path in enumerate(files):
        data = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + data)
        (held_out if index % EVAL_EVERY == EVAL_EVERY - 1 else train).append(data)
    if len(files) == 1:  # a single file: hold out its last 5%
        cut = int(len(train[0]) * 0.95)
        train, held_out = [train[0][:cut]], [train[0][cut:]]
    return Corpus(name=name, train=b"\n".join(train), eval=b"\n".join(held_out),
                  num_files=len(files), fingerprint=digest.hexdigest()[:16])
