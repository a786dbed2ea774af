"""Every batch field reaches the model under pp and tp, exactly as in one process.

Padded batches with attention masks (a left-padded causal LM, a masked LM with token type
ids) and an encoder-decoder (T5, whose decoder stages need `decoder_input_ids` and the
encoder's output) train at pp=2 and tp=2 to the losses of one process on the same batches
(1e-5 relative). Each case also checks that the test can tell: one process trained on the
same batches *without* the mask (or the token types) ends at different losses, so a layout
that dropped the field would fail. The Hugging Face models keep their default `use_cache`
(on), which training must turn off by itself.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from helpers import max_relative_difference

VOCAB, SEQ, SAMPLES = 64, 12, 16
STEPS = 3


def _config(family: str):
    from transformers import AutoConfig
    tiny = {
        "gpt2": dict(n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
        "bert": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     type_vocab_size=2),
        "t5": dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0),
    }[family]
    config = AutoConfig.for_model(family, vocab_size=VOCAB, **tiny)
    config._attn_implementation = "sdpa"
    return config


def build(family: str) -> torch.nn.Module:
    """A tiny Hugging Face model from its default config (use_cache left as it comes), on meta."""
    import transformers
    classes = {"gpt2": transformers.AutoModelForCausalLM, "bert": transformers.AutoModelForMaskedLM,
               "t5": transformers.AutoModelForSeq2SeqLM}
    with torch.device("meta"):
        return classes[family].from_config(_config(family))


def samples(family: str) -> list[dict]:
    """Padded samples of one length (the trace is static); pad lengths vary from sample to sample."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(SAMPLES):
        pad = int(torch.randint(1, SEQ // 2, (), generator=g))
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        mask = torch.ones(SEQ, dtype=torch.long)
        if family == "gpt2":  # left padding, loss on the real tokens only
            mask[:pad] = 0
            ids[:pad] = 0
            labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        elif family == "bert":  # right padding, 30% of the real tokens masked out and predicted
            mask[SEQ - pad:] = 0
            ids[SEQ - pad:] = 0
            chosen = (torch.rand(SEQ, generator=g) < 0.3) & mask.bool()
            chosen[0] = True
            labels = torch.where(chosen, ids, torch.full_like(ids, -100))
            types = torch.zeros(SEQ, dtype=torch.long)
            types[SEQ // 2:] = 1
            out.append({"input_ids": torch.where(chosen, torch.full_like(ids, 3), ids), "attention_mask": mask,
                        "token_type_ids": types, "labels": labels})
        else:  # t5: padded source, shifted target (8 tokens) with its own padding
            mask[SEQ - pad:] = 0
            ids[SEQ - pad:] = 0
            target = torch.randint(1, VOCAB, (8,), generator=g)
            target_mask = torch.ones(8, dtype=torch.long)
            target_mask[8 - pad // 2 - 1:] = 0
            target = torch.where(target_mask.bool(), target, torch.zeros_like(target))
            out.append({"input_ids": ids, "attention_mask": mask,
                        "decoder_input_ids": torch.cat([torch.zeros(1, dtype=torch.long), target[:-1]]),
                        "decoder_attention_mask": torch.cat([torch.ones(1, dtype=torch.long), target_mask[:-1]]),
                        "labels": torch.where(target_mask.bool(), target, torch.full_like(target, -100))})
    return out


def train(family: str, out: str, *, strategy: dict | None = None, drop: tuple[str, ...] = (),
          micro_batch_size: int = 2) -> dict:
    data = [{k: v for k, v in s.items() if k not in drop} for s in samples(family)]
    config = autopar.TrainConfig(steps=STEPS, global_batch_size=4, micro_batch_size=micro_batch_size, lr=1e-3,
                                 warmup_steps=1, eval_batches=1, out=out, progress=False, timeout_s=60)
    trainer = autopar.Trainer(build(family), data, strategy=autopar.Strategy(**(strategy or {})), config=config,
                              eval_data=data[:4])
    result = trainer.train()
    return {"losses": result.losses, "eval_loss": result.eval_loss}


DROPPED = {"gpt2": ("attention_mask",), "bert": ("attention_mask", "token_type_ids"), "t5": ("attention_mask",)}
_references: dict = {}


def reference(rank_pool, tmp_path_factory, family: str, drop: tuple[str, ...] = ()) -> dict:
    key = (family, drop)
    if key not in _references:
        out = str(tmp_path_factory.mktemp("reference"))
        _references[key] = rank_pool(1).run(train, family, out, drop=drop)[0]
    return _references[key]


@pytest.mark.parametrize("family", ["gpt2", "bert", "t5"])
@pytest.mark.parametrize("strategy", [{"pp": 2}, {"tp": 2}], ids=["pp2", "tp2"])
def test_every_field_reaches_the_model(rank_pool, tmp_path, tmp_path_factory, family, strategy):
    expected = reference(rank_pool, tmp_path_factory, family)
    without = reference(rank_pool, tmp_path_factory, family, DROPPED[family])
    # the test can tell: dropping the field changes the losses by far more than the tolerance (1e-5); gpt2's
    # left-padding mask moves its next-token loss by about 4e-4 at this random init
    assert max_relative_difference(expected["losses"], without["losses"]) > 1e-4, (expected, without)
    results = rank_pool(2).run(train, family, str(tmp_path), strategy=strategy)
    for rank, got in enumerate(results):
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, expected, got)
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5, (rank, expected, got)


@pytest.mark.parametrize("strategy", [{"pp": 2, "recompute": "all"}, {"tp": 2, "tp_subbatches": 2},
                                      {"pp": 2, "memory_budget_mb": 64}], ids=["recompute", "tp-subbatches", "budget"])
def test_masks_reach_recomputed_and_sub_batched_stages(rank_pool, tmp_path, tmp_path_factory, strategy):
    """Recomputation re-runs stages on their kept inputs; tp sub-batches split the mask with the ids."""
    expected = reference(rank_pool, tmp_path_factory, "gpt2")
    for rank, got in enumerate(rank_pool(2).run(train, "gpt2", str(tmp_path), strategy=strategy)):
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, expected, got)


def _with_extra_field(out: str, value) -> str:
    data = [{**s, "note": value} for s in samples("gpt2")]
    config = autopar.TrainConfig(steps=1, global_batch_size=4, micro_batch_size=2, out=out, progress=False,
                                 timeout_s=60)
    try:
        autopar.Trainer(build("gpt2"), data, strategy=autopar.Strategy(pp=2), config=config).train()
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_field_that_cannot_be_passed_is_a_clear_error(rank_pool, tmp_path):
    for message in rank_pool(2).run(_with_extra_field, str(tmp_path), "a string"):
        assert "batch field 'note'" in message and "not a tensor" in message, message


def _eval_of_another_length(out: str) -> str:
    data = samples("gpt2")
    shorter = [{k: v[2:] for k, v in s.items()} for s in data[:4]]
    config = autopar.TrainConfig(steps=1, global_batch_size=4, micro_batch_size=2, eval_batches=1, out=out,
                                 progress=False, timeout_s=60)
    try:
        autopar.Trainer(build("gpt2"), data, strategy=autopar.Strategy(pp=2), config=config, eval_data=shorter).train()
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_field_shape_unlike_the_trace_is_a_clear_error_on_every_rank(rank_pool, tmp_path):
    """Eval batches padded to another length than the traced ones: named, on both pp ranks (no hang)."""
    for message in rank_pool(2).run(_eval_of_another_length, str(tmp_path)):
        assert "has shape [2, 10]" in message and "[2, 12]" in message, message


FAMILIES = {  # tiny widths, everything else as the default config has it (use_cache on); dropout off
    "phi3": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, pad_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "qwen3": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=64),
    "gemma": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=64),
    "olmo2": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64),
    "bloom": dict(n_layer=2, hidden_size=32, n_head=4, hidden_dropout=0.0, attention_dropout=0.0),
    "gpt_bigcode": dict(n_layer=2, n_embd=32, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_configs_trace_and_split_into_stages(family):
    """Their default use_cache=True fails tracing (a DynamicCache output); the engine turns it off, and
    two stages (buffers such as rotary inv_freq where they are read) give the whole model's logits."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from autopar.models.hf import turn_off_kv_cache
    from autopar.models.materialize import materialize
    from autopar.partition import partition
    from autopar.trace import trace
    from autopar.train.fields import traced_call

    config = AutoConfig.for_model(family, vocab_size=VOCAB, **FAMILIES[family])
    assert config.use_cache is True  # as it comes
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    batch = {k: torch.stack([s[k] for s in samples("gpt2")[:2]]) for k in ("input_ids", "attention_mask")}
    assert turn_off_kv_cache(model)
    graph = trace(model, *traced_call(batch))
    whole = materialize(copy.deepcopy(model), "cpu", seed=0)
    expected = whole(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    cut = partition(graph, 2, method="uniform")
    first, last = (cut.materialize_stage(s, model, "cpu", seed=0) for s in range(2))
    with torch.no_grad():
        got = last(*first(batch["input_ids"], batch["attention_mask"])).logits
    # bitwise: both sides run the same aten ops on the same shapes in the same order
    assert torch.equal(got, expected.detach()), float((got - expected).abs().max())


class _ScaledLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):  # a tensor made in forward: a lifted constant, whose value a meta trace does not know
        return x + torch.tanh(self.linear(x)) * torch.tensor([0.5, -1.0] * 4, device=x.device)


class _WithConstants(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(_ScaledLayer() for _ in range(3))
        self.head = torch.nn.Linear(8, 16)

    def forward(self, ids, scale):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h * scale.unsqueeze(-1))


def test_lifted_constants_and_float_fields_reach_every_stage():
    import copy

    from autopar.models.materialize import materialize
    from autopar.partition import partition
    from autopar.trace import trace

    with torch.device("meta"):
        model = _WithConstants()
    ids, scale = torch.randint(0, 16, (2, 5)), torch.rand(2, 5)
    graph = trace(model, (ids.to("meta"),), {"scale": scale.to("meta")})
    cut = partition(graph, 3, method="uniform")
    stages = [cut.materialize_stage(s, model, "cpu", seed=0) for s in range(3)]
    assert all(s.spec.buffers for s in stages)  # each stage holds its own layer's constant
    assert "scale" in stages[2].spec.inputs  # a float field read by the head only is carried to it
    values = (ids, scale)
    for stage in stages:
        values = stage(*values)
    expected = materialize(copy.deepcopy(model), "cpu", seed=0)(ids, scale)
    assert torch.equal(values, expected), float((values - expected).abs().max())  # same ops, same order
