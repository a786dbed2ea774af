"""A failure on one rank reaches the user as one autopar error, raised on every rank, naming the rank and
the model's construct that failed; no rank waits for the timeout.

Two user models that fail on one pipeline stage only (pp=2):
- at set-up: the last layer's init reads a table from a cache folder that one host lacks, so
  materialising stage 1 fails on rank 1 while rank 0 waits for it in a collective;
- at the first step: the last layer looks up bucket 7 of a 4-row table, which traces fine on fake
  values and fails on real ones, in stage 1's forward, while rank 0 waits for its gradient.
And the command line: a rank that raises in step 1 is named by its peer in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import autopar

ROOT = Path(__file__).resolve().parents[1]
WIDTH, SEQ, VOCAB = 32, 8, 64
TIMEOUT_S = 60  # the run's collective timeout: a rank left waiting would take this long


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class PositionTable(nn.Module):
    """Adds per-position offsets kept in a file of a cache folder, loaded when the weights are initialised."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("table", torch.empty(SEQ, WIDTH))

    def reset_parameters(self) -> None:
        self.table.copy_(torch.load(os.path.join(self.folder, "table.pt")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x) + self.table


class BucketOffset(nn.Module):
    """Adds a learned offset for the bucket this layer is in; the last layer asks for bucket 7 of 4."""

    def __init__(self, bucket: int, buckets: int = 4):
        super().__init__()
        self.bucket = bucket
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.offsets = nn.Embedding(buckets, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.full(x.shape[:2], self.bucket, dtype=torch.long, device=x.device)
        return x + self.fc(x) + self.offsets(ids)


class LM(nn.Module):
    def __init__(self, last: nn.Module, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([*(Block() for _ in range(layers)), last])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tokens() -> list[dict]:
    ids = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]


def train_and_report(case: str, folder: str, out: str) -> dict:
    """Train 2 steps under pp=2; what this rank raised, how long it took, and whether a step ran."""
    if case == "set-up":
        rank = int(os.environ["RANK"])  # the cache exists on rank 0's host only
        with torch.device("meta"):
            model = LM(PositionTable(folder if rank == 0 else os.path.join(folder, "missing")))
    else:
        model = LM(BucketOffset(bucket=7))
    config = autopar.TrainConfig(steps=2, global_batch_size=8, micro_batch_size=4, progress=False, out=out,
                                 timeout_s=TIMEOUT_S)
    began = time.monotonic()
    try:
        autopar.Trainer(model, tokens(), strategy=autopar.Strategy(pp=2), config=config).train()
    except Exception as exc:  # the test judges the type and the text
        stepped = (Path(out) / "metrics.jsonl").exists() and bool((Path(out) / "metrics.jsonl").read_text().strip())
        return {"kind": type(exc).__name__, "autopar": isinstance(exc, autopar.AutoparError), "message": str(exc),
                "seconds": time.monotonic() - began, "stepped": stepped}
    return {"kind": None, "seconds": time.monotonic() - began}


def run_case(rank_pool, case: str, tmp_path: Path) -> list[dict]:
    folder = tmp_path / "cache"
    folder.mkdir()
    torch.save(torch.randn(SEQ, WIDTH), folder / "table.pt")
    return rank_pool(2).run(train_and_report, case, str(folder), str(tmp_path / "run"), timeout=180)


def test_a_set_up_failure_on_one_stage_is_one_error_on_every_rank(rank_pool, tmp_path):
    results = run_case(rank_pool, "set-up", tmp_path)
    for rank, got in enumerate(results):
        assert got["kind"] == "ModelError", (rank, got)
        assert not got["stepped"], (rank, "a step ran before the error")
        assert got["seconds"] < TIMEOUT_S / 2, (rank, got["seconds"], "waited for the timeout")
    message = results[1]["message"]
    assert results[0]["message"] == message, results  # the same line on both ranks
    assert message.startswith("rank 1 of 2 failed in set-up:"), message
    assert "layers.3 (PositionTable.reset_parameters)" in message, message
    assert "torch.load(os.path.join(self.folder" in message and "FileNotFoundError" in message, message
    assert "Connection closed" not in message, message


def test_b_a_stage_failing_at_run_time_names_its_module_on_every_rank(rank_pool, tmp_path):
    results = run_case(rank_pool, "step", tmp_path)
    for rank, got in enumerate(results):
        assert got["kind"] == "ModelError", (rank, got)
        assert got["seconds"] < TIMEOUT_S / 2, (rank, got["seconds"], "waited for the timeout")
    message = results[1]["message"]
    assert results[0]["message"] == message, results
    assert message.startswith("rank 1 of 2 failed in step 1: stage 1 of 2 failed at run time in "
                              "layers.3.offsets (Embedding) of LM, at "), message
    assert "return x + self.fc(x) + self.offsets(ids)" in message and "IndexError" in message, message


def test_c_command_line_peer_names_the_rank_that_failed(tmp_path):
    done = subprocess.run([sys.executable, "-m", "autopar", "train", "--model", "gpt-tiny", "--seq-len", "32",
                           "--global-batch-size", "8", "--micro-batch-size", "4", "--no-progress", "--steps", "2",
                           "--nproc", "2", "--pp", "2", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "AUTOPAR_FAULT": "raise-collective:rank=1:step=1"})
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    peer = [line for line in lines if line.startswith("autopar: error (rank 0 of 2): rank 1 of 2 failed in step 1: "
                                                      "RuntimeError: injected fault")]
    assert peer, done.stderr
    assert "Connection closed" not in done.stderr and done.stderr.count("Traceback") == 1, done.stderr  # rank 1's
    assert lines[-1].startswith("autopar launch: rank 1 failed (exit code 1)"), done.stderr
