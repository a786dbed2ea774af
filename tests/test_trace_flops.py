"""FLOPs of a traced graph: counted on the shapes the trace recorded, for models built for real too.

A model built for real makes tensors on its input's device in forward (positions, rotary
tables moved with `.to(x.device)`, masks) and views transposed results after `.contiguous()`;
counting FLOPs by rerunning such a graph on meta tensors crashed pipeline and tensor
parallelism. The count must be the same whichever way the model was built, and exact for
the matmuls a hand count gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.trace.graph import trace

WIDTH, HEADS, SEQ, VOCAB, LAYERS, BATCH = 32, 4, 8, 64, 2, 2


class RotaryAttention(nn.Module):
    """Attention with a rotary table kept as a plain CPU tensor attribute and moved in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, WIDTH // HEADS, 2).float() / (WIDTH // HEADS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        angles = torch.arange(t, device=x.device).float()[:, None] * self.inv_freq.to(x.device)[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
        q, k, v = (y.view(b, t, HEADS, c // HEADS).transpose(1, 2) for y in self.qkv(x).split(c, dim=2))
        q, k = q * cos, k * cos
        mask = torch.ones(t, t, device=x.device, dtype=torch.bool).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(y.transpose(1, 2).contiguous().view(b, t, c))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([RotaryAttention() for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _block_flops(model: nn.Module, device: str) -> list[int]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
    return [block.flops for block in trace(model, (ids,)).blocks]


def test_flops_of_a_model_built_for_real_equal_its_meta_build_and_a_hand_count():
    torch.manual_seed(0)
    real = _block_flops(TinyLM(), "cpu")
    with torch.device("meta"):
        on_meta = _block_flops(TinyLM(), "meta")
    assert real == on_meta
    tokens = BATCH * SEQ
    linears = 2 * tokens * WIDTH * (3 * WIDTH + WIDTH)  # qkv and out projections
    attention = 2 * 2 * BATCH * HEADS * SEQ * SEQ * (WIDTH // HEADS)  # q @ k^T and weights @ v
    assert real[1] == real[2] >= linears + attention, real  # plus the element-wise work the counter may add
    assert real[1] <= 1.1 * (linears + attention), real
    assert real[-1] == 2 * tokens * WIDTH * VOCAB  # the head
