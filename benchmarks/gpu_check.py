"""What a GPU must confirm, in one command: autopar on one CUDA GPU, measured against eager PyTorch and the models.

    PYTHONPATH=src python benchmarks/gpu_check.py [--quick] [--json out.json]

On a machine with a CUDA device it prints, naming the device:
1. step time of autopar's trainer at dp=1 (bf16 autocast) against a plain eager loop on the same
   model, batch and optimizer, for gpt-small and an hf:llama of about 0.5B parameters: the
   throughput ratio (goal >= 0.97) and the model FLOP utilisation of both (FLOPs from the
   traced profile, peak from the matching cluster preset);
2. every strategy that runs in one process (the whole-model engine; a pipeline of all its
   stages on one rank; with recomputation; sub-pipelined TP, refused at tp=1 if so) trained on
   CUDA and on CPU in fp32 (TF32 off): the largest relative loss difference;
3. the cost model's per-block forward and backward times (search/cost.py, the device's preset)
   against CUDA-event timings of each block run alone, and the memory model's peak
   (search/memory.py) against torch.cuda.max_memory_allocated, for several micro-batch sizes:
   the errors, and the compute efficiency the preset would need to match.
Without a CUDA device it prints "no CUDA device: nothing measured" and exits 0; with --quick it then
runs the same checks on CPU with gpt-tiny (a smoke run of this script's code, saying so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.search.cluster import preset
from autopar.search.cost import Candidate, StepModel
from autopar.search.profile import profile_model
from autopar.timing import Clock

NO_CUDA = "no CUDA device: nothing measured"
CPU_SMOKE = ("--quick without CUDA: the GPU measurements are skipped; the same checks run on CPU with gpt-tiny "
             "(fp32, preset cpu-local) so that this script's code is exercised; their figures say nothing about a GPU")
VOCAB = 256 + 2  # the byte tokenizer's, as the trainer's data uses
LLAMA_HALF_B = {"num_hidden_layers": 20, "hidden_size": 1536, "intermediate_size": 4096, "num_attention_heads": 16,
                "num_key_value_heads": 8, "max_position_embeddings": 1024}
MODELS = {"gpt-small": {}, "hf:llama": LLAMA_HALF_B}
QUICK_MODELS = {"gpt-mini": {}, "hf:llama": {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 704,
                                             "num_attention_heads": 4, "num_key_value_heads": 2}}
ONE_PROCESS_STRATEGIES = {
    "whole model (dp=1)": {},
    "pipeline, 2 stages on one rank": {"pp": 1, "chunks": 2, "schedule": "interleaved-1f1b"},
    "pipeline, 2 stages, recompute all": {"pp": 1, "chunks": 2, "schedule": "interleaved-1f1b", "recompute": "all"},
    "sub-pipelined TP graph at tp=1": {"tp": 1, "tp_subbatches": 2},
}
PRESET_BY_DEVICE = (("H100", "h100-80gb"), ("H200", "h100-80gb"), ("A100", "a100-80gb"), ("V100", "v100-16gb-nvlink"),
                    ("3090", "rtx3090-24gb-pcie"))


def device_preset(device_name: str):
    """The cluster preset whose device matches `device_name` (H200: H100's compute rates), or None."""
    for key, name in PRESET_BY_DEVICE:
        if key in device_name:
            cluster = preset(name)
            if key == "A100" and torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 60e9:
                cluster = preset("a100-40gb")
            return cluster
    return None


def ensure_world_of_one() -> None:
    """One process group for every run here (gloo for CPU tensors, NCCL for CUDA ones)."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token windows: the same batches for the eager loop and the trainer."""

    label_convention = "aligned"  # labels are the next tokens (the eager loop scores them unshifted)

    def __init__(self, n: int, seq_len: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def build(model_name: str, model_args: dict, device: str, seed: int = 0) -> torch.nn.Module:
    from autopar.data import padded_vocab_size
    from autopar.models import build_model
    from autopar.models.hf import turn_off_kv_cache
    from autopar.models.materialize import materialize
    model, _ = build_model(model_name, model_args, vocab_size=padded_vocab_size(VOCAB), device="meta")
    turn_off_kv_cache(model)
    return materialize(model, device, seed=seed)


def _logits(output):
    return output.logits if hasattr(output, "logits") else output


def eager_step_seconds(model_name: str, model_args: dict, *, device: str, dtype: str, batch: int, seq_len: int,
                       steps: int, warmup: int = 2) -> float:
    """Median step time of a plain loop: forward, token cross-entropy, backward, clip, AdamW."""
    model = build(model_name, model_args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = RandomTokens(batch * (steps + warmup), seq_len)
    clock, times = Clock(device), []
    for step in range(steps + warmup):
        rows = [data[i] for i in range(step * batch, (step + 1) * batch)]
        ids = torch.stack([r["input_ids"] for r in rows]).to(device)
        labels = torch.stack([r["labels"] for r in rows]).to(device)
        clock.reset()
        start = clock.mark()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = _logits(model(ids))
        loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())  # the loss reaches the host once per step, as in the trainer
        seconds = clock.seconds([start, clock.mark()])
        if step >= warmup:
            times.append(seconds[1] - seconds[0])
    return statistics.median(times)


def trainer_run(model_name: str, model_args: dict, *, device: str, dtype: str, batch: int, seq_len: int, steps: int,
                strategy: dict | None = None, out: str) -> list[dict]:
    """autopar's trainer (one process) on the same random tokens; its metrics.jsonl records."""
    import autopar
    ensure_world_of_one()
    from autopar.data import padded_vocab_size
    from autopar.models import build_model
    model, _ = build_model(model_name, model_args, vocab_size=padded_vocab_size(VOCAB), device="meta")
    config = autopar.TrainConfig(steps=steps, global_batch_size=batch, micro_batch_size=batch, lr=1e-4,
                                 warmup_steps=0, eval_batches=1, out=out, progress=False, device=device, dtype=dtype,
                                 grad_clip=1.0, log_every=1)
    trainer = autopar.Trainer(model, RandomTokens(batch * steps, seq_len),
                              strategy=autopar.Strategy(**(strategy or {})), config=config,
                              eval_data=RandomTokens(batch, seq_len, seed=1))
    trainer.train()
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _num_params(model_name: str, model_args: dict) -> int:
    from autopar.data import padded_vocab_size
    from autopar.models import build_model
    model, _ = build_model(model_name, model_args, vocab_size=padded_vocab_size(VOCAB), device="meta")
    return sum(p.numel() for p in model.parameters())


def model_flops_per_step(model_name: str, model_args: dict, *, batch: int, seq_len: int) -> float:
    """Forward + backward FLOPs of one step from the traced profile (backward = 2x forward)."""
    profile = profile_model(model_name, seq_len=seq_len, model_args=model_args, vocab_size=None)
    return 3 * sum(profile.flops) * batch


def compare_with_eager(models: dict, *, device: str, dtype: str, batch: int, seq_len: int, steps: int,
                       peak_flops: float | None, out: str) -> list[dict]:
    rows = []
    for name, args in models.items():
        eager = eager_step_seconds(name, args, device=device, dtype=dtype, batch=batch, seq_len=seq_len, steps=steps)
        records = trainer_run(name, args, device=device, dtype=dtype, batch=batch, seq_len=seq_len, steps=steps + 2,
                              out=f"{out}/{name.replace(':', '_')}-speed")
        ours = statistics.median(r["step_time_s"] for r in records[2:])
        flops = model_flops_per_step(name, args, batch=batch, seq_len=seq_len)
        row = {"model": name, "eager_s": eager, "autopar_s": ours, "throughput_ratio": eager / ours,
               "params": _num_params(name, args)}
        if peak_flops:
            row["mfu_eager"], row["mfu_autopar"] = flops / eager / peak_flops, flops / ours / peak_flops
        rows.append(row)
    return rows


def strategies_match_cpu(model_name: str, model_args: dict, *, device: str, batch: int, seq_len: int, steps: int,
                         out: str) -> list[dict]:
    """Each one-process strategy in fp32 on `device` and on CPU: the largest relative loss difference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for label, strategy in ONE_PROCESS_STRATEGIES.items():
        try:
            losses = {}
            for where in dict.fromkeys([device, "cpu"]):
                records = trainer_run(model_name, model_args, device=where, dtype="fp32", batch=batch, seq_len=seq_len,
                                      steps=steps, strategy=strategy, out=f"{out}/{label.replace(' ', '_')}-{where}")
                losses[where] = [r["loss"] for r in records]
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses[device], losses["cpu"]))
            rows.append({"strategy": label, "max_relative_loss_difference": diff, "losses": losses[device]})
        except Exception as exc:  # a strategy refused in one process is reported, not hidden
            rows.append({"strategy": label, "refused": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]})
    return rows


def measured_block_seconds(model_name: str, model_args: dict, *, device: str, dtype: str, batch: int, seq_len: int,
                           repeats: int = 5) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of every block (the partitioner's blocks), each run alone on `device`."""
    from autopar.data import padded_vocab_size
    from autopar.models import build_model
    from autopar.models.hf import turn_off_kv_cache
    from autopar.partition import partition
    from autopar.trace import trace
    model, _ = build_model(model_name, model_args, vocab_size=padded_vocab_size(VOCAB), device="meta")
    turn_off_kv_cache(model)
    model.train()
    graph = trace(model, (torch.zeros(batch, seq_len, dtype=torch.long, device="meta"),))
    cut = partition(graph, len(graph.blocks), method="uniform")
    blocks = [cut.materialize_stage(s, model, device, seed=0) for s in range(len(graph.blocks))]
    ids = RandomTokens(batch, seq_len).tokens[:, :-1].to(device)
    autocast = lambda: torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == "bf16")  # noqa
    clock = Clock(device)
    forward, backward = [[] for _ in blocks], [[] for _ in blocks]
    for _ in range(repeats + 1):
        x = (ids,)
        for s, block in enumerate(blocks):
            x = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in x)
            clock.reset()
            marks = [clock.mark()]
            with autocast():
                out = block(*x)
            marks.append(clock.mark())
            floats = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])
            marks.append(clock.mark())
            start, mid, end = clock.seconds(marks)
            forward[s].append(mid - start)
            backward[s].append(end - mid)
            x = tuple(v.detach() for v in out)
    return [statistics.median(t[1:]) for t in forward], [statistics.median(t[1:]) for t in backward]


def block_time_errors(model_name: str, model_args: dict, cluster, *, device: str, dtype: str, batch: int,
                      seq_len: int) -> dict:
    profile = profile_model(model_name, seq_len=seq_len, model_args=model_args)
    predicted_f, predicted_b, _ = StepModel(profile, cluster, global_batch_size=batch, dtype=dtype).block_times(1, batch)
    measured_f, measured_b = measured_block_seconds(model_name, model_args, device=device, dtype=dtype, batch=batch,
                                                    seq_len=seq_len)
    layers = range(1, len(measured_f) - 1)  # the repeated layers; block 0 and the last are embedding and head
    pred, meas = sum(predicted_f[i] + predicted_b[i] for i in layers), sum(measured_f[i] + measured_b[i] for i in layers)
    return {"model": model_name, "predicted_forward_s": predicted_f, "predicted_backward_s": predicted_b,
            "measured_forward_s": measured_f, "measured_backward_s": measured_b,
            "layer_error": pred / meas - 1, "efficiency_to_match": cluster.compute_efficiency * pred / meas}


def memory_errors(model_name: str, model_args: dict, cluster, *, device: str, seq_len: int, batches: tuple[int, ...],
                  out: str) -> list[dict]:
    """Predicted peak (no headroom) against the trainer's measured peak, dp=1 bf16, per micro-batch size."""
    profile = profile_model(model_name, seq_len=seq_len, model_args=model_args)
    rows = []
    for batch in batches:
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        records = trainer_run(model_name, model_args, device=device, dtype="bf16", batch=batch, seq_len=seq_len,
                              steps=2, out=f"{out}/memory-{batch}")
        measured = max(r["peak_mem_bytes"] for r in records)
        estimate = StepModel(profile, cluster.replace(memory_headroom=1.0), global_batch_size=batch,
                             dtype="bf16").evaluate(Candidate(dp=1, tp=1, pp=1, micro_batch_size=batch,
                                                              num_microbatches=1))
        rows.append({"micro_batch_size": batch, "predicted_bytes": estimate.peak_memory, "measured_bytes": measured,
                     "error": estimate.peak_memory / measured - 1})
    return rows


def run_checks(device: str, models: dict, cluster, *, dtype: str, steps: int, batch: int, seq_len: int,
               strategy_size: tuple[int, int, int], memory_batches: tuple[int, ...], out: str) -> dict:
    """The three checks on `device`, printed as they finish; every figure in the returned report.
    strategy_size: (batch, seq_len, steps) of the one-process strategies' runs (gpt-tiny)."""
    peak = cluster.flops_per_s[dtype] if cluster is not None else None
    report: dict = {}
    report["speed"] = compare_with_eager(models, device=device, dtype=dtype, batch=batch, seq_len=seq_len,
                                         steps=steps, peak_flops=peak, out=out)
    print(f"\n1. trainer (dp=1, {dtype}) against eager PyTorch, same model, batch, optimizer")
    for r in report["speed"]:
        mfu = (f", MFU eager {r['mfu_eager']:.1%} autopar {r['mfu_autopar']:.1%}" if "mfu_eager" in r else "")
        print(f"  {r['model']} ({r['params'] / 1e6:.0f}M params): eager {r['eager_s'] * 1e3:.1f} ms, autopar "
              f"{r['autopar_s'] * 1e3:.1f} ms per step: throughput ratio {r['throughput_ratio']:.3f} (goal >= 0.97)"
              + mfu)

    small_batch, small_seq, small_steps = strategy_size
    report["strategies"] = strategies_match_cpu("gpt-tiny", {}, device=device, batch=small_batch, seq_len=small_seq,
                                                steps=small_steps, out=out)
    print(f"\n2. one-process strategies, fp32 (TF32 off): {device.upper()} losses against CPU losses")
    for r in report["strategies"]:
        print(f"  {r['strategy']}: " + (f"refused ({r['refused']})" if "refused" in r
                                        else f"max relative difference {r['max_relative_loss_difference']:.2e}"))

    if cluster is not None:
        print(f"\n3. the models against torch.{device}, preset {cluster.name} (compute efficiency "
              f"{cluster.compute_efficiency})")
        report["blocks"], report["memory"] = [], []
        for model_name, model_args in models.items():
            blocks = block_time_errors(model_name, model_args, cluster, device=device, dtype=dtype, batch=batch,
                                       seq_len=seq_len)
            report["blocks"].append(blocks)
            print(f"  {model_name}: per-layer forward+backward time error {blocks['layer_error']:+.0%} "
                  f"(the preset would need compute_efficiency {blocks['efficiency_to_match']:.2f}); embedding "
                  f"{blocks['measured_forward_s'][0] * 1e3:.2f}/{blocks['predicted_forward_s'][0] * 1e3:.2f} ms and "
                  f"head {blocks['measured_forward_s'][-1] * 1e3:.2f}/{blocks['predicted_forward_s'][-1] * 1e3:.2f} "
                  "ms forward (measured/predicted)")
            memory = memory_errors(model_name, model_args, cluster, device=device, seq_len=seq_len,
                                   batches=memory_batches, out=out)
            report["memory"].append({"model": model_name, "rows": memory})
            for r in memory:
                print(f"  {model_name} mbs={r['micro_batch_size']}: peak memory predicted "
                      f"{r['predicted_bytes'] / 2**30:.2f} GiB, measured {r['measured_bytes'] / 2**30:.2f} GiB, "
                      f"error {r['error']:+.0%}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models and few steps (a smoke run); without "
                        "CUDA, the same checks on CPU with gpt-tiny, so that the script's code still runs")
    parser.add_argument("--json", help="also write every figure to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        if not args.quick:
            return 0
        print(CPU_SMOKE)
    out = tempfile.mkdtemp(prefix="gpu_check-")
    if not torch.cuda.is_available():
        ensure_world_of_one()
        report = {"device": "cpu", **run_checks("cpu", {"gpt-tiny": {}}, preset("cpu-local"), dtype="fp32", steps=2,
                                                 batch=2, seq_len=32, strategy_size=(2, 32, 2), memory_batches=(1,),
                                                 out=out)}
    else:
        name = torch.cuda.get_device_name(0)
        cluster = device_preset(name)
        print(f"device: {name} (torch {torch.__version__}, CUDA {torch.version.cuda}); preset "
              f"{cluster.name if cluster else 'none matches: MFU and model errors skipped'}")
        models = QUICK_MODELS if args.quick else MODELS
        steps, batch, seq_len = (3, 2, 128) if args.quick else (10, 8, 1024)
        ensure_world_of_one()
        report = {"device": name, **run_checks("cuda", models, cluster, dtype="bf16", steps=steps, batch=batch,
                                               seq_len=seq_len, strategy_size=(4, 64, 3),
                                               memory_batches=(1, 2) if args.quick else (1, 2, 4), out=out)}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
