"""The search prices the precision and optimizer the run will use: bytes on the wire and in memory.

--dtype is never searched (it changes the numbers trained) but the cost model must follow it: under
--dtype bf16 parameters and gradients are bf16 (fp32 masters in the optimizer); under bf16-autocast
parameters stay fp32 and the residual stream that crosses a stage boundary stays fp32.
"""

from __future__ import annotations

import dataclasses

import torch

from autopar.config import Strategy, TrainConfig
from autopar.models.gpt import Block, GPTConfig
from autopar.search.cluster import Cluster, Link
from autopar.search.cost import Candidate, StepModel
from autopar.search.coverage import not_covered
from autopar.search.profile import ModelProfile, TPProfile
from autopar.strategies import resolve

CALLS: list[tuple[str, float, int]] = []


@dataclasses.dataclass(frozen=True)
class RecordingCluster(Cluster):
    """A cluster that notes the bytes of every transfer and all-reduce it prices."""

    def p2p(self, nbytes: float, *, inter_node: bool) -> float:
        CALLS.append(("p2p", nbytes, 2))
        return super().p2p(nbytes, inter_node=inter_node)

    def all_reduce(self, nbytes: float, n: int, *, span: int | None = None) -> float:
        CALLS.append(("all_reduce", nbytes, n))
        return super().all_reduce(nbytes, n, span=span)


def cluster() -> RecordingCluster:
    return RecordingCluster(name="toy", source="test", num_devices=4, devices_per_node=4, memory_per_device_gb=64,
                            flops_per_s={"fp32": 1e9, "bf16": 2e9}, compute_efficiency=1.0,
                            memory_bandwidth_bytes_per_s=1e12, intra_node=Link(1e-5, 1e9), inter_node=Link(1e-4, 1e8),
                            per_action_overhead_s=1e-4)


def tied_profile(n: int = 4) -> ModelProfile:
    """Embedding, two blocks, a head tied to the embedding (as gpt's)."""
    flops, saved, params = (1e5,) + (4e6,) * (n - 2) + (2e6,), (2e3,) * n, (50_000,) + (200_000,) * (n - 2) + (0,)
    tp1 = TPProfile(1, flops, params, saved, (0.0,) * n, (0,) * n)
    return ModelProfile(name="tied", seq_len=32, block_names=tuple(f"b{i}" for i in range(n)), flops=flops,
                        saved_bytes=saved, params=params, boundary_bytes=(1000.0,) * (n - 1), shared_params=50_000,
                        shared_blocks=(0, n - 1), tp={1: tp1})


def priced(dtype: str, kind: str, n: int | None = None) -> list[float]:
    CALLS.clear()
    c = Candidate(dp=2, tp=1, pp=2, micro_batch_size=1, num_microbatches=4)
    StepModel(tied_profile(), cluster(), global_batch_size=8, dtype=dtype).evaluate(c)
    return sorted({nbytes for what, nbytes, group in CALLS if what == kind and (n is None or group == n)})


def test_tied_weight_gradient_sum_is_priced_in_the_parameters_dtype():
    tied = 50_000
    assert tied * 4.0 in priced("fp32", "all_reduce", 2)
    assert tied * 4.0 in priced("bf16-autocast", "all_reduce", 2)  # fp32 parameters, fp32 gradients
    bf16 = priced("bf16", "all_reduce", 2)
    assert tied * 2.0 in bf16 and tied * 4.0 not in bf16  # bf16 parameters: bf16 gradients summed


def test_stage_boundary_transfers_are_priced_as_the_runtime_sends_them():
    block = Block(GPTConfig())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        crossing = block(torch.randn(1, 8, 64)).dtype
    assert crossing == torch.float32  # the residual stream crossing a cut stays fp32 under autocast
    assert priced("bf16-autocast", "p2p") == priced("fp32", "p2p") == [1000.0]
    assert priced("bf16", "p2p") == [500.0]  # bf16 parameters: every activation is bf16


def test_the_search_prices_the_runs_optimizer():
    """--optimizer sgd (no state): no optimizer bytes predicted, no ZeRO candidate tried then refused."""
    from autopar.models.gpt import GPT
    model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, vocab_size=64))
    example = lambda: ((torch.zeros(1, 16, dtype=torch.long),), {})  # noqa: E731
    states = {}
    for optimizer in ("adamw", "sgd"):
        config = TrainConfig(global_batch_size=8, optimizer=optimizer)
        plan = resolve(Strategy.auto(cluster="a100-80gb"), config, 4, model=model, example=example).plan
        states[optimizer] = plan.record["prediction"]["memory_per_stage"][0]["optimizer"]
        if optimizer == "sgd":
            assert plan.record["search"]["refused_by_runtime"] == 0
            assert plan.record["search"]["not_covered"] == not_covered()  # plan.json names what was not searched
    assert states["sgd"] == 0 < states["adamw"]


def test_plan_auto_takes_every_training_precision_and_the_optimizer(capsys):
    import json

    from autopar.cli import main
    args = ["plan", "--auto", "--model", "gpt-tiny", "--nproc", "2", "--seq-len", "32", "--global-batch-size", "4",
            "--cost-model", "flops", "--cluster", "a100-80gb", "--json", "--top", "1"]
    assert main([*args, "--dtype", "bf16-autocast", "--optimizer", "sgd"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["train"]["dtype"] == "bf16-autocast" and plan["strategy"]["zero"] == 0
    assert all(stage["optimizer"] == 0 for stage in plan["prediction"]["memory_per_stage"])
