"""Hugging Face models and batches with labels as Hugging Face's collators make them (tests/test_hf_labels.py).

Causal LMs get labels equal to the input ids (-100 on pads), which their own loss shifts; the masked LM
gets labels at the masked positions; T5 gets decoder targets aligned with its decoder inputs. Every
model is built for real from a fixed seed with dropout off, so `model(**batch).loss` is a fixed number
to compare with. Module level (no test code) so the rank pool's spawned workers can import it.
"""

from __future__ import annotations

import copy

import torch

import autopar

IGNORE = -100
SEQ = 12
VOCAB = 128
SAMPLES = 16  # 2 steps of 8
GLOBAL_BATCH = 8

_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {  # family: (head, config, padding)
    # pad_token_id: an embedding padding_idx, whose row no lookup may move (left padding scores the pad
    # position before the first real token, as Hugging Face's loss does)
    "llama": ("causal", dict(_DECODER, pad_token_id=0), "left"),
    "gpt2": ("causal", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "right"),
    "bert": ("mlm", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
             "right"),
    "t5": ("seq2seq", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                           relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0),
           "right"),
}


def build(family: str) -> torch.nn.Module:
    """The model built for real from seed 0 (dropout off: a fixed loss to compare)."""
    import transformers
    from autopar.models.hf import quiet_transformers

    head, widths, _ = FAMILIES[family]
    auto = {"causal": transformers.AutoModelForCausalLM, "mlm": transformers.AutoModelForMaskedLM,
            "seq2seq": transformers.AutoModelForSeq2SeqLM}[head]
    with quiet_transformers(transformers):
        config = transformers.AutoConfig.for_model(family, vocab_size=VOCAB, use_cache=False, **widths)
        torch.manual_seed(0)
        return auto.from_config(config)


def samples(family: str) -> list[dict]:
    """Padded samples with attention masks, labels in Hugging Face's convention for the family's head."""
    head, _, padding = FAMILIES[family]
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(SAMPLES):
        length = int(torch.randint(SEQ - 5, SEQ + 1, (), generator=g))
        real = torch.arange(SEQ) >= SEQ - length if padding == "left" else torch.arange(SEQ) < length
        tokens = torch.where(real, torch.randint(5, VOCAB, (SEQ,), generator=g), torch.zeros(SEQ, dtype=torch.long))
        sample = {"input_ids": tokens, "attention_mask": real.long()}
        if head == "causal":  # DataCollatorForLanguageModeling(mlm=False): labels = input ids, -100 on pads
            sample["labels"] = torch.where(real, tokens, torch.full_like(tokens, IGNORE))
        elif head == "mlm":
            chosen = (torch.rand(SEQ, generator=g) < 0.3) & real
            chosen[0] = True
            sample["input_ids"] = torch.where(chosen, torch.full_like(tokens, 4), tokens)
            sample["labels"] = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE))
        else:  # decoder inputs: the start id, then the targets (T5's shift right); labels: the targets
            target_len = int(torch.randint(3, SEQ // 2 + 1, (), generator=g))
            target_real = torch.arange(SEQ // 2) < target_len
            target = torch.where(target_real, torch.randint(5, VOCAB, (SEQ // 2,), generator=g),
                                 torch.zeros(SEQ // 2, dtype=torch.long))
            sample["decoder_input_ids"] = torch.cat([torch.zeros(1, dtype=torch.long), target[:-1]])
            sample["decoder_attention_mask"] = torch.cat([torch.ones(1, dtype=torch.long), target_real[:-1].long()])
            sample["labels"] = torch.where(target_real, target, torch.full_like(target, IGNORE))
        out.append(sample)
    return out


def model_loss(family: str) -> float:
    """The model's own loss on the first global batch: `model(**batch).loss`, Hugging Face's convention."""
    from autopar.data.sampler import GlobalBatchSampler

    model, data = build(family), samples(family)
    first = GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=0).global_batch(0)  # the Trainer's (seed 0)
    batch = torch.utils.data.default_collate([data[i] for i in first])
    with torch.no_grad():
        return float(model(**batch).loss)


def train(family: str, out: str, *, strategy: dict | None = None, micro_batch_size: int = 4,
          steps: int = 2) -> list[float]:
    """autopar's per-step losses (runs on every rank of a pool)."""
    config = autopar.TrainConfig(steps=steps, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch_size,
                                 lr=1e-3, warmup_steps=0, out=out, progress=False, timeout_s=60)
    trainer = autopar.Trainer(build(family), samples(family), strategy=autopar.Strategy(**(strategy or {})),
                              config=config)
    losses = trainer.train().losses
    trainer.close()
    return losses


def train_many(families: list[str], out: str, **kwargs) -> dict[str, list[float]]:
    return {f: train(f, f"{out}/{f}", **kwargs) for f in families}


def first_losses(families: list[str], out: str) -> dict[str, tuple[float, float]]:
    """(autopar's first-step loss, the model's own loss) per family, one process, two micro-batches of 4."""
    return {f: (train(f, f"{out}/{f}", steps=1)[0], model_loss(f)) for f in families}


def builtin_job_losses(out: str) -> dict:
    """`autopar train --model hf:llama` on the built-in windows (labels: the next tokens already), one process:
    its first loss, and the loss of the same initial weights on the same global batch scored position by
    position with no shift (what autopar computed for this job before Hugging Face labels were followed)."""
    import torch.nn.functional as F

    from autopar.config import DataConfig, JobConfig, ModelConfig
    from autopar.data.sampler import GlobalBatchSampler
    from autopar.job import build_job, make_trainer
    from autopar.models.materialize import materialize

    job = JobConfig(model=ModelConfig(name="hf:llama", args=dict(hidden_size=32, intermediate_size=64,
                                                                num_hidden_layers=2, num_attention_heads=4,
                                                                num_key_value_heads=2)),
                    data=DataConfig(seq_len=16),
                    train=autopar.TrainConfig(steps=1, global_batch_size=4, micro_batch_size=2, warmup_steps=0,
                                              out=out, progress=False, eval_batches=1, timeout_s=60))
    parts = build_job(job)
    model = materialize(copy.deepcopy(parts.model), seed=job.train.seed)
    indices = GlobalBatchSampler(len(parts.train_data), 4, seed=job.train.seed).global_batch(0)
    batch = torch.utils.data.default_collate([parts.train_data[i] for i in indices])
    with torch.no_grad():
        unshifted = F.cross_entropy(model(batch["input_ids"]).logits.flatten(0, -2), batch["labels"].flatten())
    trainer = make_trainer(job)
    result = trainer.train()
    shifted = trainer.shift_labels
    trainer.close()
    window = parts.train_data[0]
    return {"loss": result.losses[0], "unshifted": float(unshifted), "shift": shifted,
            "pre_shifted": bool(torch.equal(window["input_ids"][1:], window["labels"][:-1]))}
