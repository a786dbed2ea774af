"""Stage modules composed in one process reproduce the full model: outputs and every gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autopar.errors import ConfigError, ModelError
from autopar.models import build_model, materialize
from autopar.partition import crossings, materialize_stage, partition
from autopar.trace import trace
from autopar.models.output import logits_of

# three repeated layers + prelude + postlude = 5 blocks: pp in {2, 3, 4} never divides it
MODELS = {"gpt-tiny": {"n_layer": 3}, "hf:gpt2": {"n_layer": 3}, "hf:llama": {"num_hidden_layers": 3},
          "hf:bert": {"num_hidden_layers": 3}}
SHAPE = (2, 16)
_traced: dict = {}


def setup(name: str):
    if name not in _traced:
        model, _ = build_model(name, MODELS[name], vocab_size=320, device="meta")
        graph = trace(model, (torch.zeros(SHAPE, dtype=torch.long, device="meta"),))
        _traced[name] = (model, graph)
    return _traced[name]


def canonical(full: nn.Module, fqn: str, names: set[str]) -> str:
    """The name a stage uses for a (possibly tied) parameter of the full model."""
    target = full.get_parameter(fqn)
    return next(n for n, p in full.named_parameters(remove_duplicate=False) if p is target and n in names)


def run_stages(stages, ids):
    values = (ids,)
    for stage in stages:
        values = stage(*values)
    return values


def sum_shared_gradients(stages, shared: dict[str, list[int]]) -> None:
    """What the pipeline runtime does across ranks, done here in one process."""
    for fqn, owners in shared.items():
        total = sum(stages[s].get_parameter(fqn).grad for s in owners)
        for s in owners:
            stages[s].get_parameter(fqn).grad = total.clone()


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("pp,method", [(2, "time"), (3, "uniform"), (4, "parameters"), (3, "time")])
def test_stages_reproduce_outputs_and_gradients(name, pp, method):
    model, graph = setup(name)
    part = partition(graph, pp, method=method)
    assert len(part.specs) == pp and part.bounds[-1] == len(graph.blocks)
    full = materialize(copy.deepcopy(model), "cpu", seed=0)
    stages = [materialize_stage(part.build_stage(i), full, "cpu") for i in range(pp)]
    ids = torch.randint(0, 256, SHAPE, generator=torch.Generator().manual_seed(1))
    expected = logits_of(full(ids))
    got = logits_of(run_stages(stages, ids))
    assert torch.equal(got, expected)  # bitwise: the stage graphs run the eager model's aten ops on the same shapes
    expected.float().square().mean().backward()
    got.float().square().mean().backward()
    sum_shared_gradients(stages, part.shared)
    seen = set()
    for fqn, p in full.named_parameters():
        owners = [s for s in stages if any(fqn_alias in s.spec.params for fqn_alias in _aliases(full, fqn))]
        assert owners, f"no stage owns {fqn}"
        for stage in owners:
            name_in_stage = canonical(full, fqn, set(stage.spec.params))
            torch.testing.assert_close(stage.get_parameter(name_in_stage).grad, p.grad, rtol=1e-5, atol=1e-6)
            seen.add(name_in_stage)
    # each stage holds only what it reads, under the model's own names
    all_names = {n for n, _ in full.named_parameters(remove_duplicate=False)}
    for stage in stages:
        assert {n for n, _ in stage.named_parameters()} == set(stage.spec.params) <= all_names


def _aliases(full: nn.Module, fqn: str) -> set[str]:
    target = full.get_parameter(fqn)
    return {n for n, p in full.named_parameters(remove_duplicate=False) if p is target}


@pytest.mark.parametrize("name", ["gpt-tiny", "hf:bert"])
def test_tied_weights_stay_equal_and_train_like_the_full_model(name):
    model, graph = setup(name)
    part = partition(graph, 3, method="uniform")
    assert part.shared, "the tied embedding/head should sit on two stages"
    full = materialize(copy.deepcopy(model), "cpu", seed=0)
    stages = [materialize_stage(part.build_stage(i), full, "cpu") for i in range(3)]
    full_opt = torch.optim.SGD(full.parameters(), lr=0.5)
    stage_opts = [torch.optim.SGD(s.parameters(), lr=0.5) for s in stages]
    for step in range(3):
        ids = torch.randint(0, 256, SHAPE, generator=torch.Generator().manual_seed(step))
        logits_of(full(ids)).square().mean().backward()
        logits_of(run_stages(stages, ids)).square().mean().backward()
        sum_shared_gradients(stages, part.shared)
        for opt in (full_opt, *stage_opts):
            opt.step()
            opt.zero_grad()
    for fqn, owners in part.shared.items():
        copies = [stages[s].get_parameter(fqn) for s in owners]
        assert all(torch.equal(copies[0], c) for c in copies[1:])  # bitwise: copies get the same summed gradient
        torch.testing.assert_close(copies[0], full.get_parameter(fqn), rtol=1e-5, atol=1e-6)


def test_what_crosses_each_cut():
    _, gpt = setup("gpt-tiny")
    assert all(len(values) == 1 for values in crossings(gpt)[1:-1])  # only the hidden state between layers
    _, llama = setup("hf:llama")
    between_layers = crossings(llama)[1]
    assert len(between_layers) == 4  # hidden state, attention mask, rotary cos and sin
    assert sum(not v.needs_grad for v in between_layers) >= 1  # the boolean mask travels without a gradient


def test_time_method_respects_a_memory_cap_and_explains_itself():
    _, graph = setup("gpt-tiny")
    loose = partition(graph, 2, method="time")
    cap = max(s.memory_bytes for s in loose.stages) * 0.999
    with pytest.raises(ConfigError, match="smallest cap that fits"):
        partition(graph, 2, method="time", memory_cap_bytes=min(s.memory_bytes for s in loose.stages) / 2)
    tight = partition(graph, 2, method="time", memory_cap_bytes=cap)
    assert all(s.memory_bytes <= cap * 1.01 for s in tight.stages)
    table = loose.table()
    assert "cut 0->1" in table and "shared parameter tok_emb.weight" in table
    assert loose.to_dict()["bounds"] == loose.bounds


def test_bad_partition_requests():
    _, graph = setup("gpt-tiny")
    with pytest.raises(ConfigError, match="pp=6 stages but the model has only 5 blocks"):
        partition(graph, 6)
    with pytest.raises(ConfigError, match="unknown partition method 'fastest'"):
        partition(graph, 2, method="fastest")


class NoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        for layer in self.layers:
            if x.sum() > 0:  # Python control flow on a tensor value: not traceable
                x = layer(x)
        return x


def test_models_that_cannot_be_partitioned_get_clear_errors():
    graph = trace(NoLayers(), (torch.zeros(2, 4),))  # no stack: one block, which tp can still use
    assert [b.name for b in graph.blocks] == ["model"]
    with pytest.raises(ModelError, match="need a stack of blocks to cut between"):
        partition(graph, 2)
    with pytest.raises(ModelError, match="torch.export could not trace DataDependent"):
        trace(DataDependent(), (torch.zeros(2, 4),))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_rank_materialises_only_its_stage_with_the_full_models_init(name):
    model, graph = setup(name)
    part = partition(graph, 3, method="uniform")
    full = materialize(copy.deepcopy(model), "cpu", seed=7)
    for index in range(3):
        stage = part.materialize_stage(index, model, "cpu", seed=7)
        assert {n for n, _ in stage.named_parameters()} == set(part.specs[index].params)
        for fqn, value in stage.named_parameters():
            assert torch.equal(value, full.get_parameter(fqn)), fqn  # bitwise: the same seeded init draws
        for fqn, value in stage.named_buffers():
            assert torch.equal(value, full.get_buffer(fqn)), fqn
    assert all(p.is_meta for p in model.parameters())  # the traced model itself is untouched


def test_partial_materialisation_allocates_only_what_is_kept():
    from autopar.models import materialize_partial
    model, _ = setup("gpt-tiny")
    keep = {"blocks.1.attn.q_proj.weight", "lm_head.weight"}
    partial = materialize_partial(copy.deepcopy(model), keep, "cpu", seed=0)
    real = {n for n, p in partial.named_parameters(remove_duplicate=False) if not p.is_meta}
    assert real == keep | {"tok_emb.weight"}  # the tied alias of lm_head.weight


class RotaryScaledLM(nn.Module):
    """On meta: a non-persistent buffer its reset_parameters fills (rotary frequencies, like Falcon's
    inv_freq) and a constant made in forward, whose value a trace on meta does not know."""

    def __init__(self, width: int = 16, vocab: int = 64):
        super().__init__()
        self.width = width
        self.embed = nn.Embedding(vocab, width)
        self.register_buffer("inv_freq", torch.empty(width // 2), persistent=False)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.head = nn.Linear(width, vocab)

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, self.width, 2).float() / self.width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(ids.shape[1], device=ids.device)[:, None] * self.inv_freq[None]
        x = self.embed(ids) * torch.cos(angles).repeat(1, 2)
        residual_scale = torch.tensor([0.5], device=ids.device)  # a lifted constant
        for layer in self.layers:
            x = x + residual_scale * layer(x)
        return self.head(x)


def test_stages_of_a_meta_model_get_its_buffers_and_forward_constants_right():
    """The re-trace that finds a forward constant's value runs on an uninitialised copy: its
    non-persistent buffers (garbage there) must not replace the stage's initialised ones."""
    with torch.device("meta"):
        model = RotaryScaledLM()
    ids = torch.randint(0, 64, SHAPE)
    graph = trace(model, (torch.zeros(SHAPE, dtype=torch.long, device="meta"),))
    part = partition(graph, 2, method="uniform")
    full = materialize(copy.deepcopy(model), "cpu", seed=3)
    stages = [part.materialize_stage(i, model, "cpu", seed=3) for i in range(2)]
    assert torch.equal(stages[0].get_buffer("inv_freq"), full.inv_freq)
    assert "inv_freq" not in stages[0].constants and None not in stages[-1].constants.values()
    assert torch.equal(run_stages(stages, ids), full(ids))
