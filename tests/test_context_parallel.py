"""Context parallelism (--cp) trains like one process: the sequence split over ranks, attention whole.

Same reference as the other equivalence tests: a world of one on the whole global batch. Ring attention
(load-balanced chunks) at cp=2 and cp=4, all-to-all at cp=2, cp with pp, cp with dp (then resumed
without cp), LLaMA (rotary positions, grouped-query attention), GPT-2 on padded batches: losses,
gradient norms, eval loss and parameters equal at fp32 tolerance.
"""

from __future__ import annotations

import pytest

from helpers import max_relative_difference, train_builtin

STEPS = 4
GLOBAL_BATCH = 4
MODELS = {"gpt-tiny": {"n_layer": 2}, "hf:llama": {"num_hidden_layers": 2},
          # a causal sliding window of 4 tokens on its second layer, the first full: the window bites at 32 tokens
          "hf:qwen2": {"num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 4,
                       "max_window_layers": 1}}
_references: dict = {}


def reference(rank_pool, tmp_path_factory, model: str) -> dict:
    if model not in _references:
        out = str(tmp_path_factory.mktemp("reference"))
        _references[model] = rank_pool(1).run(train_builtin, model, out, model_args=MODELS[model], steps=STEPS,
                                               global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH)[0]
    return _references[model]


def assert_matches(expected: dict, results: list[dict]) -> None:
    for rank, got in enumerate(results):
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, expected["losses"], got["losses"])
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4, rank
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5, rank
        for name, value in got["params"].items():
            assert (value - expected["params"][name]).abs().max() < 1e-5, (rank, name)
    assert expected["losses"][-1] < expected["losses"][0]


# (model, world, strategy, micro-batch size)
LAYOUTS = [
    ("gpt-tiny", 2, {"cp": 2, "cp_mode": "all-to-all"}, 2),
    ("gpt-tiny", 4, {"cp": 4}, 4),
    ("gpt-tiny", 4, {"cp": 4, "cp_mode": "all-to-all"}, 4),
    ("gpt-tiny", 4, {"cp": 2, "pp": 2, "schedule": "1f1b"}, 2),
    ("gpt-tiny", 4, {"cp": 2, "tp": 2, "cp_mode": "all-to-all"}, 4),
    ("hf:llama", 2, {"cp": 2}, 4),
    ("hf:llama", 4, {"cp": 2, "tp": 2, "sp": True}, 4),
    ("hf:qwen2", 2, {"cp": 2}, 4),
    ("hf:qwen2", 2, {"cp": 2, "cp_mode": "all-to-all"}, 4),
]


def _name(layout: tuple) -> str:
    model, _, strategy, _ = layout
    return model.replace(":", "-") + "-" + "-".join(f"{k}{v}" for k, v in strategy.items())


@pytest.mark.parametrize("model,world,strategy,micro", LAYOUTS, ids=[_name(layout) for layout in LAYOUTS])
def test_context_parallel_matches_single_process(rank_pool, tmp_path, tmp_path_factory, model, world, strategy,
                                                 micro):
    expected = reference(rank_pool, tmp_path_factory, model)
    results = rank_pool(world).run(train_builtin, model, str(tmp_path), model_args=MODELS[model], steps=STEPS,
                                   strategy=strategy, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro)
    assert_matches(expected, results)


@pytest.mark.parametrize("mode", ["ring", "all-to-all"])
def test_padded_batches_match_single_process(rank_pool, tmp_path, tmp_path_factory, mode):
    """GPT-2 (learned positions) on left-padded batches with attention_mask: the padding follows the shard."""
    from test_batch_fields import DROPPED, reference as padded_reference, train as train_padded
    expected = padded_reference(rank_pool, tmp_path_factory, "gpt2")
    without = padded_reference(rank_pool, tmp_path_factory, "gpt2", DROPPED["gpt2"])
    assert max_relative_difference(expected["losses"], without["losses"]) > 1e-4  # the mask matters here
    for rank, got in enumerate(rank_pool(2).run(train_padded, "gpt2", str(tmp_path),
                                                    strategy={"cp": 2, "cp_mode": mode})):
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, expected, got)
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5, (rank, expected, got)


def _traced(model, seq: int, **kwargs):
    import torch
    from autopar.trace import trace
    return trace(model, (torch.zeros(2, seq, dtype=torch.long),), kwargs, device="cpu")


class _MaskedAttention:
    """A tiny one-head attention model whose mask is made from positions by `allowed(query, key)`."""

    @staticmethod
    def build(allowed):
        import torch
        from torch import nn
        import torch.nn.functional as F

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(16, 8)

            def forward(self, ids):
                x = self.emb(ids)[:, None]  # one head
                pos = torch.arange(ids.shape[1])
                return F.scaled_dot_product_attention(x, x, x, attn_mask=allowed(pos[:, None], pos[None, :]))
        return Model()


def test_attention_that_cannot_follow_the_shard_is_refused_with_its_node():
    import torch
    from autopar.context_parallel.rewrite import check_rewritable, mask_kinds
    from autopar.errors import ModelError
    from autopar.models.registry import build_model
    model, _ = build_model("gpt-tiny", {"n_layer": 1}, vocab_size=64, device="cpu")
    with pytest.raises(ModelError, match=r"scaled_dot_product_attention.* 4 heads, not divisible by --cp 8"):
        check_rewritable(_traced(model, 16), 8, "all-to-all")
    with pytest.raises(ModelError, match=r"4 heads \(2 per tp rank at tp=2\), not divisible by --cp 4"):
        check_rewritable(_traced(model, 16), 4, "all-to-all", tp=2)
    probe = {"__main__": torch.zeros(2, 8, dtype=torch.long)}
    documents = _traced(_MaskedAttention.build(lambda q, k: (q >= k) & (q // 4 == k // 4)), 8)  # two documents
    with pytest.raises(ModelError, match=r"attention node scaled_dot_product_attention .*document mask"):
        mask_kinds(documents, probe)
    window = _traced(_MaskedAttention.build(lambda q, k: (q >= k) & (q - k < 2)), 8)  # causal sliding window
    assert [k.describe() for k in mask_kinds(window, probe)] == ["causal window 2"]
    assert [k.describe() for k in mask_kinds(_traced(model, 8), {"__main__": torch.zeros(2, 8, dtype=torch.long)})] \
        == ["causal"]


def test_probe_is_long_enough_to_show_a_declared_window():
    """A window the config declares (here 8 tokens, which an 8-token probe cannot tell from causal) is read
    on a probe long enough to show it."""
    from types import SimpleNamespace
    import torch
    from autopar.context_parallel import ContextParallel, declared_window
    model = _MaskedAttention.build(lambda q, k: (q >= k) & (q - k < 8))
    model.config = SimpleNamespace(sliding_window=8)  # as a Hugging Face config declares it
    context = ContextParallel(cp=2, rank=0, mode="ring", group=None)
    context.probe(lambda batch: _traced(model, batch["input_ids"].shape[1]),
                  {"input_ids": torch.zeros(2, 32, dtype=torch.long)}, torch.device("cpu"), declared_window(model))
    assert [k.describe() for k in context.kinds] == ["causal window 8"]


def test_rewritten_attention_is_split_by_heads_under_tp():
    """cp x tp: the ring attention standing in for torch's is split by heads like it, so every linear of the
    attention block is split (not kept whole around an operation the planner does not know)."""
    from autopar.context_parallel.rewrite import MaskKind, attention_nodes, rewrite_graph
    from autopar.models.registry import build_model
    from autopar.tensor_parallel import plan_tensor_parallel
    built, _ = build_model("gpt-tiny", {"n_layer": 1}, vocab_size=64, device="cpu")
    graph = _traced(built, 8)
    rewrite_graph(graph, [MaskKind(True, False)] * len(attention_nodes(graph.graph)), mode="ring", group=None,
                  rank=0, cp=2)
    plan = plan_tensor_parallel(graph, 2, sequence=True)
    assert not [d for d in plan.decisions if d.role == "replicated"], plan.summary()
    assert sum(d.role in ("column", "row", "vocab-head") for d in plan.decisions) == plan.linears, plan.summary()


@pytest.mark.parametrize("fields, rule", [({"tp": 2, "tp_subbatches": 2}, "cp-tp"), ({"zero": 3}, "cp-engine"),
                                          ({"plan": "plan.json"}, "cp-plan")])
def test_combinations_refused_before_ranks_start(fields, rule):
    import autopar
    from autopar.errors import ConfigError
    from autopar.strategies import resolve
    config = autopar.TrainConfig(global_batch_size=8, micro_batch_size=2)
    with pytest.raises(ConfigError, match=rf"rule {rule}\b"):
        resolve(autopar.Strategy(cp=2, **fields), config, 4 if "tp" not in fields else 4)


def test_sequence_length_must_split_over_cp_and_then_sp():
    """36 tokens cut into 2 x cp = 4 chunks, but with --sp at tp=4 each rank's 18 do not split over 4: refused."""
    from autopar.context_parallel.layout import check_divisible
    from autopar.errors import ConfigError
    check_divisible(36, 2)
    with pytest.raises(ConfigError, match=r"again over --sp's tp=4, but the sequence length is 36; use a length "
                                          r"divisible by 8 \(e.g. 32\)"):
        check_divisible(36, 2, 4)


def _cp_then_resume_without(out: str) -> dict:
    """Two steps at cp=2 x dp=2 with a checkpoint, then resumed to the end as four data-parallel replicas."""
    common = dict(model_args=MODELS["gpt-tiny"], global_batch_size=GLOBAL_BATCH, micro_batch_size=1)
    first = train_builtin("gpt-tiny", f"{out}/cp", steps=2, strategy={"cp": 2}, checkpoint_every=2, **common)
    return {"first": first, "resumed": train_builtin("gpt-tiny", f"{out}/dp", steps=STEPS, resume=f"{out}/cp",
                                                     **common)}


def test_cp_with_dp_and_resume_under_another_cp(rank_pool, tmp_path, tmp_path_factory):
    """Checkpoints hold whole parameters: a cp=2 x dp=2 run resumes as dp=4 and ends where one process does."""
    expected = reference(rank_pool, tmp_path_factory, "gpt-tiny")
    for rank, got in enumerate(rank_pool(4).run(_cp_then_resume_without, str(tmp_path))):
        first, resumed = got["first"], got["resumed"]
        assert max_relative_difference(expected["losses"][:2], first["losses"]) < 1e-5, (rank, expected, first)
        assert max_relative_difference(expected["grad_norms"][:2], first["grad_norms"]) < 1e-4, rank
        assert resumed["first_step"] == 3, rank  # resumed after step 2
        assert max_relative_difference(expected["losses"][2:], resumed["losses"][-2:]) < 1e-5, (rank, expected, got)
        for name, value in resumed["params"].items():
            assert (value - expected["params"][name]).abs().max() < 1e-5, (rank, name)


def test_a_loss_of_ones_own_is_refused(tmp_path, monkeypatch):
    """A Trainer loss_fn averages whole samples; under cp each rank holds part of each: refused (rule cp-loss)
    before any process group exists (rank 0 of 2, as a launcher would set it)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    import autopar
    from autopar.errors import ConfigError
    from autopar.models.registry import build_model
    from helpers import small_data
    model, info = build_model("gpt-tiny", MODELS["gpt-tiny"], vocab_size=320, device="meta")
    config = autopar.TrainConfig(steps=1, global_batch_size=4, micro_batch_size=2, out=str(tmp_path), progress=False)
    trainer = autopar.Trainer(model, small_data(info.task, 32)[0], strategy=autopar.Strategy(cp=2), config=config,
                              loss_fn=lambda output, batch: output.float().mean())
    with pytest.raises(ConfigError, match=r"--cp 2 with a loss_fn of one's own.*\(rule cp-loss\)"):
        trainer.train()
