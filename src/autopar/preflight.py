"""Checks of a `train` job that need more than numbers, run once in the launching process before any rank starts.

`strategies.resolve` checks the strategy (degrees, schedule, batch sizes) from numbers alone. The
checks here need the job's files or its model: the `--resume` folder, the model's name and arguments,
its context length and its vocabulary against the tokenizer. Every rank would find the same errors,
but only after N copies of Python and torch had started (seconds each on a small machine), and the
user would read N copies of the message instead of one line before the launch.

What needs the model traced (tensor-parallel splits, pipeline cuts) stays with the ranks: tracing
depends on the batch the data produces, and a check that disagreed with the ranks would refuse a job
that runs. So do jobs whose tokenizer must first be trained on the data (`bpe`) or whose data must
first be read (`--data`), and Hugging Face models (importing transformers alone takes seconds): building
them twice would cost what this module saves.
"""

from __future__ import annotations

from .config import JobConfig

CHEAP_TOKENIZERS = ("byte",)


def check_before_launch(job: JobConfig) -> None:
    """Raise the error a rank would raise for this job's resume folder or model, here, once."""
    if job.train.resume:
        from .train.manifest import choose_checkpoint
        choose_checkpoint(job.train.resume)  # no such folder, no complete checkpoint, a damaged one
    if job.data.data is not None or job.data.tokenizer not in CHEAP_TOKENIZERS or job.model.name.startswith("hf:"):
        return
    from .data import build_tokenizer, padded_vocab_size
    from .models import build_model
    tokenizer = build_tokenizer(job.data.tokenizer)
    _, info = build_model(job.model.name, job.model.args, vocab_size=padded_vocab_size(tokenizer.vocab_size),
                          device="meta")
    check_model_fits(info, tokenizer, job.data.seq_len)


def check_model_fits(info, tokenizer, seq_len: int) -> None:
    """The model's vocabulary holds the tokenizer's, and its context the sequence length (ranks check it too)."""
    from .errors import ConfigError
    if info.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"the {tokenizer.name} tokenizer has {tokenizer.vocab_size} tokens but the model "
                          f"{info.name} only {info.vocab_size} (vocab_size); use a tokenizer of at most "
                          f"{info.vocab_size} tokens, or a model with vocab_size >= {tokenizer.vocab_size}")
    if seq_len > info.max_seq_len:
        raise ConfigError(f"seq_len={seq_len} is longer than {info.name}'s context of {info.max_seq_len} "
                          f"positions; use --seq-len <= {info.max_seq_len} or a larger max_seq_len model argument")
