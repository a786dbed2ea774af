"""The built-in job: a named model on the embedded corpus, trained with the Trainer API.

`autopar train` is this plus flag parsing; it uses nothing the Python API does not offer.
"""

from __future__ import annotations

import dataclasses

from .config import JobConfig
from .data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
from .errors import ConfigError
from .models import build_model
from .models.hf import hf_config_json, is_folder_name
from .models.pretrained import PretrainedWeights
from .trainer import Trainer, TrainResult


def run_job(job: JobConfig) -> TrainResult:
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
    pretrained = None
    if job.model.name.startswith("hf:") and is_folder_name(job.model.name):
        pretrained = PretrainedWeights(job.model.name[3:], model)  # headers only: every rank checks, before spawning
    run_files = {}
    config_json = hf_config_json(model)
    if job.train.export_hf and config_json is None:
        raise ConfigError(f"--export-hf writes the Hugging Face format, but {info.name} is not a Hugging Face model; "
                          f"use --model hf:<model_type> or hf:PATH")
    if config_json is not None:
        run_files["hf/config.json"] = config_json  # `autopar export` rebuilds the model from it
    train_data, eval_data = build_datasets(corpus, tokenizer, seq_len=job.data.seq_len, task=info.task,
                                           seed=job.train.seed)
    resolved = dataclasses.replace(job, model=dataclasses.replace(job.model, args=info.args))
    run_info = {"model": f"{info.name} ({info.task}, {info.num_params:,} parameters)",
                "corpus": corpus.describe(), "corpus_fingerprint": corpus.fingerprint,
                "train_samples": len(train_data), "eval_samples": len(eval_data)}
    trainer = Trainer(model, train_data, strategy=job.strategy, config=job.train, eval_data=eval_data,
                      job_config=resolved, run_info=run_info, pretrained=pretrained, run_files=run_files)
    return trainer.train()
