"""Fine-tune a Hugging Face model on prompt/response pairs, then export it back to the Hugging Face format.

    python examples/finetune_hf.py --workdir /tmp/ft                    # one process
    autopar launch --nproc 4 examples/finetune_hf.py --workdir /tmp/ft --dp 2 --pp 2
    autopar launch --nproc 2 examples/finetune_hf.py --workdir /tmp/ft --tp 2

With no --model folder it first makes a small pretrained folder, a random Llama and its tokenizer, and a
JSONL of prompt/response pairs from the embedded corpus (make_pretrained.py), so it runs offline.
The loss is on the response tokens only. The result, WORKDIR/exported, loads with
`AutoTokenizer` and `AutoModelForCausalLM.from_pretrained` and generates with its cache.
The same from the command line:

    autopar train --model hf:PATH --tokenizer hf:PATH --data pairs.jsonl --export-hf OUT [--dp 2 --pp 2]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def make_inputs(workdir: Path) -> tuple[Path, Path, Path]:
    """A small pretrained folder (model and tokenizer), its tokenizer.json and a prompt/response JSONL, written
    once (rank 0's job) by make_pretrained.py."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_pretrained import make_workdir
    folder, pairs = make_workdir(workdir)
    return folder, folder / "tokenizer.json", pairs


def job_for(args: argparse.Namespace, folder: Path, tokenizer: Path, pairs: Path):
    from autopar.config import DataConfig, JobConfig, ModelConfig, Strategy, TrainConfig

    workdir = Path(args.workdir)
    return JobConfig(
        model=ModelConfig(name=f"hf:{args.model or folder}"),
        data=DataConfig(tokenizer=f"hf:{args.tokenizer or tokenizer}", data=str(args.data or pairs), seq_len=32,
                        data_cache=str(workdir / "cache")),
        strategy=Strategy(dp=args.dp, tp=args.tp, pp=args.pp),
        train=TrainConfig(steps=args.steps, global_batch_size=8, micro_batch_size=args.micro_batch_size, lr=1e-3,
                          warmup_steps=1, eval_batches=1, out=str(workdir / "run"), progress=False,
                          export_hf=str(workdir / "exported")))


def main(argv: list[str] | None = None) -> dict:
    import torch.distributed as dist

    from autopar.job import make_trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="where inputs, the run and the export go")
    parser.add_argument("--model", help="a pretrained folder (default: a small random Llama made here)")
    parser.add_argument("--tokenizer", help="a tokenizer.json or folder (default: the pretrained folder's BPE)")
    parser.add_argument("--data", help="a JSONL of {prompt, response} (default: made from the embedded corpus)")
    parser.add_argument("--dp", type=int, default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    made_here = not (args.model and args.tokenizer and args.data)  # some input is the example's own
    if made_here and (rank == 0 or not (dist.is_available() and dist.is_initialized())):
        make_inputs(Path(args.workdir))
    if made_here and dist.is_available() and dist.is_initialized():
        dist.barrier()  # rank 0 wrote the inputs
    inputs = (Path(args.workdir) / "pretrained", Path(args.workdir) / "pretrained" / "tokenizer.json",
              Path(args.workdir) / "pairs.jsonl")
    trainer = make_trainer(job_for(args, *inputs))
    result = trainer.train()
    return {"losses": result.losses, "eval_loss": result.eval_loss, "export": str(Path(args.workdir) / "exported"),
            "bytes_read": trainer.pretrained_bytes_read, "pretrained": str(args.model or inputs[0])}


if __name__ == "__main__":
    main()
