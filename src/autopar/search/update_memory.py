"""Bytes one stage holds beyond its model state while the step updates: gradient clipping, then the optimizer.

After the last backward a rank has freed every activation and sent tensor (pipeline/p2p.py wait_sends), but the
update makes temporaries of its own, which can be the step's peak when activations are small (a stage holding
only the embeddings, ZeRO-1 with a small micro-batch). Measured per phase with search/live_memory.py:

  clipping      the global norm is summed in float64, one tensor at a time: `g.double().square().sum()` keeps a
                float64 copy and its square, 16 bytes per element of the largest tensor squared at once:
                  pipeline engine (pp or tp > 1), replicated gradients: the largest parameter's gradient
                  ZeRO-3 (FSDP2): the largest gradient shard (1/dp of the largest parameter)
                  sharded gradients (ZeRO-1/2, and bf16's fp32 master gradients even without ZeRO): a whole
                    bucket's shard at once (zero/grads.py squared_norms) where every parameter of the bucket
                    counts alike, one parameter's piece at a time under tp (sharded and replicated weights mix)
                  data-parallel engine, replicated: none (torch's clip_grad_norm_ takes per-tensor norms)
  optimizer     torch's fused AdamW (train/optim.py) steps in place: nothing. ZeRO-1/2 then all-gathers the
                updated shards into a new full flat buffer per bucket, every bucket launched before the first
                lands (zero/optimizer.py gather_parameters): the stage's parameters once more, plus under bf16
                each shard cast to bf16 first (also at zero 0, whose fp32 masters are cast back to the
                parameters the same way, without the gather)

The two happen one after the other, so the update holds the larger of them. Bucket sizes follow the runtime's
default (BUCKET_BYTES of the parameters' dtype; a parameter larger than that has a bucket of its own).
"""

from __future__ import annotations

BUCKET_BYTES = 25 * 2**20  # the data-parallel and ZeRO gradient bucket (the runtime's default size)
CLIP_BYTES_PER_ELEMENT = 16.0  # a float64 copy of a gradient and its square, alive together


def update_bytes(param_elements: float, largest_param: float, *, zero: int, dp: int, tp: int, pipelined: bool,
                 bf16_master: bool, clip: bool = True) -> float:
    """Bytes beyond the model state one stage holds at the update's peak (see the module docstring).

    `param_elements`: the stage's parameters on this rank; `largest_param`: its largest parameter tensor's
    elements on this rank (0 when unknown: clipping then priced as nothing); `pipelined`: the pipeline engine
    runs the stage (pp or tp > 1), else the data-parallel engine; `clip`: gradients are clipped (--grad-clip > 0)."""
    element = 2.0 if bf16_master else 4.0
    sharded = zero in (1, 2) or (bf16_master and zero == 0)  # gradients live in zero/grads.py's flat buckets
    world = dp if zero in (1, 2) else 1  # the replicas a bucket is split over
    clipping = 0.0
    if clip:
        if zero == 3:
            clipping = CLIP_BYTES_PER_ELEMENT * largest_param / max(dp, 1)
        elif sharded:
            bucket = min(param_elements, max(BUCKET_BYTES / element, largest_param))
            squared = min(largest_param, bucket / world) if tp > 1 else bucket / world
            clipping = CLIP_BYTES_PER_ELEMENT * squared
        elif pipelined:
            clipping = CLIP_BYTES_PER_ELEMENT * largest_param
    gathered = 0.0
    if sharded:
        cast = 2.0 * param_elements / world if bf16_master else 0.0  # each shard cast to bf16 (fp32: the shard itself)
        whole = element * param_elements if world > 1 else 0.0  # the all-gather's output
        gathered = cast + whole
    return max(clipping, gathered)
