"""Layout-free dropout (autopar/dropout): masks independent of the layout, and every layout equal to one process.

Unit tests pin the mask's properties; the equivalence tests train gpt-tiny with dropout
0.1 on dp=2, pp=2 (with recomputation), tp=2 (and tp sub-batches) against one process on
the whole global batch, like the other equivalence tests (losses 1e-5 relative).
"""

from __future__ import annotations

import pytest
import torch

from autopar.dropout import dropout_step, eager_micro_batch, micro_batch
from autopar.dropout.mask import element_ids, element_keys, keep_mask, sample_keys, shard_positions
from autopar.dropout.ops import TPShard, dropout_noise
from autopar.errors import ModelError
from helpers import max_relative_difference, train_builtin

STEPS = 3
GLOBAL_BATCH = 8
MODEL_ARGS = {"n_layer": 2, "dropout": 0.1}


# ---------------------------------------------------------------------------- the mask


def _mask(seed=1, step=0, op=0, samples=(0, 1, 2, 3), shape=(6, 8), p=0.1, shard=None) -> torch.Tensor:
    with dropout_step(seed, step, [list(samples)]), micro_batch(0):
        from autopar.dropout import active_scope
        return dropout_noise((len(samples), *shape), p, op, active_scope(), dtype=torch.float32,
                             device=torch.device("cpu"), shard=shard) != 0


def test_same_inputs_give_the_same_mask():
    assert torch.equal(_mask(), _mask())  # exact: a mask is integer hashing, no float arithmetic


@pytest.mark.parametrize("change", [{"seed": 2}, {"step": 1}, {"op": 1}, {"samples": (4, 5, 6, 7)}])
def test_another_seed_step_op_or_sample_gives_another_mask(change):
    base, other = _mask(), _mask(**change)
    assert not torch.equal(base, other)
    # unrelated masks: they agree about as often as two independent draws (0.9^2 + 0.1^2 = 0.82)
    assert abs(float((base == other).float().mean()) - 0.82) < 0.05


def test_a_sample_keeps_its_mask_in_any_micro_batch():
    whole = _mask(samples=(10, 11, 12, 13))
    alone = _mask(samples=(12,))
    assert torch.equal(whole[2], alone[0])  # exact: integer hashing of the same (sample, element)


@pytest.mark.parametrize("dim,segments", [(1, (6,)), (2, (8,)), (2, (4, 4)), (1, (2, 4))])
def test_a_tp_shard_draws_its_slice_of_the_whole_mask(dim, segments):
    shape = (6, 8)
    whole = _mask(shape=shape)
    full_dim = shape[dim - 1]
    for rank in range(2):
        local_shape = list(shape)
        local_shape[dim - 1] = full_dim // 2
        with dropout_step(1, 0, [[0, 1, 2, 3]]), micro_batch(0):
            from autopar.dropout import active_scope
            local = dropout_noise((4, *local_shape), 0.1, 0, active_scope(), dtype=torch.float32,
                                  device=torch.device("cpu"), shard=TPShard(dim, segments, rank, 2)) != 0
        index = shard_positions(full_dim, segments, rank, 2)
        assert torch.equal(local, whole.index_select(dim, index))  # exact: the same hashes, sliced


def test_keep_rate_is_one_minus_p():
    # 4 x 65536 Bernoulli(0.9) draws: standard error 0.0006, so 0.003 is five of them
    elements = element_keys(element_ids((256, 256), [None, None], torch.device("cpu")))
    for p in (0.1, 0.5):
        keep = keep_mask(sample_keys(3, 5, 2, torch.arange(4)), elements, p)
        assert abs(float(keep.float().mean()) - (1 - p)) < 0.003, p


def test_flattened_batch_rows_are_read_as_samples():
    """[B * T, F] is [B, T, F]: sample 1's mask is the same whether its rows come first or second."""
    with dropout_step(0, 0, [[5, 6]]), micro_batch(0):
        from autopar.dropout import active_scope
        two = dropout_noise((2 * 3, 4), 0.5, 0, active_scope(), dtype=torch.float32, device=torch.device("cpu"))
    with dropout_step(0, 0, [[6]]), micro_batch(0):
        one = dropout_noise((3, 4), 0.5, 0, active_scope(), dtype=torch.float32, device=torch.device("cpu"))
    assert torch.equal(two[3:], one)  # exact: the same hashes scaled by the same 1/(1-p)
    with dropout_step(0, 0, [[5, 6]]), micro_batch(0), pytest.raises(ModelError, match="leading dimension"):
        dropout_noise((3, 4), 0.5, 0, active_scope(), dtype=torch.float32, device=torch.device("cpu"))


# ---------------------------------------------------------------------------- one process


def _gpt(dropout=0.1):
    from autopar.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, dropout=dropout, vocab_size=64))


def test_eager_equals_traced_stages_and_recomputation():
    """The whole model run eagerly and its two traced stages (the second checkpointed) draw the same masks."""
    from autopar.partition import partition
    from autopar.trace import trace
    model, ids = _gpt(), torch.randint(0, 64, (4, 16))
    with dropout_step(7, 3, [[0, 1], [2, 3]]), eager_micro_batch(1):
        eager = model(ids[2:])
        eager.sum().backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.eval()
    assert not torch.allclose(model(ids[2:]), eager)  # dropout really ran
    model.train()
    part = partition(trace(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),)), 2)
    stages = [part.materialize_stage(s, model, torch.device("cpu"), seed=0) for s in range(2)]
    for stage in stages:
        for name, p in stage.named_parameters():
            p.data.copy_(model.get_parameter(name).data)
    stages[1].recompute_blocks = stages[1].num_blocks
    with dropout_step(7, 3, [[0, 1], [2, 3]]):
        with micro_batch(1):
            out = stages[1](*stages[0](ids[2:]))
        out.sum().backward()  # the checkpointed blocks recompute here, outside micro_batch: same masks
    assert torch.allclose(out, eager, atol=1e-6, rtol=1e-5)
    for stage in stages:
        for name, p in stage.named_parameters():
            if name != "lm_head.weight" and name != "tok_emb.weight":  # tied: the two stages each hold a part
                assert torch.allclose(p.grad, eager_grads[name], atol=1e-6, rtol=1e-5), name


def test_eval_mode_and_no_step_keep_torch_behaviour():
    model, ids = _gpt(), torch.randint(0, 64, (2, 8))
    model.eval()
    with dropout_step(0, 0, [[0, 1]]), eager_micro_batch(0):
        assert torch.equal(model(ids), model(ids))  # bitwise: the same ops on the same input, twice


# ---------------------------------------------------------------------------- every layout


_references: dict = {}
MODELS = {"gpt-tiny": MODEL_ARGS,  # dropout on embeddings, residual branches and (SDPA) attention weights
          "hf:gpt2": {"n_layer": 2, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}}  # fused qkv


def reference(rank_pool, tmp_path_factory, model: str, model_args: dict) -> dict:
    key = (model, tuple(sorted(model_args.items())))
    if key not in _references:
        out = str(tmp_path_factory.mktemp("reference"))
        _references[key] = rank_pool(1).run(train_builtin, model, out, model_args=model_args, steps=STEPS,
                                             global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH)[0]
    return _references[key]


def test_the_reference_really_drops(rank_pool, tmp_path_factory):
    """Without this the equivalence tests below could pass with dropout silently off."""
    on = reference(rank_pool, tmp_path_factory, "gpt-tiny", MODEL_ARGS)
    off = reference(rank_pool, tmp_path_factory, "gpt-tiny", {**MODEL_ARGS, "dropout": 0.0})
    assert max_relative_difference(on["losses"][1:], off["losses"][1:]) > 1e-3


# (model, world, strategy, micro-batch size)
LAYOUTS = [
    ("gpt-tiny", 2, {"dp": 2}, 2),
    ("gpt-tiny", 2, {"pp": 2, "schedule": "1f1b", "recompute": "all"}, 2),
    ("gpt-tiny", 2, {"pp": 2, "schedule": "1f1b", "memory_budget_mb": 3.0}, 2),  # block checkpointing in stages
    ("gpt-tiny", 2, {"tp": 2}, 4),
    ("gpt-tiny", 2, {"tp": 2, "tp_subbatches": 2}, 4),
    ("hf:gpt2", 2, {"tp": 2}, 4),
]


@pytest.mark.parametrize("model,world,strategy,micro", LAYOUTS, ids=lambda v: str(v))
def test_dropout_matches_single_process(rank_pool, tmp_path, tmp_path_factory, model, world, strategy, micro):
    expected = reference(rank_pool, tmp_path_factory, model, MODELS[model])
    results = rank_pool(world).run(train_builtin, model, str(tmp_path), model_args=MODELS[model], steps=STEPS,
                                   strategy=strategy, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro)
    for rank, got in enumerate(results):
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, expected["losses"],
                                                                                  got["losses"])
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5, rank
        for name, value in got["params"].items():
            if name in expected["params"]:
                assert (value - expected["params"][name]).abs().max() < 1e-5, (rank, name)
    if strategy.get("tp", 1) > 1:
        # replicated parameters (norms, row biases) on the two tp ranks: the same ops on the same values
        # (all-reduced gradients are identical on every rank), so bit-identical
        for name, value in results[0]["params"].items():
            assert torch.equal(value, results[1]["params"][name]), name


@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_in_layers_the_model_checkpoints_itself_is_refused(reentrant):
    """Their recomputation in backward would draw torch's own mask: an error, not a silently different mask."""
    from autopar.errors import ConfigError
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    x = torch.ones(2, 4, requires_grad=True)
    with dropout_step(0, 0, [[0, 1]]), eager_micro_batch(0), pytest.raises(ConfigError, match="checkpoint"):
        torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=reentrant)
