"""The model zoo of tests/test_model_zoo.py: models as people build them, and their batches.

A case's `build` constructs the model on the current default device; `construct` builds it
the two ways users do: on meta (autopar materialises it, as for its `hf:` models) and for
real (seeded, on CPU, the README's default). Hugging Face families come from
`AutoConfig.for_model(family, ...)` with only tiny widths (and, where a default id lies
outside a tiny vocabulary, the pad/bos/eos ids) set: their default dropout and `use_cache`
are kept. The user modules are ordinary PyTorch: a Sequential stack, a ViT with bare
parameters, a U-Net on float images, a classifier with its own loss, a model with two
inputs, one whose blocks differ, and a nanoGPT-style GPT (fused qkv, tril mask buffer, tied
head, init in its constructor). Every dataset is a small in-memory list of dicts, padded
with attention masks wherever the model takes them, drawn from a fixed seed so every rank
and every run sees the same samples.

The datasets live in tests/zoo_data.py, the training of a case in tests/zoo_training.py. Module level (no
test code) so the rank pool's spawned workers can import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from zoo_data import (SEQ, VOCAB, classes, denoising, featured_lm, images, left_padded_lm, padded_mlm,  # noqa: F401
                      padded_seq2seq, plain_lm)  # (the zoo's datasets, also read from here by the other zoo files)

DROPOUT = 0.1  # the user modules' default, like most published models


# ----------------------------------------------------------------------------- Hugging Face families


def hf_model(family: str, head: str, **widths: Any) -> nn.Module:
    """`family` from its default config with only `widths` changed, with `head`, built on the
    current default device (the harness chooses meta or real, see `construct`)."""
    import transformers
    from autopar.models.hf import quiet_transformers

    auto = {"causal": transformers.AutoModelForCausalLM, "mlm": transformers.AutoModelForMaskedLM,
            "seq2seq": transformers.AutoModelForSeq2SeqLM}[head]
    with quiet_transformers(transformers):
        config = transformers.AutoConfig.for_model(family, vocab_size=VOCAB, **widths)
        return auto.from_config(config)


_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64)

HF_FAMILIES: dict[str, tuple[str, dict]] = {
    # decoder-only: left-padded causal LM batches
    "gpt2": ("causal", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)),
    "llama": ("causal", dict(_DECODER, num_key_value_heads=2)),
    "opt": ("causal", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=64, word_embed_proj_dim=32)),
    "phi3": ("causal", dict(_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "qwen3": ("causal", dict(_DECODER, num_key_value_heads=2, head_dim=8)),
    "gemma": ("causal", dict(_DECODER, num_key_value_heads=2, head_dim=8)),
    "olmo2": ("causal", dict(_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "bloom": ("causal", dict(hidden_size=32, n_layer=2, n_head=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gpt_bigcode": ("causal", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)),
    # encoders: right-padded masked LM batches
    "bert": ("mlm", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=64)),
    "roberta": ("mlm", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=64)),
    "distilbert": ("mlm", dict(dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64)),
    # encoder-decoder: padded source and target with both masks
    "t5": ("seq2seq", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                           relative_attention_num_buckets=8, relative_attention_max_distance=16)),
}


def hf_data(family: str) -> list[dict]:
    head, widths = HF_FAMILIES[family]
    pad = widths.get("pad_token_id", 1 if family in ("opt", "roberta") else 0)
    if head == "causal":
        return left_padded_lm(pad)
    if head == "mlm":
        return padded_mlm(pad, mask_id=4, token_types=family == "bert")
    return padded_seq2seq(pad)


# ----------------------------------------------------------------------------- user modules


class Block(nn.Module):
    """A pre-norm transformer block (causal or not) with dropout after attention and MLP.

    `qkv` is how the block gets q, k and v, in the styles people write: one fused linear
    reshaped to (3, heads, head_dim) (timm), one fused linear cut by `split` (nanoGPT) or by
    `chunk`, or three separate linears."""

    def __init__(self, width: int = 32, heads: int = 4, causal: bool = True, qkv: str = "separate"):
        super().__init__()
        self.heads, self.causal, self.style = heads, causal, qkv
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        if qkv == "separate":
            self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        else:
            self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.drop = nn.Dropout(DROPOUT)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, c = x.shape
        if self.style == "timm":
            q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            return q, k, v
        if self.style == "split":
            q, k, v = self.qkv(x).split(c, dim=2)
        elif self.style == "chunk":
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        return tuple(y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self._qkv(self.norm1(x))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.norm2(x)))


class SequentialLM(nn.Module):
    """The README's shape of model: embeddings, an nn.Sequential of blocks, a norm and a head."""

    def __init__(self, layers: int = 4, width: int = 32):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(SEQ, width)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.Sequential(*[Block(width, qkv="split") for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device)))
        return self.head(self.norm(self.blocks(x)))


class ViT(nn.Module):
    """A ViT-shaped classifier: patch convolution, bare cls token and position embedding
    (plain nn.Parameters of the model itself), a ModuleList of blocks, a class head.
    `reset_parameters` initialises the bare parameters, as timm-style models do; a subclass
    without it (ViTWithoutInit) leaves them to no rule at all."""

    def __init__(self, image: int = 16, patch: int = 4, width: int = 32, layers: int = 2, classes: int = 10):
        super().__init__()
        self.patch = nn.Conv2d(3, width, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.empty(1, 1, width))
        self.pos_embed = nn.Parameter(torch.empty(1, (image // patch) ** 2 + 1, width))
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList([Block(width, causal=False, qkv="timm") for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)
        if callable(self.reset_parameters):  # built for real, the bare parameters get values here
            self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.patch(inputs).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.drop(x + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class ViTWithoutInit(ViT):
    """The same ViT with no init for its bare parameters: on meta nothing covers cls_token/pos_embed."""

    reset_parameters = None  # type: ignore[assignment]


class UNet(nn.Module):
    """A small U-Net: two down levels, a bottleneck, two up levels joined to the down levels by
    long skips (concatenation), on float images."""

    def __init__(self, channels: int = 8):
        super().__init__()
        c = channels

        def conv(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.SiLU())

        self.stem = conv(1, c)
        self.down = nn.ModuleList([conv(c, 2 * c), conv(2 * c, 4 * c)])
        self.middle = conv(4 * c, 4 * c)
        self.up = nn.ModuleList([conv(8 * c, 2 * c), conv(4 * c, c)])
        self.out = nn.Conv2d(2 * c, 1, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        skips = [self.stem(inputs)]
        x = skips[0]
        for down in self.down:
            x = down(F.avg_pool2d(x, 2))
            skips.append(x)
        x = self.middle(x)
        for up in self.up:
            x = up(torch.cat([x, skips.pop()], dim=1))
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.out(torch.cat([x, skips.pop()], dim=1))


class TextClassifier(nn.Module):
    """Token classifier over the mean of a transformer's outputs; trained with its own loss."""

    def __init__(self, layers: int = 2, width: int = 32, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList([Block(width, causal=False) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(dim=1))


def smoothed_class_loss(output: torch.Tensor, batch: dict) -> torch.Tensor:
    """The classifier's own loss: label-smoothed cross-entropy, mean over the micro-batch."""
    return F.cross_entropy(output, batch["labels"], label_smoothing=0.1)


class TwoInputLM(nn.Module):
    """A causal LM reading two tensor fields: token ids and per-token float features."""

    def __init__(self, layers: int = 2, width: int = 32, features: int = 8):
        super().__init__()
        self.embed, self.features = nn.Embedding(VOCAB, width), nn.Linear(features, width)
        self.layers = nn.ModuleList([Block(width, qkv="chunk") for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.features(features)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class MixerBlock(nn.Module):
    """A block unlike Block: a depthwise causal convolution over time and a wider MLP."""

    def __init__(self, width: int = 32, kernel: int = 3):
        super().__init__()
        self.kernel = kernel
        self.norm = nn.LayerNorm(width)
        self.conv = nn.Conv1d(width, width, kernel, groups=width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Dropout(DROPOUT), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(self.norm(x).transpose(1, 2), (self.kernel - 1, 0))
        x = x + self.conv(h).transpose(1, 2)
        return x + self.mlp(x)


class MixedBlocksLM(nn.Module):
    """A causal LM whose ModuleList alternates attention blocks and convolution-mixer blocks."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList([Block(width), MixerBlock(width), Block(width), MixerBlock(width, kernel=5)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class NanoAttention(nn.Module):
    """Causal self-attention as nanoGPT writes it: one fused `c_attn` cut into q, k and v, the
    mask a registered lower-triangular buffer, dropout on the softmax matrix, and heads merged
    back with `transpose(1, 2).contiguous().view(B, T, C)`."""

    def __init__(self, width: int, heads: int, context: int):
        super().__init__()
        self.heads, self.width = heads, width
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.attn_dropout, self.resid_dropout = nn.Dropout(DROPOUT), nn.Dropout(DROPOUT)
        self.register_buffer("bias", torch.tril(torch.ones(context, context)).view(1, 1, context, context))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.width, dim=2)
        q, k, v = (y.view(B, T, self.heads, C // self.heads).transpose(1, 2) for y in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        scores = scores.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        weights = self.attn_dropout(F.softmax(scores, dim=-1))
        y = (weights @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, width: int, heads: int, context: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), NanoAttention(width, heads, context)
        self.ln_2, self.mlp = nn.LayerNorm(width), NanoMLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A GPT in the nanoGPT style: its parts in an nn.ModuleDict, learned positions from
    `torch.arange(t, device=idx.device)`, the token embedding tied to the head, and
    initialisation done in the constructor: `self.apply(self._init_weights)`, then every
    residual projection (`c_proj.weight`, found by name) drawn again with a smaller spread
    scaled by depth."""

    def __init__(self, layers: int = 4, width: int = 32, heads: int = 4, context: int = SEQ):
        super().__init__()
        self.layers = layers
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, width), wpe=nn.Embedding(context, width), drop=nn.Dropout(DROPOUT),
            h=nn.ModuleList([NanoBlock(width, heads, context) for _ in range(layers)]), ln_f=nn.LayerNorm(width)))
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied: one matrix reads tokens in and scores them out
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        positions = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def mse_loss(output: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.mse_loss(output, batch["labels"])


# ----------------------------------------------------------------------------- the cases

BUILDS = ("meta", "real")


@dataclass(frozen=True)
class Case:
    """A zoo model: `build` constructs it on the current default device (no arguments), `data`
    gives its samples. `only`: the one build the case has, and `why` says why not the other."""

    build: Callable[[], nn.Module]
    data: Callable[[], list[dict]]
    loss_fn: Callable | None = None  # None: autopar's token cross-entropy against labels
    only: str | None = None
    why: str = ""
    meta_init: Callable[[nn.Module], None] | None = None  # the meta build's Trainer(init_fn=...), if it needs one

    @property
    def builds(self) -> tuple[str, ...]:
        return BUILDS if self.only is None else (self.only,)


def construct(case: Case, build: str) -> nn.Module:
    """Build `case` the way users do: on meta (autopar materialises it) or for real, seeded, so
    every process holds the same weights."""
    if build == "meta":
        with torch.device("meta"):
            return case.build()
    if build == "real":
        torch.manual_seed(0)
        return case.build()
    raise ValueError(f"build {build!r}: one of {BUILDS}")


def module_dict_llama() -> nn.Module:
    """A llama written with its layers in an nn.ModuleDict and its rotary table made in forward."""
    from block_stack_models import DictLlama
    return DictLlama(vocab=VOCAB)


def attribute_blocks_lm() -> nn.Module:
    """Blocks held as attributes h0..h3, each with an nn.Sequential MLP inside."""
    from block_stack_models import AttributeBlocksLM
    return AttributeBlocksLM(vocab=VOCAB, seq=SEQ)


def transformer_encoder_lm() -> nn.Module:
    """torch's own nn.TransformerEncoder at its default dropout (0.1, inside its attention too)."""
    from random_ops_models import EncoderLM
    return EncoderLM()


def frozen_backbone_lm() -> nn.Module:
    """A fine-tune: the token embedding and the first block frozen, the rest trained."""
    model = SequentialLM()
    model.embed.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    return model


def _hf_case(family: str) -> Case:
    head, widths = HF_FAMILIES[family]
    return Case(lambda: hf_model(family, head, **widths), lambda: hf_data(family))


USER_CASES: dict[str, Case] = {
    "sequential-lm": Case(SequentialLM, plain_lm),
    "vit-bare-params": Case(ViT, images),
    "unet-float": Case(UNet, denoising, mse_loss),
    "classifier-custom-loss": Case(TextClassifier, classes, smoothed_class_loss),
    "two-input-lm": Case(TwoInputLM, featured_lm),
    "mixed-blocks-lm": Case(MixedBlocksLM, plain_lm),
    # on meta its constructor's init (c_proj re-drawn by name) is replayed (without it: REFUSED_CASES)
    "nanogpt": Case(NanoGPT, plain_lm, meta_init=autopar.replay_init(NanoGPT)),
    "llama-module-dict": Case(module_dict_llama, plain_lm),
    "attribute-blocks": Case(attribute_blocks_lm, plain_lm),
    "transformer-encoder": Case(transformer_encoder_lm, plain_lm),
    "frozen-backbone": Case(frozen_backbone_lm, plain_lm),
}

CASES: dict[str, Case] = {
    **{f"hf:{family}": _hf_case(family) for family in HF_FAMILIES},
    **USER_CASES,
}

# tests/zoo_families.py: 18 more families, with the batches of the heads they add
from zoo_families import MORE_HF_FAMILIES, more_hf_data, more_hf_model  # noqa: E402
CASES.update({f"hf:{f}": Case(lambda f=f: more_hf_model(f, MORE_HF_FAMILIES[f][0], **MORE_HF_FAMILIES[f][1]),
                              lambda f=f: more_hf_data(f)) for f in MORE_HF_FAMILIES})

REFUSED_CASES: dict[str, Case] = {
    # on meta with no rule for cls_token/pos_embed: a clear error naming them, never NaN losses
    "vit-without-init": Case(ViTWithoutInit, images, only="meta", why="for real its bare parameters hold garbage"),
    # 3 heads: tp=2 cannot split attention, which the README promises is a clear error
    "hf:gpt2-3-heads": Case(lambda: hf_model("gpt2", "causal", **{**HF_FAMILIES["gpt2"][1], "n_embd": 48, "n_head": 3}),
                            lambda: hf_data("gpt2")),
    # on meta with no init_fn, an init done in the constructor (apply(_init_weights), then c_proj
    # re-drawn by name) is refused rather than half-done; CASES["nanogpt"] passes replay_init
    "nanogpt": Case(NanoGPT, plain_lm, only="meta", why="built for real, or with replay_init, it is in CASES"),
}
