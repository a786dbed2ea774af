"""--compile (train/compile.py): every synchronous layout compiled trains as it does eagerly.

The equivalence runs train gpt-tiny (two blocks, dropout 0.1 on embeddings, residual branches and
attention weights) compiled under dp=1, dp=2, pp=2 (recomputed) and tp=2, against one eager process
on the same global batches. Tolerance: losses 1e-5 relative, parameters 1e-5 absolute, as between
eager layouts; not bitwise, because inductor fuses element-wise chains and may reassociate reductions
(layer norm, softmax sums). Dropout masks are integer hashes, exact under fusion: a wrong mask moves
the loss by ~1e-2 (test_dropout.py's reference check), far outside these tolerances.

Compiling on CPU costs seconds per graph: the cases are few and tiny, the layouts run on aot_eager
(dynamo's capture and AOTAutograd, no C++ build), and the inductor kernels the mask test builds are
cached across test sessions (conftest.py points TORCHINDUCTOR_CACHE_DIR at .pytest_cache).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from autopar.config import Strategy, TrainConfig
from autopar.config.rules import Setup, check_rules
from autopar.errors import ConfigError
from autopar.train.compile import repeated_blocks
from helpers import max_relative_difference, train_builtin

MODEL_ARGS = {"n_layer": 2, "d_model": 32, "n_head": 2, "dropout": 0.1}
RUN = dict(steps=3, global_batch_size=4, seq_len=16, eval_batches=1)
_reference: dict = {}


def _eager(rank_pool, tmp_path_factory) -> dict:
    if not _reference:
        out = str(tmp_path_factory.mktemp("eager"))
        _reference.update(rank_pool(1).run(train_builtin, "gpt-tiny", out, model_args=MODEL_ARGS,
                                           micro_batch_size=4, **RUN)[0])
    return _reference


def _assert_matches(expected: dict, got: dict, where: str) -> None:
    assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (where, expected["losses"],
                                                                              got["losses"])
    for name, value in got["params"].items():
        difference = float((value - expected["params"][name]).abs().max())
        assert difference < 1e-5, (where, name, difference)


# (world, strategy, micro-batch size, dtype). The layouts capture their graphs through their own engines (whole
# blocks under ZeRO's sharded update and under FSDP2, stage pieces, tensor-parallel collectives, stages of different
# tensor-parallel degrees, recomputation, bf16 autocast) and run them with aot_eager, which skips inductor's C++
# build: a whole model's kernels cost minutes on a cold cache of a 2-core machine, more than the suite's budget.
# Inductor's own code is checked where it matters to exactness, the dropout masks' bits below; benchmarks/compile.py
# runs the layouts with inductor. A bf16-autocast layout is compared with the same layout run eagerly (bf16 rounds
# each micro-batch's products: layouts of different micro-batches differ by bf16 ulps, compiled or not), at the
# fp32 cases' tolerance: aot_eager runs the same aten operations in the same dtypes.
LAYOUTS = {"dp1": (1, {}, 2, "fp32"), "dp2": (2, {"dp": 2}, 2, "fp32"), "tp2": (2, {"tp": 2}, 4, "fp32"),
           # pipeline stages of tensor-parallel degrees 1 and 2 (plain and tensor-parallel pieces), recomputed
           "stage-tp": (3, {"stage_tp": "1,2", "schedule": "1f1b", "recompute": "all"}, 1, "fp32"),
           # ZeRO-2 (reduce-scatter per micro-batch, sharded update) under bf16 autocast
           "zero2-bf16": (2, {"dp": 2, "zero": 2}, 1, "bf16-autocast"),
           "zero3": (2, {"dp": 2, "zero": 3}, 2, "fp32")}  # FSDP2 around the compiled blocks


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_layout_matches_eager(rank_pool, tmp_path, tmp_path_factory, layout):
    world, strategy, micro, dtype = LAYOUTS[layout]
    job = dict(model_args=MODEL_ARGS, strategy=strategy, micro_batch_size=micro, dtype=dtype, **RUN)
    expected = (_eager(rank_pool, tmp_path_factory) if dtype == "fp32" else
                rank_pool(world).run(train_builtin, "gpt-tiny", str(tmp_path / "eager"), **job)[0])
    results = rank_pool(world).run(train_builtin, "gpt-tiny", str(tmp_path), compile=True, compile_backend="aot_eager",
                                   **job)
    for rank, got in enumerate(results):
        _assert_matches(expected, got, f"{layout} rank {rank}")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["compile_recompiles"] for r in records] == [0] * RUN["steps"], records  # compiled once, not per step
    assert all(r["compile_graph_breaks"] == 0 for r in records), records
    summary = json.loads((tmp_path / "summary.json").read_text())["compile"]
    assert summary["regions"] >= 2 and summary["compile_s"] > 0 and summary["graph_breaks"] == {}, summary
    assert summary["optimizer_kernel"] == "fused", summary  # the update as one kernel (train/optim.py)


def test_compiled_run_resumes_where_it_stopped(rank_pool, tmp_path, tmp_path_factory):
    """Two compiled steps, then a third on --resume (compiled again, from the cache): the uninterrupted run."""
    expected = _eager(rank_pool, tmp_path_factory)
    pool = rank_pool(1)
    # micro-batches of 2, as the dp=1 case: this rank's compiled graphs serve (a new shape would compile anew)
    pool.run(train_builtin, "gpt-tiny", str(tmp_path), model_args=MODEL_ARGS, micro_batch_size=2, compile=True,
             compile_backend="aot_eager", **{**RUN, "steps": 2})
    got = pool.run(train_builtin, "gpt-tiny", str(tmp_path / "resumed"), model_args=MODEL_ARGS, micro_batch_size=2,
                   compile=True, compile_backend="aot_eager", resume=str(tmp_path), **RUN)[0]
    assert got["first_step"] == 3
    assert abs(got["losses"][-1] - expected["losses"][-1]) / expected["losses"][-1] < 1e-5
    for name, value in got["params"].items():
        assert (value - expected["params"][name]).abs().max() < 1e-5, name


def test_repeated_blocks_are_the_regions():
    from autopar.models.gpt import GPT, GPTConfig
    gpt = GPT(GPTConfig(n_layer=3))
    assert [name for name, _ in repeated_blocks(gpt)] == ["blocks.0", "blocks.1", "blocks.2"]
    plain = nn.Sequential(nn.Linear(2, 2), nn.ReLU())  # no run of one class: the whole model is the region
    assert repeated_blocks(plain) == [("(whole model)", plain)]


@pytest.mark.parametrize("schedule,chunks", [("zb-h1", 1), ("pipedream-2bw", 1)])
def test_schedules_a_compiled_region_cannot_run_are_refused(schedule, chunks):
    setup = Setup(Strategy(dp=1, pp=2, schedule=schedule, chunks=chunks), TrainConfig(compile=True), world=2)
    with pytest.raises(ConfigError, match="--compile"):
        check_rules(setup)
    check_rules(Setup(Strategy(dp=1, pp=2, schedule=schedule, chunks=chunks), TrainConfig(), world=2))


def _mask_bits_and_frames() -> tuple[bool, int]:
    """Dropout compiled alone over three steps: (every step's mask equal to eager's, frames compiled after step 1)."""
    from autopar._torch_internals import compile_counters
    from autopar.dropout import dropout_step, eager_micro_batch

    def dropped(x):
        return torch.nn.functional.dropout(x, 0.5) * 2

    compiled = torch.compile(dropped)
    x = torch.ones(2, 3, 8)
    equal, frames = True, None
    for step in range(3):
        with dropout_step(5, step, [[4, 9]]):
            with eager_micro_batch(0):
                eager = dropped(x)
            with eager_micro_batch(0):  # (a mask is numbered by its call within the micro-batch: a fresh one)
                got = compiled(x)
        equal = equal and torch.equal(eager, got) and not torch.equal(eager, x * 2)
        frames = compile_counters()["frames"] if frames is None else frames
    return equal, compile_counters()["frames"] - frames


class _DroppingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.nn.functional.dropout(self.linear(torch.nn.functional.dropout(x, 0.5)), 0.5)


class _TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_DroppingBlock(), _DroppingBlock()])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


def _blocks_with_dropout_compiled() -> tuple[bool, int]:
    """Two blocks of one class, two dropouts each, compiled per block (dynamo's capture only) over two steps of two
    micro-batches: (outputs equal to eager's, graphs captured). Block 1's dropouts are operations 2 and 3: with the
    numbers baked in, each block would be a graph of its own (and a compile of its own)."""
    from autopar.dropout import dropout_step, eager_micro_batch
    from autopar.train.compile import compile_regions, repeated_blocks
    graphs = []

    def capture(graph_module, example_inputs):  # a backend that records what dynamo captured and runs it as is
        graphs.append(graph_module.code)
        return graph_module.forward

    torch.manual_seed(0)
    eager, compiled = _TwoBlocks(), _TwoBlocks()
    compiled.load_state_dict(eager.state_dict())
    assert len(compile_regions(repeated_blocks(compiled), capture)) == 2
    x, equal = torch.ones(4, 3, 8, requires_grad=True), True  # (block 1 gets a tensor requiring grad too)
    for step in range(2):
        for index in range(2):
            outputs = []
            for model in (eager, compiled):
                with dropout_step(5, step, [[0, 1], [2, 3]]), eager_micro_batch(index):
                    outputs.append(model(x[2 * index:2 * index + 2]))
            equal = equal and torch.equal(*outputs)
    return equal, len(graphs)


def _stage_pieces_with_dropout_compiled() -> tuple[bool, int]:
    """A pipeline stage of gpt-tiny with three blocks (dropout 0.1), its pieces compiled (dynamo's capture only):
    (its output equal to the same stage's uncompiled, how many different graphs the three blocks' pieces are,
    compared node by node without the names, which differ from piece to piece)."""
    from torch import fx

    from autopar.dropout import dropout_step, micro_batch
    from autopar.models.gpt import GPT, GPTConfig
    from autopar.partition.stages import StageModule, materialize_stage, plan_stages
    from autopar.trace import trace
    from autopar.train.compile import compile_forward
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(tuple((n.op, str(n.target), fx.node.map_arg(n.args, lambda _: "%"))
                            for n in graph_module.graph.nodes if n.op != "placeholder"))
        return graph_module.forward

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, d_model=16, n_head=2, dropout=0.1, vocab_size=32))
    graph = trace(model, (torch.zeros(2, 4, dtype=torch.long),))
    spec = plan_stages(graph, [0, len(graph.blocks)])[0]
    eager, compiled = (materialize_stage(StageModule(graph, spec, 1), model, "cpu") for _ in range(2))
    for piece in compiled.pieces:
        compile_forward(piece, capture)
    tokens = torch.randint(0, 32, (2, 4))
    outputs = []
    for stage in (eager, compiled):
        with dropout_step(1, 0, [[0, 1]]), micro_batch(0):
            outputs.append(stage(tokens))
    assert len(graphs) == len(compiled.pieces) == 5  # the embeddings, three blocks, the head
    return torch.equal(*outputs), len(set(graphs[1:4]))


def test_dropout_masks_compile_to_the_eager_bits(rank_pool):
    """The mask under torch.compile: the same bits as eager, across steps, without recompiling per step; and the
    copies of a block with dropout compile to one graph, in a model run whole and in a pipeline stage's pieces
    (run in a pool rank, whose compiler is already warm)."""
    pool = rank_pool(1)
    equal, recompiled = pool.run(_mask_bits_and_frames)[0]
    assert equal and recompiled == 0, (equal, recompiled)
    blocks_equal, graphs = pool.run(_blocks_with_dropout_compiled)[0]
    assert blocks_equal and graphs == 1, (blocks_equal, graphs)
    pieces_equal, block_graphs = pool.run(_stage_pieces_with_dropout_compiled)[0]
    assert pieces_equal and block_graphs == 1, (pieces_equal, block_graphs)


def test_a_graph_break_is_reported_once_with_torchs_reason(tmp_path):
    """A construct the compiler cannot capture (here a print) is counted per step and explained once."""
    from autopar.train.compile import CompileAccount
    account = CompileAccount(["f"], tmp_path)

    def f(x):
        x = x + 1
        print(end="")
        return x * 2

    torch.compile(f, backend="eager")(torch.ones(2))  # eager backend: dynamo's capture only, no kernels built
    fields = account.step_fields()
    assert fields["compile_graph_breaks"] == 1 and fields["compile_recompiles"] == 0, fields
    report = account.graph_break_report()
    assert report is not None and "1x" in report and "print" in report, report
    assert account.graph_break_report() is None  # once
    assert list(account.summary()["graph_breaks"].values()) == [1]


def test_the_update_is_one_fused_kernel_where_torch_has_one():
    """Every run (eager or compiled) runs the optimizer's element-wise update as torch's fused kernel, unless asked
    for foreach or where fused has no kernel (sparse gradients)."""
    from autopar.train.optim import build_optimizer
    model = nn.Linear(4, 4)
    for name in ("adamw", "adam", "sgd", "adagrad"):
        for config in (TrainConfig(compile=True, optimizer=name), TrainConfig(optimizer=name)):
            fused = build_optimizer(model, config)
            assert fused.defaults["fused"] and not fused.defaults["foreach"], (name, fused.defaults)
        foreach = build_optimizer(model, TrainConfig(optimizer=name, optimizer_kernel="foreach"))
        assert foreach.defaults["foreach"] and not foreach.defaults["fused"], (name, foreach.defaults)
    sparse = nn.Sequential(nn.Embedding(8, 4, sparse=True), nn.Linear(4, 4))
    assert build_optimizer(sparse, TrainConfig(optimizer="sgd")).defaults["foreach"]
    with pytest.raises(ConfigError, match="optimizer_kernel must be one of"):
        TrainConfig(optimizer_kernel="fast").validate()


def test_the_speedup_a_planner_reads_is_measured_on_one_block():
    """measure_compile_speedup times one block eager and compiled (aot_eager here: no kernels built) and the update
    foreach and fused, and prices a step with them."""
    from autopar.models.gpt import GPT, GPTConfig
    from autopar.train.compile_speedup import measure_compile_speedup
    block = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2)).blocks[0]
    before = {name: p.clone() for name, p in block.state_dict().items()}
    speedup = measure_compile_speedup(block, torch.randn(2, 8, 32), backend="aot_eager", repeats=2)
    import math  # (ratios of sub-millisecond calls on a shared machine: their values are the benchmark's business)
    assert all(0 < r and math.isfinite(r) for r in (speedup.block, speedup.update, speedup.compile_s)), speedup
    assert speedup.step_seconds(blocks_s=1.0, update_s=1.0, other_s=0.5) == speedup.block + speedup.update + 0.5
    assert all(torch.equal(p, before[name]) for name, p in block.state_dict().items())  # the block is untouched
