"""The built-in job: a named model on the embedded corpus or local data files, trained with the Trainer API.

`autopar train` is this plus flag parsing; it uses nothing the Python API does not offer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from torch import nn
from torch.utils.data import Dataset

from .config import JobConfig
from .data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
from .data.files import DataFiles, build_file_datasets, training_text
from .errors import ConfigError
from .models import build_model
from .models.hf import hf_config_json, is_folder_name
from .models.hf_side_files import source_side_files
from .models.pretrained import PretrainedWeights
from .preflight import check_model_fits
from .search.auto import Plan
from .trainer import Trainer, TrainResult

TOKENIZER_FILE = "tokenizer.json"


def data_files(job: JobConfig) -> DataFiles | None:
    d = job.data
    if d.data is None:
        return None
    return DataFiles(path=d.data, text_field=d.text_field, prompt_field=d.prompt_field,
                     response_field=d.response_field, eval_path=d.eval_data, eval_fraction=d.eval_fraction,
                     cache_dir=d.data_cache)


def _saved_tokenizer(resume: str | None) -> Path | None:
    """The tokenizer.json of the run being resumed (a run folder or one of its checkpoints), if it has one."""
    if not resume:
        return None
    for folder in (Path(resume), Path(resume).parent.parent):
        if (folder / TOKENIZER_FILE).is_file():
            return folder / TOKENIZER_FILE
    return None


def build_job_tokenizer(job: JobConfig, corpus, files: DataFiles | None):
    """The run's tokenizer: a trained one is reused from the run being resumed, else learned from the training text."""
    name = job.data.tokenizer
    saved = _saved_tokenizer(job.train.resume) if name == "bpe" else None
    if saved is not None:
        return build_tokenizer(f"hf:{saved}")
    text = training_text(files) if files is not None and name == "bpe" else None
    return build_tokenizer(name, corpus=corpus, vocab_size=job.data.vocab_size, text=text)


@dataclass
class JobParts:
    """What a job trains: the model (on meta), its data, and what the run folder records about them."""

    job: JobConfig  # with the model's resolved arguments
    model: nn.Module
    name: str
    train_data: Dataset
    eval_data: Dataset
    run_info: dict
    pretrained: PretrainedWeights | None = None  # hf:PATH: weights each rank reads its share of
    run_files: dict | None = None  # files the run folder keeps (tokenizer.json, hf/config.json)


def run_job(job: JobConfig, plan: Plan | None = None) -> TrainResult:
    trainer = make_trainer(job, plan)
    result = trainer.train()
    trainer.close()
    return result


def make_trainer(job: JobConfig, plan: Plan | None = None) -> Trainer:
    """The Trainer `autopar train` runs for `job` (tokenizer, model, data, pretrained weights), not yet started.

    `plan`: the plan `--strategy auto` chose for this world (elastic_plan.py), applied over job.strategy.
    """
    parts = build_job(job)
    trainer = Trainer(parts.model, parts.train_data, strategy=job.strategy, config=job.train,
                      eval_data=parts.eval_data, job_config=parts.job, run_info=parts.run_info,
                      pretrained=parts.pretrained, run_files=parts.run_files)
    if plan is not None:  # beside job.strategy, whose other fields stay (a Plan as the strategy would drop them)
        trainer.plan = plan
    return trainer


def build_job(job: JobConfig) -> JobParts:
    files = data_files(job)
    corpus = load_corpus(job.data.corpus) if files is None or job.data.tokenizer == "word" else None
    tokenizer = build_job_tokenizer(job, corpus, files)
    model, info = build_model(job.model.name, job.model.args, vocab_size=padded_vocab_size(tokenizer.vocab_size),
                              device="meta")
    check_model_fits(info, tokenizer, job.data.seq_len)
    pretrained = None
    if job.model.name.startswith("hf:") and is_folder_name(job.model.name):
        pretrained = PretrainedWeights(job.model.name[3:], model)  # headers only: every rank checks, before spawning
    run_files = {}
    model_folder = job.model.name[3:] if job.model.name.startswith("hf:") and is_folder_name(job.model.name) else None
    config_json = hf_config_json(model, model_folder)
    if job.train.export_hf and config_json is None:
        raise ConfigError(f"--export-hf writes the Hugging Face format, but {info.name} is not a Hugging Face model; "
                          f"use --model hf:<model_type> or hf:PATH")
    if config_json is not None:
        run_files["hf/config.json"] = config_json  # `autopar export` rebuilds the model from it
        tokenizer_source = job.data.tokenizer[3:] if job.data.tokenizer.startswith("hf:") else None
        run_files.update(source_side_files(model_folder, tokenizer_source))  # the export writes them too
    if hasattr(tokenizer, "to_json"):
        run_files[TOKENIZER_FILE] = tokenizer.to_json()  # resume and export reuse it
    if files is not None:
        if info.task != "causal-lm":
            raise ConfigError(f"--data trains causal language models; {info.name} is a {info.task} model")
        train_data, eval_data, facts = build_file_datasets(files, tokenizer, seq_len=job.data.seq_len)
        run_info = {"model": f"{info.name} ({info.task}, {info.num_params:,} parameters)",
                    "tokenizer": f"{tokenizer.name} ({tokenizer.vocab_size} tokens)", **facts}
    else:
        train_data, eval_data = build_datasets(corpus, tokenizer, seq_len=job.data.seq_len, task=info.task,
                                               seed=job.train.seed)
        run_info = {"model": f"{info.name} ({info.task}, {info.num_params:,} parameters)",
                    "corpus": corpus.describe(), "corpus_fingerprint": corpus.fingerprint,
                    "train_samples": len(train_data), "eval_samples": len(eval_data)}
    resolved = dataclasses.replace(job, model=dataclasses.replace(job.model, args=info.args))
    return JobParts(job=resolved, model=model, name=info.name, train_data=train_data, eval_data=eval_data,
                    run_info=run_info, pretrained=pretrained, run_files=run_files)
