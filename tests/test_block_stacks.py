"""The repeated layers a pipeline cuts between are found however the model holds them.

Models (tests/block_stack_models.py), each built on meta and for real: a llama-style model
whose layers sit in an nn.ModuleDict, a model whose blocks are attributes h0..h3 (each with
an nn.Sequential MLP inside, which must not be taken for the stack), and the same blocks in
an nn.Sequential. For each: the stack found and its 4 layers by name, a pp=2 cut of 2 layers
per stage, the plan naming the stack; then training the ModuleDict and attribute models
under pp=2, and the ModuleDict one under ZeRO-3 with dp only (one FSDP2 unit per layer),
equal to one process (losses within
1e-5 relative, parameters 1e-5), with the banner naming the stack. Also: layers run in the
order forward calls them, a ModuleDict of unlike entries is not a stack, alternating block
classes stay one stack, encoder-decoders keep two stacks, identical towers are cut inside.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import ModelError
from autopar.partition import partition
from autopar.trace import find_stacks, trace
from block_stack_models import SEQ, MlpBlock, build, train
from helpers import max_relative_difference

EXPECTED = {  # model -> (layer names, the stack as plans and banners name it)
    "module-dict": (["layers.0", "layers.1", "layers.2", "layers.3"], "layers (ModuleDict, 4 x LlamaBlock)"),
    "attributes": (["h0", "h1", "h2", "h3"], "h0 .. h3 (attributes of the model, 4 x MlpBlock)"),
    "sequential": (["blocks.0", "blocks.1", "blocks.2", "blocks.3"], "blocks (Sequential, 4 x MlpBlock)"),
}
KINDS = {"module-dict": "ModuleDict", "attributes": "attributes", "sequential": "Sequential"}


def traced(model: nn.Module):
    device = next(model.parameters()).device
    return trace(model, (torch.zeros(2, SEQ, dtype=torch.long, device=device),))


@pytest.mark.parametrize("device", ["meta", "real"])
@pytest.mark.parametrize("name", list(EXPECTED))
def test_the_outer_blocks_are_the_stack_and_pp2_cuts_two_per_stage(name, device):
    layers, described = EXPECTED[name]
    graph = traced(build(name, device))
    assert [b.name for b in graph.blocks] == ["prelude", *layers, "postlude"]
    assert [s.describe() for s in graph.stacks] == [described]
    for method in ("time", "parameters", "uniform"):
        cut = partition(graph, 2, method=method)
        assert [spec.blocks for spec in cut.specs] == [["prelude", *layers[:2]], [*layers[2:], "postlude"]], method
        assert cut.layers_per_stage() == [2, 2]
    assert f"layers cut: {described}; layers per stage 2, 2" in cut.table().splitlines()
    stacks = cut.to_dict()["stacks"]
    assert [(s["kind"], s["layers"]) for s in stacks] == [(KINDS[name], layers)]


class CalledOutOfOrder(nn.Module):
    """Blocks registered in one order and called in another: the forward's order is the layers' order."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.second, self.first, self.third = MlpBlock(), MlpBlock(), MlpBlock()
        self.head = nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.third(self.second(self.first(self.embed(input_ids)))))


class NanoStyle(nn.Module):
    """The GPT layout of a ModuleDict of unlike entries, its blocks in a ModuleList inside."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(64, 32), h=nn.ModuleList([MlpBlock() for _ in range(3)]),
                                              ln_f=nn.LayerNorm(32)))
        self.lm_head = nn.Linear(32, 64, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(input_ids)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MlpBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TwoTowers(nn.Module):
    """Two identical towers as attributes: cut between their layers, not only between the towers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.query, self.doc = Tower(), Tower()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        return (self.query(x) * self.doc(x)).sum(-1)


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


def test_attribute_layers_follow_the_forward_and_unlike_entries_are_no_stack():
    with torch.device("meta"):
        graph = traced(CalledOutOfOrder())
        assert [b.name for b in graph.blocks] == ["prelude", "first", "second", "third", "postlude"]
        assert [s.describe() for s in graph.stacks] == ["first .. third (attributes of the model, 3 x MlpBlock)"]
        graph = traced(NanoStyle())
        assert [s.describe() for s in graph.stacks] == ["transformer.h (ModuleList, 3 x MlpBlock)"]
        graph = traced(TwoTowers())
        assert [s.path for s in graph.stacks] == ["query.layers", "doc.layers"] and len(graph.blocks) == 8
        two_linears = trace(TwoLinears(), (torch.zeros(2, 8, device="meta"),))
    assert two_linears.stacks == [] and [b.name for b in two_linears.blocks] == ["model"]
    with pytest.raises(ModelError, match="nn.ModuleDict or attributes of one module"):
        partition(two_linears, 2)


def test_alternating_blocks_stay_one_stack_and_encoder_decoders_two():
    from zoo_models import CASES, MixedBlocksLM, hf_model
    with torch.device("meta"):
        graph = traced(MixedBlocksLM())
    assert [s.describe() for s in graph.stacks] == ["layers (ModuleList, 2 x Block + 2 x MixerBlock)"]
    assert len(graph.blocks) == 6 and partition(graph, 2, method="uniform").layers_per_stage() == [2, 2]
    assert [s.path for s in find_stacks(CASES["hf:t5"].build())] == ["encoder.block", "decoder.block"]
    bart = hf_model("bart", "seq2seq", d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    assert [s.path for s in find_stacks(bart)] == ["model.encoder.layers", "model.decoder.layers"]


def assert_equal_to_one_process(expected: dict, got: dict, case) -> None:
    assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (case, expected["losses"], got["losses"])
    assert got["params"] and got["params"].keys() <= expected["params"].keys(), case
    for key, value in got["params"].items():
        assert (value - expected["params"][key]).abs().max() < 1e-5, (case, key)


def test_pp2_and_zero3_train_like_one_process_and_name_the_stack(rank_pool, tmp_path):
    # the two holders pp used to refuse or cut wrong; the Sequential trains in test_user_models and the zoo
    pp2 = [(name, device, {"pp": 2}) for name in ("module-dict", "attributes") for device in ("meta", "real")]
    zero3 = [("module-dict", "meta", {"zero": 3})]
    references = rank_pool(1).run(train, [(name, device, {}) for name, device, _ in pp2], str(tmp_path / "one"))[0]
    expected = {(name, device): ref for (name, device, _), ref in zip(pp2, references)}
    results = rank_pool(2).run(train, pp2 + zero3, str(tmp_path / "two"))
    for rank, per_case in enumerate(results):
        for (name, device, strategy), got in zip(pp2 + zero3, per_case):
            case = (rank, name, device, strategy)
            assert_equal_to_one_process(expected[(name, device)], got, case)
            layers, described = EXPECTED[name]
            if "pp" in strategy:
                assert got["blocks"] == [["prelude", *layers[:2]], [*layers[2:], "postlude"]], case
                assert f"layers cut: {described}; layers per stage 2, 2" in got["banner"].splitlines(), case
            else:  # ZeRO-3: one FSDP2 unit per layer, and every parameter of the model gathered back whole
                assert got["units"] == layers, case
                assert got["params"].keys() == expected[(name, device)]["params"].keys(), case
                assert f"ZeRO-3: one FSDP2 unit per layer of {described} (4 units), plus one for the rest of the " \
                       f"model" in got["banner"], case


def test_autopar_plan_names_the_stack_cut(capsys):
    import json

    from autopar.cli import main
    assert main(["plan", "--model", "gpt-tiny", "--pp", "2", "--seq-len", "16"]) == 0
    assert "layers cut: blocks (ModuleList, 2 x Block); layers per stage 1, 1" in capsys.readouterr().out.splitlines()
    assert main(["plan", "--model", "gpt-tiny", "--pp", "2", "--seq-len", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stacks"] == [{"path": "blocks", "kind": "ModuleList", "layers": ["blocks.0", "blocks.1"],
                                 "classes": ["Block", "Block"]}] and result["layers_per_stage"] == [1, 1]
