"""The reference step the calibration runs on every rank: a small GPT trained by replicated data parallelism.

The step model's time-shared bound has the right shape but misses the level a real step adds when ranks share
cores (caches refilled after every switch, gloo threads polling, the per-step work around the arithmetic;
step_probe.py). The calibration measures that level once per machine on this fixed model, shaped like the
built-in gpt-mini (4 layers of width 128, 128 tokens, 8 sequences per rank), so that predictions without a
`--cluster` mean seconds on this machine, not ~30% fewer. step_probe.reference_level prices the same model and
step with the search's own profile and cost model, and the ratio is Cluster.time_shared_scale.

Torch only (no autopar import): the calibration's ranks are forked from a process that imports nothing of
autopar's (calibrate_ranks.py), and the search process imports this file as part of the package.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, LAYERS, HEADS, SEQ_LEN, MICRO_BATCH = 256, 128, 4, 4, 128, 8
ROUNDS, STEPS = 5, 2  # timed rounds of steps (~0.15 s a step on 4 ranks of a 2-core machine); the median counts
WARMUP = 2  # untimed steps first (the allocator's first requests, cold caches): a trainer is warm after one


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.out = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.fc_in, self.fc_out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln_1(x)
        q, k, v = (p(h).view(b, t, HEADS, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.out(y)
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x))))


class ReferenceGPT(nn.Module):
    """The calibration's model: token and position embeddings, LAYERS pre-norm blocks, a tied output head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ_LEN, WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok_emb.weight
        for module in self.modules():  # GPT-2's initialisation, as the models users train have: with torch's
            if isinstance(module, (nn.Linear, nn.Embedding)):  # unit-variance embedding tied to the head, logits
                nn.init.normal_(module.weight, std=0.02)  # start saturated and the backward's softmax underflows
            if isinstance(module, nn.Linear) and module.bias is not None:  # into denormals: steps 2x slower
                nn.init.zeros_(module.bias)  # until training shrinks them (~25 steps), not the machine's speed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(input_ids) + self.pos_emb(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The update the trainer runs by default (train/optim.py): AdamW with torch's one-kernel (fused) step, so the
    reference is priced with the same update the search prices for a user's model. Its first construction imports
    torch's compiler stack (about a second): calibrate_ranks imports it once before forking the ranks."""
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)


def after_backward(params: list[torch.Tensor], update: torch.optim.Optimizer,
                   all_reduce: Callable[[torch.Tensor], object], world: int) -> None:
    """The reference step's work after the backward, as the data-parallel engine does it: the gradients summed
    (here as one flattened buffer, copied back), the norm clipped (torch's foreach norm), the optimizer step."""
    flat = torch.cat([p.grad.flatten() for p in params])
    all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    update.step()


def step_rounds(rounds: int = ROUNDS, steps: int = STEPS, busy_seconds: Callable[[], float | None] | None = None,
                warmup: int = WARMUP) -> list[dict]:
    """One replicated data-parallel training step of ReferenceGPT over every rank of the default group, as the
    data-parallel engine runs it: forward and loss, backward, the gradients all-reduced (one flattened buffer),
    the norm clipped, the trainer's AdamW step, and the small collectives the trainer's step makes besides (the target count,
    the loss with its flags, the peak memory: each a wait, priced by the search as host syncs, so they run here
    too). Timed in `rounds` rounds of `steps` steps after `warmup` untimed steps; per round and per step: `wall_s` (from the first rank's start to the last rank's end), `cpu_s`
    (every rank's process CPU, summed) and `busy_s` (the machine's busy CPU, `busy_seconds()` on rank 0 around
    the round; None unknown), so that the caller can tell a loaded machine's rounds and keep the quietest
    (machine_load.py). Every rank returns the same list."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = ReferenceGPT()
    params = list(model.parameters())
    update = optimizer(params)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN + 1))
    world = dist.get_world_size()

    def step() -> None:
        for p in params:
            p.grad = None
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        dist.all_reduce(count)  # the targets in the global batch (train/loss.py)
        loss.backward()
        after_backward(params, update, lambda flat: dist.all_reduce(flat), world)
        flags = torch.stack([loss.detach(), torch.zeros(()), torch.zeros(())])
        dist.all_reduce(flags)  # loss, bad norm, stop requested (train/steps.py)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the step's peak memory
        torch.cat([flags.double(), peak]).tolist()  # one host read

    count, peak = torch.zeros(()), torch.zeros(1, dtype=torch.float64)
    for _ in range(max(warmup, 1)):
        step()
    found = []
    for _ in range(rounds):
        dist.barrier()
        busy = busy_seconds() if busy_seconds is not None and dist.get_rank() == 0 else None
        span = torch.tensor([-time.monotonic(), 0.0], dtype=torch.float64)  # one clock for the machine
        used = time.process_time()
        for _ in range(steps):
            step()
        span[1] = time.monotonic()
        cpu = torch.tensor([time.process_time() - used], dtype=torch.float64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)  # the first start, the last end
        dist.all_reduce(cpu)
        after = busy_seconds() if busy is not None else None
        busy_s = torch.tensor([after - busy if after is not None else -1.0], dtype=torch.float64)
        dist.broadcast(busy_s, 0)
        wall = float(span[0] + span[1])
        found.append({"wall_s": wall / steps, "cpu_s": float(cpu) / steps,
                      "busy_s": float(busy_s) / steps if float(busy_s) >= 0 else None})
    return found
