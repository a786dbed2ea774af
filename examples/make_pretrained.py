"""Make a small pretrained Hugging Face folder offline, to fine-tune with autopar and load back with transformers.

    python examples/make_pretrained.py /tmp/ft
    autopar train --model hf:/tmp/ft/pretrained --tokenizer hf:/tmp/ft/pretrained --data /tmp/ft/pairs.jsonl \
        --seq-len 32 --global-batch-size 8 --micro-batch-size 2 --steps 20 --warmup-steps 2 --lr 1e-3 \
        --nproc 2 --export-hf /tmp/ft/exported

WORKDIR/pretrained is what a downloaded model folder holds, written by transformers' own `save_pretrained`
(no network): a random Llama of width 64 (config.json, safetensors in several shards with their index,
generation_config.json) and a byte-level BPE tokenizer of 320 tokens learned from the embedded corpus
(tokenizer.json, tokenizer_config.json with its end and padding tokens, a chat template). WORKDIR/pairs.jsonl
holds prompt/response pairs from the corpus (the loss is on the responses). The export loads with
`AutoTokenizer` and `AutoModelForCausalLM.from_pretrained` and generates with its key/value cache.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

VOCAB_SIZE = 320
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def corpus_lines(count: int = 96) -> list[str]:
    """Short lines of the embedded corpus: a prompt and its response fit in 32 tokens."""
    from autopar.data import load_corpus
    text = load_corpus("stdlib").train[:400_000].decode("utf-8", "replace")
    return [line.strip() for line in text.splitlines() if 16 <= len(line.strip()) <= 40][:count]


def make_pretrained(folder: Path, lines: list[str], max_shard_size: str = "100KB") -> Path:
    """A random Llama and its tokenizer, saved as transformers saves a pretrained model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from autopar.data.hf_tokenizer import HFTokenizer

    bpe = HFTokenizer.train_bpe("\n".join(lines), VOCAB_SIZE)  # specials <pad>=0, <eos>=1, <mask>=2
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe.tokenizer, eos_token="<eos>", pad_token="<pad>",
                                        model_max_length=128)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = AutoConfig.for_model("llama", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, pad_token_id=bpe.pad_id, bos_token_id=bpe.eos_id,
                                  eos_token_id=bpe.eos_id)
    torch.manual_seed(0)
    # sharded, as large models come: model-0000k-of-0000n.safetensors and model.safetensors.index.json
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def make_pairs(path: Path, lines: list[str]) -> Path:
    """A JSONL of {prompt, response}: each even line asks, the next answers (written atomically)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps({"prompt": f"{a}\n", "response": b}) + "\n"
                           for a, b in zip(lines[0::2], lines[1::2])))
    os.replace(tmp, path)
    return path


def make_workdir(workdir: Path) -> tuple[Path, Path]:
    """WORKDIR/pretrained and WORKDIR/pairs.jsonl, made once (the pairs file is written last)."""
    folder, pairs = workdir / "pretrained", workdir / "pairs.jsonl"
    if not pairs.is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        lines = corpus_lines()
        make_pretrained(folder, lines)
        make_pairs(pairs, lines)
    return folder, pairs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", help="where WORKDIR/pretrained and WORKDIR/pairs.jsonl go")
    folder, pairs = make_workdir(Path(parser.parse_args(argv).workdir))
    print(f"pretrained folder {folder} (model and tokenizer: --model hf:{folder} --tokenizer hf:{folder}), "
          f"prompt/response pairs {pairs} (--data {pairs})")


if __name__ == "__main__":
    main()
