"""The built-in models as `autopar models` lists them, written down so that listing them needs no torch.

Building thirteen models on meta to count their parameters imports torch and transformers (seconds);
this table holds what those builds report, and tests/test_run_logs.py rebuilds every model of the
registry (models/registry.py) and compares, so it cannot drift: a model added there fails that test
until its row is here (the failure prints the table to paste). Kept in config/, which imports no torch.
"""

from __future__ import annotations

import importlib.util

# name, task, parameters at the default size and vocabulary, longest sequence
CATALOG: tuple[tuple[str, str, int, int], ...] = (
    ("gpt-tiny", "causal-lm", 132864, 256),
    ("gpt-mini", "causal-lm", 858880, 256),
    ("gpt-small", "causal-lm", 86039040, 1024),
    ("gpt-medium", "causal-lm", 303622144, 1024),
    ("gpt-1.5b", "causal-lm", 1479248000, 2048),
    ("gpt-2.5b", "causal-lm", 2394562560, 2048),
    ("gpt-8.3b", "causal-lm", 8163686400, 2048),
    ("gpt-20b", "causal-lm", 19949015040, 2048),
    ("word-lstm", "causal-lm", 6423552, 1024),
    ("word-gpt", "causal-lm", 149248, 256),
    ("hf:gpt2", "causal-lm", 132864, 256),
    ("hf:llama", "causal-lm", 125248, 256),
    ("hf:bert", "masked-lm", 137536, 256),
)


def catalog_lines() -> list[str]:
    """`autopar models`' lines; a Hugging Face row says so when transformers is not installed."""
    hf_missing = importlib.util.find_spec("transformers") is None
    lines = []
    for name, task, params, max_seq_len in CATALOG:
        if name.startswith("hf:") and hf_missing:
            lines.append(f"{name:12s} unavailable: needs transformers (pip install 'autopar[hf]')")
        else:
            lines.append(f"{name:12s} {task:10s} {params:>14,} params  max_seq_len {max_seq_len}")
    return lines
