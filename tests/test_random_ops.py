"""Every random operation a model can reach is layout-free or refused, never a silent layout difference.

Layout-free (autopar/dropout/random_ops.py): torch's Transformer layers (the attention
dropout inside nn.MultiheadAttention), F.scaled_dot_product_attention's dropout_p, alpha
and feature-alpha dropout, rrelu; refused before the first step: everything else that
draws (torch.randn noise injection here, an LSTM's dropout, a draw hidden in a torch
composite). The layout tests train tests/random_ops_models.py's models 2 steps of 8
samples on dp2, pp2 and tp2 (2 micro-batches of 4) against one process (one micro-batch
of 8): losses within 1e-5 relative, parameters within 1e-5. All models of a layout train
in one pool task.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.dropout import dropout_numbering, dropout_step, eager_micro_batch, micro_batch, replace_dropout_nodes
from autopar.errors import ModelError
from random_ops_models import MODELS, REFUSED, EncoderLM, train_all

LAYOUTS = {"dp2": {"dp": 2}, "pp2": {"pp": 2}, "tp2": {"tp": 2}}
NAMES = list(MODELS) + list(REFUSED)
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5
_reference: dict = {}


def reference(rank_pool, tmp_path_factory) -> dict:
    if not _reference:
        out = str(tmp_path_factory.mktemp("random-ops-reference"))
        _reference.update(rank_pool(1).run(train_all, NAMES, out, {}, 8, timeout=300)[0])
    return _reference


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def assert_refused_before_first_step(got: dict, *words: str) -> None:
    assert "losses" not in got, "trained instead of refusing"
    assert got["autopar_error"], (got["error"], got["message"])
    assert not got["stepped"], "a step ran before the error"
    assert all(w in got["message"] for w in words), (words, got["message"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_random_ops_match_single_process(rank_pool, tmp_path, tmp_path_factory, layout):
    expected = reference(rank_pool, tmp_path_factory)
    results = rank_pool(2).run(train_all, NAMES, str(tmp_path), LAYOUTS[layout], 4, timeout=300)
    for rank, run in enumerate(results):
        for name in MODELS:
            got, want = run[name], expected[name]
            assert "losses" in got and "losses" in want, (rank, name, got.get("message"), want.get("message"))
            assert relative_difference(want["losses"], got["losses"]) < LOSS_RTOL, \
                (rank, name, want["losses"], got["losses"])
            assert got["params"], (rank, name)
            for key, value in got["params"].items():  # pp: this rank's stage; tp: slices gathered
                assert (value - want["params"][key]).abs().max() < PARAM_ATOL, (rank, name, key)
        # noise injection: refused on every rank (and in one process), naming the op and the model's line
        assert_refused_before_first_step(run["noise-injection"], "randn_like")
    assert_refused_before_first_step(expected["noise-injection"], "randn_like")
    if layout == "tp2":
        for name in MODELS:  # replicated parameters: the same masks on both tp ranks, so bit-identical
            first, second = (run[name]["params"] for run in results)
            for key in first:
                assert torch.equal(first[key], second[key]), (name, key)


# ---------------------------------------------------------------------------- one process, eager and traced


def test_transformer_layers_draw_the_same_masks_in_every_run():
    """nn.TransformerEncoder's attention dropout (inside nn.MultiheadAttention) follows the step and the
    samples, not the process's random stream: two runs with the stream moved in between agree bitwise."""
    torch.manual_seed(0)
    model, ids = EncoderLM(), torch.randint(0, 128, (2, 16))
    outputs = []
    for _ in range(2):
        torch.rand(17)  # the process's stream moves on; layout-free draws must not notice
        with dropout_step(3, 1, [[4, 5]], scan_random_ops=True), eager_micro_batch(0):
            outputs.append(model(ids))
    assert torch.equal(outputs[0], outputs[1])  # exact: the same hashes and the same arithmetic
    model.eval()
    assert not torch.allclose(model(ids), outputs[0])  # dropout really ran


class AllRandomOps(nn.Module):
    """Every layout-free random op once: MHA (both of its attention paths), sdpa, alpha, feature alpha,
    rrelu, native_dropout and dropout2d."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, dropout=0.2, batch_first=True)
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(x, x, x, need_weights=False)[0] + self.attn(x, x, x, need_weights=True)[0]
        b, t, c = x.shape
        q = x.view(b, t, 4, c // 4).transpose(1, 2)
        x = x + F.scaled_dot_product_attention(q, q, q, dropout_p=0.3).transpose(1, 2).reshape(b, t, c)
        x = F.alpha_dropout(F.selu(self.linear(x)), 0.2, self.training)
        x = F.feature_alpha_dropout(x, 0.2, self.training) + F.rrelu(x, training=self.training)
        x = torch.native_dropout(x, 0.25, self.training)[0]
        return F.dropout2d(x.unsqueeze(-1), 0.1, self.training).squeeze(-1)


class Seq2Seq(nn.Module):
    """nn.Transformer (encoder and decoder layers: self- and cross-attention dropout) at its default dropout."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(16, 4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32,
                                          batch_first=True)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(target.shape[1])
        return self.transformer(source, target, tgt_mask=causal, tgt_is_causal=True)


@pytest.mark.parametrize("build,draws", [(AllRandomOps, 8), (Seq2Seq, 10)], ids=["all-ops", "nn.Transformer"])
def test_eager_equals_traced_for_every_layout_free_op(build, draws):
    """The whole model run eagerly and its exported graph with replaced nodes draw the same numbers: the
    eager call order and the graph's node order number the ops alike."""
    torch.manual_seed(0)
    model = build()
    inputs = (torch.randn(4, 6, 16),) if build is AllRandomOps else (torch.randn(4, 6, 16), torch.randn(4, 5, 16))
    first_two = tuple(x[:2] for x in inputs)
    graph = torch.export.export(model, first_two, strict=False).module()  # traced for micro-batches of 2
    numbering = dropout_numbering(graph.graph)
    assert replace_dropout_nodes(graph, numbering, batch=2) == len(numbering) == draws
    with dropout_step(5, 2, [[0, 1], [2, 3]]):
        for index, rows in enumerate((slice(0, 2), slice(2, 4))):
            with eager_micro_batch(index):
                eager = model(*(x[rows] for x in inputs))
            with micro_batch(index):
                traced = graph(*(x[rows] for x in inputs))
            assert torch.allclose(eager, traced, rtol=1e-5, atol=1e-6), (eager - traced).abs().max()
    with dropout_step(5, 2, [[0, 1, 2, 3]]), eager_micro_batch(0):
        whole = model(*inputs)
    with dropout_step(5, 2, [[0, 1], [2, 3]]), eager_micro_batch(1):
        second = model(*(x[2:] for x in inputs))
    assert torch.allclose(whole[2:], second, rtol=1e-5, atol=1e-6)  # a sample keeps its draws in any micro-batch
    model.eval()
    assert not torch.allclose(model(*inputs), whole)  # dropout really ran


def test_alpha_dropout_keeps_selu_statistics():
    x = torch.randn(64, 4096)
    with dropout_step(0, 0, [list(range(64))]), eager_micro_batch(0):
        out = F.alpha_dropout(x, 0.2, training=True)
    assert abs(float(out.mean())) < 0.01 and abs(float(out.std()) - 1) < 0.01  # 262144 draws: 5 standard errors
    dropped = torch.mode(out.flatten()).values  # every dropped unit takes one value (SELU's saturation, moved)
    assert abs(float((out == dropped).float().mean()) - 0.2) < 0.005


# ---------------------------------------------------------------------------- refused draws


class HiddenDraw(nn.Module):
    """Re-draws a buffer with nn.init inside forward: a draw inside a torch composite function."""

    def __init__(self):
        super().__init__()
        self.register_buffer("noise", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nn.init.normal_(self.noise)
        return x + self.noise


def test_a_draw_hidden_in_a_torch_function_is_refused_in_the_first_step():
    with dropout_step(0, 0, [[0, 1]], scan_random_ops=True), eager_micro_batch(0), \
            pytest.raises(ModelError, match=r"aten.normal_.*torch.nn.init.normal_"):
        HiddenDraw()(torch.ones(2, 8))


def test_lstm_dropout_is_refused_eager_and_traced():
    lstm = nn.LSTM(8, 8, num_layers=2, dropout=0.1, batch_first=True)
    x = torch.ones(2, 3, 8)
    with dropout_step(0, 0, [[0, 1]]), eager_micro_batch(0), pytest.raises(ModelError, match="lstm"):
        lstm(x)
    graph = torch.export.export(lstm, (x,), strict=False).graph
    with pytest.raises(ModelError, match="lstm"):
        dropout_numbering(graph)
    lstm.dropout = 0.0  # no dropout: nothing drawn, nothing refused
    dropout_numbering(torch.export.export(lstm, (x,), strict=False).graph)
    with dropout_step(0, 0, [[0, 1]], scan_random_ops=True), eager_micro_batch(0):
        lstm(x)


@pytest.mark.parametrize("draw", [
    lambda x: x + torch.rand(x.shape), lambda x: x * torch.bernoulli(torch.full_like(x, 0.5)),
    lambda x: x.clone().bernoulli_(0.5), lambda x: x.clone().uniform_(), lambda x: x[torch.randperm(2)],
    lambda x: x + torch.multinomial(x.softmax(-1), 1), lambda x: F.gumbel_softmax(x),
    lambda x: x + torch.normal(0.0, 1.0, x.shape)],
    ids=["rand", "bernoulli", "bernoulli_", "uniform_", "randperm", "multinomial", "gumbel_softmax", "normal"])
def test_every_visible_draw_is_refused_on_every_step(draw):
    """Not only in the scanned first step: a torch call that draws is refused in any training step."""
    with dropout_step(0, 7, [[0, 1]]), eager_micro_batch(0), pytest.raises(ModelError, match="layout"):
        draw(torch.ones(2, 4))
    draw(torch.ones(2, 4))  # outside a training step (evaluation, the user's own code): torch's own draw
