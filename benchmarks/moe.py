"""Expert parallelism against replicated experts: per-rank bytes, all-to-all traffic, step time, losses.

A Mixtral-shaped causal LM (Hugging Face's own MixtralForCausalLM, 8 experts, top-2, built on meta
and materialised by autopar) trains on the embedded corpus on 4 gloo CPU ranks twice, from the same
seed and batches: dp=4 with every expert on every rank, and ep=4 (each rank holds 2 of the 8 experts
of every layer, tokens sent to their expert's rank by all-to-all). Printed:

  param bytes   this rank's parameters, and the expert weights among them (expected: 1/ep of the
                replicated expert bytes; the dense weights are the same in both)
  all-to-all    bytes this rank sent in the last step (both exchanges, forward and backward; the equal-split
                exchange of the counts left out) from the rows it actually sent and received, beside
                the formula for uniform routing: layers x micro-batches x tokens x top_k x (ep-1)/ep x
                (16 H + 16) bytes (fp32: hidden row out, its weight and expert id; the expert's output
                row back; in backward the output's gradient out and the row's and weight's gradients back)
  step time     median over the steps after the first, the slowest rank (this rank's clock)
  losses        every step's loss of both runs, which must agree (max relative difference shown)

    python benchmarks/moe.py            # 4 ranks, hidden 128, 8 steps
    python benchmarks/moe.py --quick    # smoke: 2 ranks, hidden 32, 2 steps, random tokens
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

EXPERTS, TOP_K, LAYERS, SEQ, MICRO = 8, 2, 2, 32, 2


def _model_args(hidden: int) -> dict:
    return dict(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, hidden_size=hidden,
                intermediate_size=2 * hidden, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2)


def _train(strategy: dict, hidden: int, steps: int, world: int, data) -> dict:
    import autopar
    from autopar.data import padded_vocab_size
    from autopar.models import build_model

    model, _ = build_model("hf:mixtral", _model_args(hidden), vocab_size=padded_vocab_size(258), device="meta")
    config = autopar.TrainConfig(steps=steps, global_batch_size=2 * MICRO * world, micro_batch_size=MICRO, lr=1e-3,
                                 warmup_steps=0, out=tempfile.mkdtemp(), progress=False, timeout_s=600)
    trainer = autopar.Trainer(model, data, strategy=autopar.Strategy(**strategy), config=config)
    result = trainer.train()
    engine = trainer.engine
    plan = getattr(engine, "plan", None)
    names = dict(trainer.model.named_parameters())
    forwards = list(engine.experts.forwards.values()) if plan is not None else []
    got = {"losses": result.losses, "step_s": statistics.median(trainer.account.step_times_s[1:]),
           "param_bytes": sum(p.numel() * p.element_size() for p in names.values()),
           "expert_names": plan.expert_params if plan is not None else None,
           "rows_away": sum(f.rows_sent_away for f in forwards), "rows_in": sum(f.rows_from_others for f in forwards)}
    got["params"] = names
    trainer.close()
    return got


def _run(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=1200))
    if args.quick:  # random tokens: the corpus takes longer to read than the smoke's steps to run
        g = torch.Generator().manual_seed(0)
        data = [{"input_ids": t[:-1], "labels": t[1:]} for t in torch.randint(0, 256, (64, SEQ + 1), generator=g)]
    else:
        from autopar.data import build_datasets, build_tokenizer, load_corpus
        data = build_datasets(load_corpus("stdlib"), build_tokenizer("byte"), seq_len=SEQ, task="causal-lm",
                              seed=0)[0]
    ep = _train({"ep": world}, args.hidden, args.steps, world, data)
    dp = _train({}, args.hidden, args.steps, world, data)
    expert_bytes = lambda run: sum(run["params"][n].numel() * run["params"][n].element_size()  # noqa: E731
                                   for n in ep["expert_names"])
    row = {name: {"param_bytes": run["param_bytes"], "expert_bytes": expert_bytes(run), "step_s": run["step_s"],
                  "losses": run["losses"]} for name, run in (("dp", dp), ("ep", ep))}
    row["ep"]["rows_away"], row["ep"]["rows_in"] = ep["rows_away"], ep["rows_in"]
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke: 2 ranks, hidden 32, 2 steps, random tokens")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (the experts' is twice it)")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first is left out of the time)")
    parser.add_argument("--world", type=int, default=4, help="ranks: dp=world against ep=world")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.steps, args.world = 32, 2, 2
    from autopar.launch import free_port

    load_before = os.getloadavg()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run, args=(r, args.world, port, args, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = out.get(timeout=3600)
    for p in procs:
        p.join()
    load_after = os.getloadavg()
    world, hidden = args.world, args.hidden
    print(f"hf:mixtral hidden {hidden}, {LAYERS} layers, {EXPERTS} experts top-{TOP_K}; {world} gloo CPU ranks, "
          f"micro-batches 2 x {MICRO} x {SEQ} tokens per rank per step, {args.steps} steps; torch {torch.__version__}; "
          f"load average before {'/'.join(f'{x:.1f}' for x in load_before)}, "
          f"after {'/'.join(f'{x:.1f}' for x in load_after)}")
    print(f"\n{'rank':>4} {'dp params':>10} {'ep params':>10} {'dp experts':>11} {'ep experts':>11} "
          f"{'ep/dp experts':>13} {'1/ep':>6}")
    worst = 0.0
    for r, row in enumerate(rows):
        ratio = row["ep"]["expert_bytes"] / row["dp"]["expert_bytes"]
        worst = max(worst, abs(ratio * world - 1))
        print(f"{r:>4} {row['dp']['param_bytes']:>10,} {row['ep']['param_bytes']:>10,} {row['dp']['expert_bytes']:>11,} "
              f"{row['ep']['expert_bytes']:>11,} {ratio:>13.4f} {1 / world:>6.4f}")
    print(f"expert bytes per rank within {worst:.2%} of 1/ep of the replicated figure")
    per_row = 16 * hidden + 16
    formula = LAYERS * 2 * MICRO * SEQ * TOP_K * (world - 1) / world * per_row
    print(f"\nall-to-all bytes sent in the last step, per rank (ep={world}); formula for uniform routing: {formula:,.0f}")
    for r, row in enumerate(rows):
        ep = row["ep"]
        away, came = ep["rows_away"], ep["rows_in"]  # the engine counts from each step's start
        measured = away * (8 * hidden + 12) + came * (8 * hidden + 4)
        print(f"{r:>4} rows out {away:5d}, rows in {came:5d}: {measured:>12,.0f} bytes ({measured / formula:.2f} "
              f"of the formula)")
    mean = sum(row["ep"]["rows_away"] * (8 * hidden + 12) + row["ep"]["rows_in"] * (8 * hidden + 4)
               for row in rows) / world
    print(f"mean over ranks {mean:,.0f} bytes ({mean / formula:.2f} of the formula; a rank's share follows its "
          f"experts' load)")
    dp_time = max(row["dp"]["step_s"] for row in rows)
    ep_time = max(row["ep"]["step_s"] for row in rows)
    print(f"\nstep time (median, slowest rank): dp={world} replicated {dp_time * 1e3:.1f} ms, ep={world} "
          f"{ep_time * 1e3:.1f} ms ({ep_time / dp_time:.2f}x)")
    dp_losses, ep_losses = rows[0]["dp"]["losses"], rows[0]["ep"]["losses"]
    diff = max(abs(a - b) / abs(a) for a, b in zip(dp_losses, ep_losses))
    print("losses dp: " + " ".join(f"{x:.5f}" for x in dp_losses))
    print("losses ep: " + " ".join(f"{x:.5f}" for x in ep_losses))
    print(f"max relative difference {diff:.2e}")
    if diff > 1e-5 or worst > 0.05:
        raise SystemExit("expert parallelism diverged from replicated experts, or its expert bytes are not 1/ep")


if __name__ == "__main__":
    main()
