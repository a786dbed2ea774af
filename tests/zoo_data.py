"""The model zoo's datasets (tests/zoo_models.py): small in-memory lists of dicts, padded with attention masks
wherever the model takes them, drawn from a fixed seed so every rank and every run sees the same samples.

Module level (no test code) so the rank pool's spawned workers can import it.
"""

from __future__ import annotations

import torch

IGNORE = -100
SEQ = 16
VOCAB = 128
SAMPLES = 32  # 2 steps of 8 samples, drawn from 32

def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def left_padded_lm(pad_id: int = 0, seed: int = 1) -> list[dict]:
    """Causal LM: up to 6 pad tokens on the left, masked out; labels as Hugging Face's collators make them:
    the input ids, -100 on pads (the model's loss scores each position against the next label)."""
    g = _generator(seed)
    samples = []
    for _ in range(SAMPLES):
        tokens = torch.randint(3, VOCAB, (SEQ,), generator=g)
        pad = int(torch.randint(0, 7, (), generator=g))
        inputs, labels = tokens.clone(), tokens.clone()
        inputs[:pad], labels[:pad] = pad_id, IGNORE
        mask = torch.ones(SEQ, dtype=torch.long)
        mask[:pad] = 0
        samples.append({"input_ids": inputs, "attention_mask": mask, "labels": labels})
    return samples


def padded_mlm(pad_id: int, mask_id: int, token_types: bool, seed: int = 2) -> list[dict]:
    """Masked LM: right padding (masked out), 25% of real tokens masked and predicted; BERT gets
    two segments in token_type_ids."""
    g = _generator(seed)
    samples = []
    for _ in range(SAMPLES):
        length = int(torch.randint(SEQ - 6, SEQ + 1, (), generator=g))
        original = torch.randint(5, VOCAB, (SEQ,), generator=g)
        chosen = (torch.rand(SEQ, generator=g) < 0.25) & (torch.arange(SEQ) < length)
        chosen[0] = True  # at least one target per sample
        inputs = torch.where(chosen, torch.full_like(original, mask_id), original)
        inputs[length:] = pad_id
        sample = {"input_ids": inputs, "attention_mask": (torch.arange(SEQ) < length).long(),
                  "labels": torch.where(chosen, original, torch.full_like(original, IGNORE))}
        if token_types:
            sample["token_type_ids"] = (torch.arange(SEQ) >= length // 2).long() * sample["attention_mask"]
        samples.append(sample)
    return samples


def padded_seq2seq(pad_id: int = 0, start_id: int | None = None, lowest_id: int = 2, seed: int = 3) -> list[dict]:
    """T5 and BART: a right-padded source with its mask, a right-padded decoder input starting with
    the decoder start id (T5's is the pad id, the default) with its mask, labels the next target
    token (-100 on pads); tokens drawn from lowest_id up, above the special ids."""
    start_id = pad_id if start_id is None else start_id
    g = _generator(seed)
    samples = []
    for _ in range(SAMPLES):
        src_len = int(torch.randint(SEQ - 6, SEQ + 1, (), generator=g))
        tgt_len = int(torch.randint(SEQ // 2 - 3, SEQ // 2 + 1, (), generator=g))
        source = torch.randint(lowest_id, VOCAB, (SEQ,), generator=g)
        source[src_len:] = pad_id
        target = torch.randint(lowest_id, VOCAB, (SEQ // 2,), generator=g)
        decoder_inputs = torch.cat([torch.tensor([start_id]), target[:-1]])
        decoder_mask = (torch.arange(SEQ // 2) < tgt_len).long()
        decoder_inputs[tgt_len:] = pad_id
        labels = torch.where(decoder_mask.bool(), target, torch.full_like(target, IGNORE))
        samples.append({"input_ids": source, "attention_mask": (torch.arange(SEQ) < src_len).long(),
                        "decoder_input_ids": decoder_inputs, "decoder_attention_mask": decoder_mask,
                        "labels": labels})
    return samples


def images(seed: int = 4) -> list[dict]:
    """Float images and their (fixed random) classes."""
    g = _generator(seed)
    return [{"inputs": torch.randn(3, 16, 16, generator=g), "labels": torch.randint(0, 10, (), generator=g)}
            for _ in range(SAMPLES)]


def denoising(seed: int = 5) -> list[dict]:
    """Noisy 1-channel images; the target is the clean image (a smooth pattern)."""
    g = _generator(seed)
    grid = torch.linspace(-1, 1, 16)
    samples = []
    for _ in range(SAMPLES):
        fx, fy = torch.rand(2, generator=g) * 3
        clean = torch.sin(fx * grid)[:, None] * torch.cos(fy * grid)[None, :]
        noisy = clean + 0.3 * torch.randn(16, 16, generator=g)
        samples.append({"inputs": noisy[None], "labels": clean[None]})
    return samples


def classes(seed: int = 6) -> list[dict]:
    g = _generator(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=g), "labels": torch.randint(0, 4, (), generator=g)}
            for _ in range(SAMPLES)]


def featured_lm(seed: int = 7) -> list[dict]:
    g = _generator(seed)
    samples = []
    for _ in range(SAMPLES):
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        samples.append({"input_ids": tokens[:-1], "features": torch.randn(SEQ, 8, generator=g), "labels": tokens[1:]})
    return samples


def plain_lm(seed: int = 8) -> list[dict]:
    g = _generator(seed)
    return [{"input_ids": (t := torch.randint(0, VOCAB, (SEQ + 1,), generator=g))[:-1], "labels": t[1:]}
            for _ in range(SAMPLES)]
