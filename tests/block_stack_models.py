"""Models that hold their repeated blocks in the ways people write them, and the rank-pool function
that trains them (module level, so spawned ranks can import it): a llama-style model whose layers
sit in an nn.ModuleDict, a model whose blocks are attributes h0..h3 (each with an nn.Sequential
MLP inside), and blocks in an nn.Sequential with Sequential MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autopar

VOCAB, SEQ, WIDTH, HEADS, DEPTH = 64, 8, 32, 4, 4


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.input_norm = RMSNorm(width)
        self.attn = LlamaAttention(width, heads)
        self.post_norm = RMSNorm(width)
        self.mlp = SwiGLU(width, 2 * width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_norm(x))


class DictLlama(nn.Module):
    """Llama-style causal LM with its layers in an nn.ModuleDict keyed "0".."3", run in key order."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, heads: int = HEADS, depth: int = DEPTH):
        super().__init__()
        self.heads = heads
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleDict({str(i): LlamaBlock(width, heads) for i in range(depth)})
        self.norm = RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        half = x.shape[-1] // self.heads // 2
        inv_freq = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
        angles = torch.arange(input_ids.shape[1], device=x.device, dtype=torch.float32)[:, None] * inv_freq
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class MlpBlock(nn.Module):
    """Pre-norm attention and an nn.Sequential MLP: the inner Sequential the stack finder must not take."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for y in self.qkv(self.ln_1(x)).split(c, dim=2))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class AttributeBlocksLM(nn.Module):
    """Blocks held as attributes h0..h3 and called one by one in forward."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, seq: int = SEQ):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.h0, self.h1, self.h2, self.h3 = MlpBlock(width), MlpBlock(width), MlpBlock(width), MlpBlock(width)
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        x = self.h0(x)
        x = self.h1(x)
        x = self.h2(x)
        x = self.h3(x)
        return self.head(self.ln_f(x))


class SequentialBlocksLM(nn.Module):
    """The same blocks in an nn.Sequential (each with its Sequential MLP)."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(SEQ, width)
        self.blocks = nn.Sequential(*[MlpBlock(width) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        return self.head(self.ln_f(self.blocks(x)))


MODELS = {"module-dict": DictLlama, "attributes": AttributeBlocksLM, "sequential": SequentialBlocksLM}


def build(name: str, device: str) -> nn.Module:
    """`name` on meta (autopar initialises it) or for real (seeded, so every process builds the same weights)."""
    if device == "meta":
        with torch.device("meta"):
            return MODELS[name]()
    torch.manual_seed(0)
    return MODELS[name]()


def token_data(samples: int = 8, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=gen)
    return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]


def train(cases: list[tuple[str, str, dict]], out: str) -> list[dict]:
    """Train each (model, device, strategy) case 2 steps of 8 samples; losses, banner, parameters, FSDP units."""
    from helpers import whole_parameters
    results = []
    for i, (name, device, strategy) in enumerate(cases):
        # adam_eps 1e-6: a key bias's gradient is zero up to rounding (softmax ignores a shift), and Adam
        # would scale that noise up to a step of lr with eps 1e-8 (see zoo_training.train_case)
        config = autopar.TrainConfig(steps=2, global_batch_size=8, micro_batch_size=4, lr=1e-3, adam_eps=1e-6,
                                     warmup_steps=0, out=f"{out}/{i}", progress=False, timeout_s=60)
        trainer = autopar.Trainer(build(name, device), token_data(), strategy=autopar.Strategy(**strategy),
                                  config=config)
        result = trainer.train()
        engine = trainer.engine
        results.append({"losses": result.losses, "banner": trainer._banner(0), "params": whole_parameters(trainer),
                        "units": list(getattr(engine, "unit_paths", [])),
                        "blocks": [spec.blocks for spec in engine.partition.specs] if hasattr(engine, "partition")
                        else None})
        trainer.close()
    return results
