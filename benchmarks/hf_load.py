"""Loading a pretrained Hugging Face folder: bytes each rank reads and load time, against from_pretrained.

A random-initialised Llama of a few hundred MB (default ~106 M parameters, 424 MB fp32) is saved with
save_pretrained into a temporary folder (sharded safetensors with an index, as large models come). Then:

  from_pretrained   AutoModelForCausalLM.from_pretrained(folder) in one process: the whole model read
                    (its file bytes) and its wall time
  autopar           `autopar train --model hf:FOLDER --steps 1` under each layout; run.json records,
                    per rank, the bytes the loader read from the safetensors files and the seconds it took
                    (stage tensors and tensor-parallel slices only, read with safe_open().get_slice)

    python benchmarks/hf_load.py                           # layouts pp2, tp2, tp2 x pp2 (4 ranks)
    python benchmarks/hf_load.py --layers 2 --hidden 256   # a small model
    python benchmarks/hf_load.py --quick                   # smoke test: a tiny model in several shards, tp2
Load times on a shared CPU machine are noisy; the bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {"pp2": ["--nproc", "2", "--pp", "2"], "tp2": ["--nproc", "2", "--tp", "2"],
           "tp2xpp2": ["--nproc", "4", "--tp", "2", "--pp", "2"]}


def save_model(folder: Path, args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("llama", vocab_size=args.vocab, hidden_size=args.hidden,
                                  intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                  num_attention_heads=args.heads, num_key_value_heads=args.heads,
                                  max_position_embeddings=256, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, max_shard_size=args.shard_size)
    return sum(p.numel() for p in model.parameters())


def time_from_pretrained(folder: Path) -> float:
    code = ("import time, torch; from transformers import AutoModelForCausalLM; t = time.perf_counter(); "
            f"AutoModelForCausalLM.from_pretrained({str(folder)!r}); print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def run_layout(folder: Path, name: str, flags: list[str], work: Path) -> dict:
    out = work / f"run-{name}"
    cmd = [sys.executable, "-m", "autopar", "train", "--model", f"hf:{folder}", "--steps", "1", "--seq-len", "16",
           "--global-batch-size", "4", "--micro-batch-size", "1", "--no-progress", "--out", str(out),
           "--eval-batches", "1", *flags]
    began = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    info = json.loads((out / "run.json").read_text())
    return {"layout": name, "wall_s": time.perf_counter() - began, "bytes": info["pretrained_bytes_read"],
            "load_s": info["pretrained_load_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--shard-size", default="100MB", help="save_pretrained's max_shard_size (default 100MB)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: llama 2 layers x 64, vocabulary 512, in several shards; layout tp2 only")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.heads, args.vocab = 2, 64, 128, 2, 512
        args.layouts, args.shard_size = "tp2", "100KB"
    with tempfile.TemporaryDirectory(prefix="hf_load_") as tmp:
        work = Path(tmp)
        folder = work / "model"
        params = save_model(folder, args)
        file_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        whole_s = time_from_pretrained(folder)
        print(f"model: llama {args.layers} layers x {args.hidden}, {params / 1e6:.1f} M parameters, "
              f"{file_bytes / 1e6:.1f} MB in {len(list(folder.glob('*.safetensors')))} safetensors files")
        print(f"from_pretrained, one process: reads {file_bytes / 1e6:.1f} MB in {whole_s:.2f} s")
        print(f"{'layout':<9} {'rank':>4} {'MB read':>9} {'of whole':>9} {'load s':>7}")
        results = []
        for name in args.layouts.split(","):
            result = run_layout(folder, name, LAYOUTS[name], work)
            results.append(result)
            for rank, (b, s) in enumerate(zip(result["bytes"], result["load_s"])):
                print(f"{name:<9} {rank:>4} {b / 1e6:>9.1f} {b / file_bytes:>8.0%} {s:>7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"params": params, "file_bytes": file_bytes,
                                               "from_pretrained_s": whole_s, "layouts": results,
                                               "cpus": os.cpu_count()}, indent=2))


if __name__ == "__main__":
    main()
