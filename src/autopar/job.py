"""The built-in job: a named model on the embedded corpus, trained with the Trainer API.

`autopar train` is this plus flag parsing; it uses nothing the Python API does not offer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn
from torch.utils.data import Dataset

from .config import JobConfig
from .data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
from .errors import ConfigError
from .models import build_model
from .trainer import Trainer, TrainResult


@dataclass
class JobParts:
    """What a job trains: the model (on meta), its data, and what the run folder records about them."""

    job: JobConfig  # with the model's resolved arguments
    model: nn.Module
    name: str
    train_data: Dataset
    eval_data: Dataset
    run_info: dict


def build_job(job: JobConfig) -> JobParts:
    corpus = load_corpus(job.data.corpus)
    tokenizer = build_tokenizer(job.data.tokenizer, corpus=corpus, vocab_size=job.data.vocab_size)
    model, info = build_model(job.model.name, job.model.args, vocab_size=padded_vocab_size(tokenizer.vocab_size),
                              device="meta")
    if info.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model vocab_size={info.vocab_size} is smaller than the {tokenizer.name} tokenizer's "
                          f"{tokenizer.vocab_size} tokens; use vocab_size >= {tokenizer.vocab_size}")
    if job.data.seq_len > info.max_seq_len:
        raise ConfigError(f"seq_len={job.data.seq_len} is longer than {info.name}'s context of {info.max_seq_len} "
                          f"positions; use --seq-len <= {info.max_seq_len} or a larger max_seq_len model argument")
    train_data, eval_data = build_datasets(corpus, tokenizer, seq_len=job.data.seq_len, task=info.task,
                                           seed=job.train.seed)
    resolved = dataclasses.replace(job, model=dataclasses.replace(job.model, args=info.args))
    run_info = {"model": f"{info.name} ({info.task}, {info.num_params:,} parameters)",
                "corpus": corpus.describe(), "corpus_fingerprint": corpus.fingerprint,
                "train_samples": len(train_data), "eval_samples": len(eval_data)}
    return JobParts(job=resolved, model=model, name=info.name, train_data=train_data, eval_data=eval_data,
                    run_info=run_info)


def run_job(job: JobConfig) -> TrainResult:
    parts = build_job(job)
    trainer = Trainer(parts.model, parts.train_data, strategy=job.strategy, config=job.train,
                      eval_data=parts.eval_data, job_config=parts.job, run_info=parts.run_info)
    return trainer.train()
