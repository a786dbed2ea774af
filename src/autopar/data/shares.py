"""How many samples of each global batch each data-parallel replica takes.

Equal shares (the default) make a fast replica wait for a slow one at every step's gradient sum. Uneven
shares give each replica work in proportion to its speed, and training still equals one process: the
global batch is the same samples in the same order (data/sampler.py), each replica takes a contiguous
slice of it, and since every piece's loss is normalised over the whole global batch and the replicas'
gradients are summed (train/loss.py, data_parallel/grad_sync.py), a replica holding 3/4 of the samples
contributes exactly 3/4 of the gradient. Shares are whole micro-batches, so every micro-batch keeps its size.
"""

from __future__ import annotations

from ..errors import ConfigError

EVEN = "even"
AUTO = "auto"


def parse_weights(text: str, dp: int) -> tuple[float, ...] | None:
    """`--dp-shares` as relative weights per replica; None for "even" ("auto" is resolved before this)."""
    if text == EVEN:
        return None
    parts = [p.strip() for p in str(text).split(",")]
    try:
        weights = tuple(float(p) for p in parts)
    except ValueError:
        raise ConfigError(f"strategy.dp_shares (--dp-shares) must be 'even', 'auto' (from the --cluster file's "
                          f"device speeds) or one weight per replica, e.g. 3,1; got {text!r}") from None
    if len(weights) != dp:
        raise ConfigError(f"--dp-shares {text} lists {len(weights)} weight(s) but dp is {dp}; give one per "
                          f"replica (e.g. {','.join(['1'] * dp)})")
    if any(not w > 0 or w != w or w == float("inf") for w in weights):
        raise ConfigError(f"--dp-shares {text}: every weight must be a finite number > 0 (a replica with no "
                          f"samples would have nothing to sum); got {list(weights)}")
    return weights


def split_samples(weights: tuple[float, ...], global_batch_size: int, micro_batch_size: int) -> tuple[int, ...]:
    """Samples per replica: whole micro-batches, at least one each, in proportion to `weights` (largest
    remainder), summing to the global batch."""
    dp = len(weights)
    if global_batch_size % micro_batch_size:
        raise ConfigError(f"uneven --dp-shares split whole micro-batches: global_batch_size={global_batch_size} "
                          f"must be a multiple of micro_batch_size={micro_batch_size}")
    micro = global_batch_size // micro_batch_size
    if micro < dp:
        raise ConfigError(f"--dp-shares over dp={dp} replicas needs at least one micro-batch each, but the global "
                          f"batch holds {micro} micro-batch(es) of {micro_batch_size}; use a global batch of at "
                          f"least {dp * micro_batch_size} or a smaller micro_batch_size")
    total = sum(weights)
    spare = micro - dp  # one micro-batch each first, the rest by weight
    ideal = [w / total * micro - 1 for w in weights]
    counts = [max(0, int(x)) for x in ideal]
    while sum(counts) > spare:  # only when rounding the floors of tiny weights up overshoots
        counts[counts.index(max(counts))] -= 1
    order = sorted(range(dp), key=lambda k: (-(ideal[k] - counts[k]), k))
    for k in order[:spare - sum(counts)]:
        counts[k] += 1
    return tuple((c + 1) * micro_batch_size for c in counts)


def offsets(shares: tuple[int, ...]) -> tuple[int, ...]:
    """Where each replica's slice starts in the global batch."""
    out, at = [], 0
    for s in shares:
        out.append(at)
        at += s
    return tuple(out)
