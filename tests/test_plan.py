"""`autopar plan` and the time partition against brute force on the reference GPT."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from autopar.cli import main
from autopar.models import build_model
from autopar.partition import CostModel, brute_force, crossings, partition
from autopar.partition.measure import measure_block_times
from autopar.trace import trace


@pytest.mark.parametrize("model,arg", [("gpt-mini", "n_layer=5"), ("hf:gpt2", "n_layer=5"),
                                       ("hf:llama", "num_hidden_layers=5"), ("hf:bert", "num_hidden_layers=5")])
def test_plan_prints_a_balanced_partition_for_each_family(capsys, model, arg):
    assert main(["plan", "--model", model, "--model-arg", arg, "--pp", "3", "--seq-len", "32", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["stages"]) == 3 and result["bounds"][0] == 0 and result["bounds"][-1] == 7
    times = [s["est_time_s"] for s in result["stages"]]
    assert max(times) <= 1.6 * (sum(times) / 3)  # 7 blocks over 3 stages: never worse than 2+3+2 layers
    assert all(len(cut) >= 1 for cut in result["boundaries"])
    assert main(["plan", "--model", model, "--model-arg", arg, "--pp", "3", "--seq-len", "32"]) == 0
    assert "cut 1->2" in capsys.readouterr().out


def test_time_partition_is_within_10_percent_of_brute_force_on_the_reference_gpt():
    model, _ = build_model("gpt-mini", {"n_layer": 6}, vocab_size=320, device="meta")
    graph = trace(model, (torch.zeros(8, 64, dtype=torch.long, device="meta"),))
    costs = CostModel()
    compute = [b.flops * (1 + costs.backward_factor) / costs.flops_per_s for b in graph.blocks]
    transfer = [2 * sum(v.bytes for v in cut) / costs.bytes_per_s for cut in crossings(graph)] + [0.0]

    def slowest(bounds):
        return max(sum(compute[a:b]) + (transfer[b - 1] if b < len(compute) else 0.0)
                   for a, b in zip(bounds, bounds[1:]))

    for pp in (2, 3, 4):
        best, _ = brute_force(len(graph.blocks), pp, slowest)
        chosen = partition(graph, pp, method="time")
        assert max(s.est_time_s for s in chosen.stages) <= 1.10 * best
        assert slowest(chosen.bounds) == pytest.approx(best)


def test_measured_block_times_feed_the_time_partition():
    model, _ = build_model("gpt-tiny", {"n_layer": 3}, vocab_size=320, device="meta")
    graph = trace(model, (torch.zeros(2, 32, dtype=torch.long, device="meta"),))
    times = measure_block_times(graph, model, repeats=2)
    assert len(times) == 5 and all(t > 0 for t in times)
    assert all(b.time_s == t for b, t in zip(graph.blocks, times))
    assert partition(graph, 2, method="time").stages[0].est_time_s > 0


@pytest.mark.parametrize("args,message", [
    (["--pp", "9", "--model", "gpt-tiny"], "pp=9 stages but the model has only 4 blocks; use pp <= 4"),
    (["--pp", "2", "--memory-cap-mb", "0.001"], "the smallest cap that fits is"),
    (["--model", "nope"], "unknown model 'nope'"),
])
def test_plan_bad_input(args, message):
    done = subprocess.run([sys.executable, "-m", "autopar", "plan", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
