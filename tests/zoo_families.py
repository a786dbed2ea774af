"""More Hugging Face families for the model zoo, and the batches of the heads they add.

Each family is built from its default config (`AutoConfig.for_model`) with only tiny widths set
(hidden 32, 2 layers, 4 heads, a vocabulary of 128, 4 experts), plus the ids a tiny vocabulary
needs where a default id lies outside it; dropout and `use_cache` stay as they come. Gemma 2
and 3 get a sliding window of 8 (a width, shorter than the 16-token batches), so their
sliding-window layers really mask something.

The heads beyond tests/zoo_models.py's causal / mlm / seq2seq:
  speech-seq2seq  Whisper: float log-mel features (the main input), decoder ids and labels.
  image-class     ViT: float images and one class per image.
  clip-image      CLIP's image classifier (CLIPForImageClassification): CLIP's vision tower
                  with a linear head on its mean patch embedding, trained on classes. CLIP's
                  own contrastive loss needs an image-text batch and a loss the model computes
                  from its own two towers; the classifier trains CLIP's vision transformer (its
                  pre-norm, quick-gelu, class embedding) with a loss autopar computes from logits.

Module level (no test code) so the rank pool's spawned workers can import it; tests/zoo_models.py adds
these families to the zoo's CASES.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

IGNORE = -100
SEQ = 16
VOCAB = 128
SAMPLES = 32
IMAGE, PATCH, CHANNELS, CLASSES = 16, 4, 3, 10
MELS, FRAMES = 8, 16  # Whisper: 8 mel bins, 16 frames (its convolutions halve them to 8 positions)

_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64)
_MOE = dict(num_experts_per_tok=2)
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # for defaults outside a 128-token vocabulary
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS)

MORE_HF_FAMILIES: dict[str, tuple[str, dict]] = {
    # mixture of experts: a router, top-k and per-expert MLPs
    "mixtral": ("causal", dict(_DECODER, num_key_value_heads=2, num_local_experts=4, **_MOE)),
    "qwen2_moe": ("causal", dict(_DECODER, num_key_value_heads=2, num_experts=4, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64, **_MOE, **_IDS)),
    # sliding windows, soft-capping, sandwich norms
    "gemma2": ("causal", dict(_DECODER, num_key_value_heads=2, head_dim=8, sliding_window=8)),
    "gemma3_text": ("causal", dict(_DECODER, num_key_value_heads=2, head_dim=8, sliding_window=8)),
    # partial rotary, parallel attention and MLP, multi-query
    "gpt_neox": ("causal", dict(_DECODER)),
    "gptj": ("causal", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, bos_token_id=0,
                            eos_token_id=0)),
    "falcon": ("causal", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, bos_token_id=1,
                              eos_token_id=2)),
    "stablelm": ("causal", dict(_DECODER, num_key_value_heads=2)),
    "starcoder2": ("causal", dict(_DECODER, num_key_value_heads=2, **_IDS)),
    "mistral": ("causal", dict(_DECODER, num_key_value_heads=2)),
    "qwen2": ("causal", dict(_DECODER, num_key_value_heads=2, **_IDS)),
    "phi": ("causal", dict(_DECODER)),
    # a selective state-space scan instead of attention
    "mamba": ("causal", dict(hidden_size=32, state_size=8, num_hidden_layers=2)),
    # encoders
    "electra": ("mlm", dict(embedding_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64)),
    # encoder-decoders
    "bart": ("seq2seq", dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                             max_position_embeddings=64)),
    "whisper": ("speech-seq2seq", dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                       num_mel_bins=MELS, max_source_positions=FRAMES // 2,
                                       max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                       decoder_start_token_id=1)),
    # vision
    "vit": ("image-class", dict(_VISION, num_labels=CLASSES)),
    "clip": ("clip-image", dict(vision_config=_VISION, text_config=dict(hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB),
                                projection_dim=32, num_labels=CLASSES)),
}

# the token ids the batches use, where the family's are not zoo_models' (pad 0)
PAD_IDS = {"falcon": 0, "gptj": 0, "gpt_neox": 0, "stablelm": 0, "mixtral": 0, "mistral": 0, "phi": 0,
           "bart": 1}
DECODER_START = {"bart": 2, "whisper": 1}


def auto_class(head: str) -> Any:
    import transformers
    return {"causal": transformers.AutoModelForCausalLM, "mlm": transformers.AutoModelForMaskedLM,
            "seq2seq": transformers.AutoModelForSeq2SeqLM,
            "speech-seq2seq": transformers.AutoModelForSpeechSeq2Seq,
            "image-class": transformers.AutoModelForImageClassification,
            "clip-image": transformers.AutoModelForImageClassification}[head]


def config_of(family: str, widths: dict) -> Any:
    import transformers
    vocab = {} if family in ("vit", "clip") else {"vocab_size": VOCAB}
    return transformers.AutoConfig.for_model(family, **vocab, **widths)


def more_hf_model(family: str, head: str, **widths: Any) -> nn.Module:
    """`family` from its default config with only `widths` changed, built under the current default device."""
    import transformers
    from autopar.models.hf import quiet_transformers

    with quiet_transformers(transformers):
        config = config_of(family, widths)
        return auto_class(head).from_config(config)


# ----------------------------------------------------------------------------- datasets


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def speech_seq2seq(pad_id: int = 0, start_id: int = 1, seed: int = 9) -> list[dict]:
    """Whisper: float log-mel features (the main input, `inputs`), a right-padded decoder input
    starting with the decoder start id with its mask, labels the next token (-100 on pads)."""
    g = _generator(seed)
    samples = []
    for _ in range(SAMPLES):
        tgt_len = int(torch.randint(SEQ // 2 - 3, SEQ // 2 + 1, (), generator=g))
        target = torch.randint(3, VOCAB, (SEQ // 2,), generator=g)
        decoder_inputs = torch.cat([torch.tensor([start_id]), target[:-1]])
        decoder_mask = (torch.arange(SEQ // 2) < tgt_len).long()
        decoder_inputs[tgt_len:] = pad_id
        samples.append({"inputs": torch.randn(MELS, FRAMES, generator=g),
                        "decoder_input_ids": decoder_inputs, "decoder_attention_mask": decoder_mask,
                        "labels": torch.where(decoder_mask.bool(), target, torch.full_like(target, IGNORE))})
    return samples


def labelled_images(seed: int = 10) -> list[dict]:
    """Float images (the main input, `inputs`) and one class each."""
    g = _generator(seed)
    return [{"inputs": torch.randn(CHANNELS, IMAGE, IMAGE, generator=g),
             "labels": torch.randint(0, CLASSES, (), generator=g)} for _ in range(SAMPLES)]


def more_hf_data(family: str) -> list[dict]:
    from zoo_models import left_padded_lm, padded_mlm

    head, widths = MORE_HF_FAMILIES[family]
    pad = PAD_IDS.get(family, widths.get("pad_token_id", 0))
    if head == "causal":
        return left_padded_lm(pad)
    if head == "mlm":
        return padded_mlm(pad, mask_id=4, token_types=False)
    if head == "seq2seq":
        from zoo_models import padded_seq2seq  # (zoo_models imports this file at its end)
        return padded_seq2seq(pad, DECODER_START[family], lowest_id=3)
    if head == "speech-seq2seq":
        return speech_seq2seq(pad, DECODER_START[family])
    return labelled_images()
