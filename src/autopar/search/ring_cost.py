"""What ring and all-to-all attention cost a context-parallel rank on this machine, measured as its blocks are.

Why measured: a cp rank does not run the model's fused attention kernel on fewer tokens. Ring attention
(context_parallel/ring.py) is written out: per pass and per chunk pair it computes fp32 scores, masks
them, takes exponentials and merges the partial results by the online softmax, forward and again in the
backward, dozens of small ops where the kernel runs one. Priced as 1/cp of the measured kernel, cp plans
read 18-31% fast on CPU (their attention alone ran 4-11x the priced time at gpt-mini's sizes). So, for each
cp degree the sequence allows, one rank's ring work is timed in this process (a loopback ring: the same
passes, pairs, skips and merges, no exchange, which dimensions.py prices apart) against the model's own
kernel over the whole sequence, both at two micro-batch sizes, one thread, process CPU time (a shared
machine's other processes do not count), fitted as fixed + per sequence like measure_profile.py's blocks.

All-to-all attention (context_parallel/all_to_all.py) is measured the same way: it runs the model's kernel
over T with H/cp heads (1/cp of the kernel's work), but around it each swap lays out a send buffer, reorders
the received tokens to sequence order and back, forward and backward. Priced as the kernel's share plus the
calibrated collectives alone, gpt-mini's cp=2 all-to-all read 24-34% fast; at cp=2 on gpt-mini's shapes (8
sequences, 4 heads x 128 tokens) one attention's forward and backward took about 4 ms of CPU, its kernel 1.6.
The loopback runs every copy and reorder of one rank, the exchange a local copy of the same bytes (the
collective dimensions.py prices apart).

What is kept per cp, per attention: ring(T/cp) - kernel(T)'s share the T/cp profile already holds (its fixed
part whole, its per-sequence part / cp), and the same for all-to-all. Stated approximations: the first
attention's shape stands for all, keys and values at the query heads (the rewrite repeats grouped heads), no
padding mask, no window.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

from .profile import AttentionCosts, ModelProfile

CP_DEGREES = (2, 4, 8)  # the degrees measured (those the sequence splits into 2 x cp chunks)
MICRO_BATCHES = (1, 4)
REPEATS = {"ring": 3, "all-to-all": 7}  # timed runs per point (median): the all-to-all's few ms vary more, cost less
_clock = time.thread_time


def _timed(run, repeats: int) -> tuple[float, float]:
    """Median forward and backward CPU seconds of `run()` -> (output, inputs), after one warm-up."""
    forwards, backwards = [], []
    for i in range(repeats + 1):
        start = _clock()
        out = run()
        middle = _clock()
        out.sum().backward()
        end = _clock()
        if i:
            forwards.append(middle - start)
            backwards.append(end - middle)
    return statistics.median(forwards), statistics.median(backwards)


def _inputs(batch: int, heads: int, tokens: int, head_dim: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, tokens, head_dim, generator=g).requires_grad_() for _ in range(3)]


def _kernel(att: AttentionCosts, batch: int, tokens: int, repeats: int) -> tuple[float, float]:
    """The model's own attention call over the whole sequence (its mask as a tensor where it passes one)."""
    q, k, v = _inputs(batch, att.heads, tokens, att.head_dim, 0)
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril() if att.masked and att.causal else None
    causal = att.causal and mask is None
    return _timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal), repeats)


def _ring(att: AttentionCosts, batch: int, tokens: int, cp: int, repeats: int) -> tuple[float, float]:
    from ..context_parallel.ring import loopback_ring_attention
    q, k, v = _inputs(batch, att.heads, tokens // cp, att.head_dim, 1)
    scale = att.head_dim ** -0.5
    return _timed(lambda: loopback_ring_attention(q, k, v, causal=att.causal, scale=scale, cp=cp, rank=0), repeats)


def _swapped(att: AttentionCosts, batch: int, tokens: int, cp: int, repeats: int) -> tuple[float, float]:
    from ..context_parallel.all_to_all import loopback_all_to_all_attention
    q, k, v = _inputs(batch, att.heads, tokens // cp, att.head_dim, 2)
    scale = att.head_dim ** -0.5
    return _timed(lambda: loopback_all_to_all_attention(q, k, v, causal=att.causal, scale=scale, cp=cp), repeats)


def _fit(small: float, large: float) -> tuple[float, float]:
    lo, hi = MICRO_BATCHES
    per = max(0.0, (large - small) / (hi - lo))
    return max(0.0, small - per * lo), per


def measure_ring_seconds(att: AttentionCosts, seq_len: int, *, degrees: tuple[int, ...] = CP_DEGREES,
                         repeats: int | None = None, mode: str = "ring",
                         ) -> dict[int, tuple[float, float, float, float]]:
    """Per cp degree that splits `seq_len` into 2 x cp chunks (and, all-to-all, the heads into cp groups):
    (forward fixed, forward per sequence, backward fixed, backward per sequence) seconds one attention of `mode`
    ("ring" or "all-to-all") adds over its T/cp share of the model's kernel."""
    degrees = tuple(cp for cp in degrees if cp > 1 and seq_len % (2 * cp) == 0
                    and (mode == "ring" or att.heads % cp == 0))
    if not att.head_dim or not degrees:
        return {}
    rank_work = _ring if mode == "ring" else _swapped
    repeats = repeats or REPEATS[mode]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank runs
    try:
        kernel = [_kernel(att, b, seq_len, repeats) for b in MICRO_BATCHES]
        (kff, kfs), (kbf, kbs) = _fit(kernel[0][0], kernel[1][0]), _fit(kernel[0][1], kernel[1][1])
        out = {}
        for cp in degrees:
            work = [rank_work(att, b, seq_len, cp, repeats) for b in MICRO_BATCHES]
            (rff, rfs), (rbf, rbs) = _fit(work[0][0], work[1][0]), _fit(work[0][1], work[1][1])
            out[cp] = (rff - kff, rfs - kfs / cp, rbf - kbf, rbs - kbs / cp)
        return out
    finally:
        torch.set_num_threads(threads)


def with_ring_seconds(profile: ModelProfile, **kwargs) -> ModelProfile:
    """`profile` with its attention's ring and all-to-all seconds measured (unchanged without an attention)."""
    att = profile.attention
    if att is None or not any(att.layers):
        return profile
    return dataclasses.replace(profile, attention=dataclasses.replace(
        att, ring_seconds=measure_ring_seconds(att, profile.seq_len, **kwargs),
        all_to_all_seconds=measure_ring_seconds(att, profile.seq_len, mode="all-to-all", **kwargs)))


def ring_adjusted(profile: ModelProfile, cp: int, mode: str = "ring") -> ModelProfile:
    """The T/cp profile (measured blocks) with each block's attentions priced as the ring's (or all-to-all's)
    measured work instead of their share of the kernel: what a cp rank computes. Unchanged where not measured."""
    att, measured = profile.attention, profile.measured
    seconds = (att.ring_seconds if mode == "ring" else att.all_to_all_seconds) if att is not None else {}
    if measured is None or cp not in seconds:
        return profile
    ff, fs, bf, bs = seconds[cp]

    def adjusted(m, layers: int):
        if not layers:
            return m
        changes = {"forward_fixed_s": m.forward_fixed_s + layers * ff,
                   "forward_per_seq_s": m.forward_per_seq_s + layers * fs,
                   "backward_fixed_s": m.backward_fixed_s + layers * bf,
                   "backward_per_seq_s": m.backward_per_seq_s + layers * bs}
        if m.input_fixed_s is not None:  # attention has no weights: its backward is all input gradient (I)
            changes.update(input_fixed_s=m.input_fixed_s + layers * bf, input_per_seq_s=m.input_per_seq_s + layers * bs)
        return dataclasses.replace(m, **{k: max(v, 0.0) for k, v in changes.items()})
    blocks = tuple(adjusted(m, n) for m, n in zip(measured, att.layers))
    return dataclasses.replace(profile, measured=blocks)
