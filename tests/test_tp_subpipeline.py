"""Sub-pipelined tensor parallelism (--tp-subbatches K) trains exactly like one process.

The K sub-batches are independent rows, so K > 1 must give the single-process losses,
gradient norms and parameters (same reference and tolerances as test_tp_equivalence.py).
The interleaving itself is checked on the built graph: copy j's all-reduce is started,
then copy j+1's compute of the same segment runs, and only then does copy j wait.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import ConfigError
from autopar.tensor_parallel.subpipeline import START, WAIT
from helpers import train_builtin
from test_tp_equivalence import GLOBAL_BATCH, MODELS, STEPS, assert_matches, reference

# (model, world, strategy, micro-batch size)
LAYOUTS = [
    ("gpt-tiny", 2, {"tp": 2, "tp_subbatches": 2}, 2),
    ("gpt-tiny", 2, {"tp": 2, "tp_subbatches": 4}, 4),
    ("hf:llama", 2, {"tp": 2, "tp_subbatches": 2}, 4),
    ("gpt-tiny", 4, {"tp": 2, "pp": 2, "schedule": "1f1b", "tp_subbatches": 2}, 2),
    ("hf:llama", 4, {"tp": 2, "pp": 2, "schedule": "1f1b", "tp_subbatches": 2}, 2),
    ("gpt-tiny", 4, {"tp": 2, "pp": 2, "schedule": "1f1b", "recompute": "all", "tp_subbatches": 2}, 2),
]


@pytest.mark.parametrize("model,world,strategy,micro", LAYOUTS, ids=lambda v: str(v))
def test_sub_pipelined_tp_matches_single_process(rank_pool, tmp_path, tmp_path_factory, model, world, strategy, micro):
    expected = reference(rank_pool, tmp_path_factory, model)
    results = rank_pool(world).run(train_builtin, model, str(tmp_path), model_args=MODELS[model], steps=STEPS,
                                   strategy=strategy, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro)
    assert_matches(expected, results)


def _interleaving(model: str, k: int, micro: int) -> list[list[tuple[str, int, str]]]:
    """(kind, sub-batch, reduce) for every start / wait / compute node of this rank's built stage graph."""
    from autopar.models import build_model
    from helpers import small_data
    from autopar.data import padded_vocab_size

    net, info = build_model(model, MODELS[model], vocab_size=padded_vocab_size(258), device="meta")
    train_data, _ = small_data(info.task, 32)
    config = autopar.TrainConfig(steps=1, global_batch_size=micro, micro_batch_size=micro, out=None, progress=False,
                                 timeout_s=60)
    trainer = autopar.Trainer(net, train_data, strategy=autopar.Strategy(tp=2, tp_subbatches=k), config=config)
    trainer._setup()
    (stage,) = trainer.engine.stages.values()
    (piece,) = stage._pieces
    order = []
    for node in piece.graph.nodes:
        if node.op == "call_module" and node.target in (START, WAIT):
            order.append((node.target, node.meta["subbatch"], node.args[0].name if node.target == START else
                          node.name.removeprefix(WAIT + "_").rsplit("_sub", 1)[0]))
        elif "subbatch" in node.meta:
            order.append(("compute", node.meta["subbatch"], ""))
    trainer.engine.close()
    return order


def test_sub_batches_are_interleaved(rank_pool):
    k = 2
    order = rank_pool(2).run(_interleaving, "gpt-tiny", k, 4)[0]
    starts = [(i, j, name) for i, (kind, j, name) in enumerate(order) if kind == START]
    waits = {(j, name): i for i, (kind, j, name) in enumerate(order) if kind == WAIT}
    assert len(starts) == k * 2 * MODELS["gpt-tiny"]["n_layer"]  # attention + MLP reduce per layer, per copy
    reduce_of_start = {}  # (copy, n-th reduce of that copy) -> position; copies start their reduces in one order
    for i, j, _ in starts:
        reduce_of_start[(j, sum(1 for s in starts if s[1] == j and s[0] < i))] = i
    waits_by_copy = {j: sorted(i for (jj, _), i in waits.items() if jj == j) for j in range(k)}
    for j in range(k):
        assert len(waits_by_copy[j]) == 2 * MODELS["gpt-tiny"]["n_layer"]
    for (j, n), start in reduce_of_start.items():
        wait = waits_by_copy[j][n]
        assert start < wait
        between = {order[i][1] for i in range(start + 1, wait) if order[i][0] == "compute"}
        # another sub-batch computes while this one's all-reduce is in flight
        assert between - {j}, (j, n, start, wait)
        if j == 0:  # copy 1 starts its reduce of the same layer before copy 0 waits on its own
            assert reduce_of_start[(1, n)] < wait


def test_bad_tp_subbatches_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="tp_subbatches"):
        autopar.Strategy(tp=2, tp_subbatches=0).resolved(2)
    from autopar.strategies import resolve
    with pytest.raises(ConfigError, match=r"tp_subbatches=3 does not divide micro_batch_size=4.*\[1, 2, 4\]"):
        resolve(autopar.Strategy(tp=2, tp_subbatches=3), autopar.TrainConfig(global_batch_size=8, micro_batch_size=4), 2)
    with pytest.raises(ConfigError, match="tp=1"):
        resolve(autopar.Strategy(tp=1, tp_subbatches=2), autopar.TrainConfig(global_batch_size=8, micro_batch_size=4), 2)


def _setup_error(k: int, micro: int) -> str:
    from autopar.models import build_model
    from autopar.data import padded_vocab_size
    from helpers import small_data

    net, info = build_model("gpt-tiny", MODELS["gpt-tiny"], vocab_size=padded_vocab_size(258), device="meta")
    config = autopar.TrainConfig(steps=1, global_batch_size=2 * micro, micro_batch_size=micro, out=None,
                                 progress=False, timeout_s=60)
    trainer = autopar.Trainer(net, small_data(info.task, 32)[0], strategy=autopar.Strategy(tp=2, tp_subbatches=k),
                              config=config)
    try:
        trainer.train()
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_trainer_refuses_a_k_that_does_not_divide_the_micro_batch_on_every_rank(rank_pool):
    for message in rank_pool(2).run(_setup_error, 3, 4):
        assert "tp_subbatches=3 does not divide micro_batch_size=4" in message, message


def _backward_events(model: str, k: int, micro: int) -> list[tuple[str, str]]:
    """One training step at tp=2 with K sub-batches: ("start" | "wait", f_subj) of the backward
    all-reduces and ("compute", op) for every matmul, in the order they ran."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.data import padded_vocab_size
    from autopar.models import build_model
    from autopar.tensor_parallel.subpipeline import GRAD_START
    from helpers import small_data

    net, info = build_model(model, MODELS[model], vocab_size=padded_vocab_size(258), device="meta")
    config = autopar.TrainConfig(steps=1, global_batch_size=micro, micro_batch_size=micro, out=None, progress=False,
                                 timeout_s=60)
    trainer = autopar.Trainer(net, small_data(info.task, 32)[0], strategy=autopar.Strategy(tp=2, tp_subbatches=k),
                              config=config)
    trainer._setup()
    (stage,) = trainer.engine.stages.values()
    events: list = []
    stage._pieces[0].get_submodule(GRAD_START).inflight.events = events
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    class LogMatmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in matmuls:
                events.append(("compute", str(func)))
            return func(*args, **(kwargs or {}))

    with LogMatmuls():
        trainer.train_step(0)
    trainer.engine.close()
    return events


def test_backward_all_reduces_are_in_flight_during_the_other_sub_batch_backward(rank_pool):
    """K=2: copy 1's gradient all-reduce at each f starts, copy 0's backward matmuls of that segment
    run, copy 0 starts its own, and only then does copy 1 wait; the same start order on both ranks."""
    per_rank = rank_pool(2).run(_backward_events, "gpt-tiny", 2, 4)
    starts = [[tag for kind, tag in events if kind == "start"] for events in per_rank]
    assert starts[0] == starts[1] and starts[0]  # one collective order on every rank
    events = per_rank[0]
    position = {(kind, tag): i for i, (kind, tag) in enumerate(events) if kind != "compute"}
    fs = sorted({tag.rsplit("_sub", 1)[0] for tag in starts[0]})
    assert len(fs) == 2 * MODELS["gpt-tiny"]["n_layer"] + 1  # attention and MLP input per layer, and the head
    for f in fs:
        start1, start0 = position[("start", f + "_sub1")], position[("start", f + "_sub0")]
        wait1, wait0 = position[("wait", f + "_sub1")], position[("wait", f + "_sub0")]
        assert start1 < start0 < wait1 and start0 < wait0, (f, start1, start0, wait1, wait0)
        overlapped = [e for e in events[start1 + 1:start0] if e[0] == "compute"]
        assert overlapped, f  # copy 0's backward matmuls ran while copy 1's all-reduce was in flight
