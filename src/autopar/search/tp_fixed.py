"""What one rank of a tensor-parallel group still pays of a block's measured fixed seconds.

A measured block costs fixed + per-sequence x micro-batch seconds (measure_profile.py), timed whole (tp = 1). Under
tp the per-sequence part shrinks with the block's FLOPs on one rank (cost.StepModel.block_times). The fixed part is
two things that split differently:

    dispatch     each op's launch and autograd bookkeeping: a split layer runs as many ops, so it stays;
                 priced per traced op (ModelProfile.ops) at the calibration's per-op cost
                 (Cluster.per_action_overhead_s over the PROBE_OPS ops its probe runs)
    the rest     work that follows the weights whatever the batch (a matrix product over a few rows still
                 reads, and in the backward writes, its whole weight): it shrinks with the block's parameters
                 on one rank

Measured on this machine (thread CPU, one thread; a pre-norm block with Megatron's split as the runtime's TP
planner makes it): width 768, 64 tokens, the fixed forward+backward 20 ms whole, 5.0 ms at tp = 2 and 2.3 ms at
tp = 4 (one rank's share of the split layers); width 128, 128 tokens: 1.1, 0.8 and 0.8 ms. Keeping the whole
fixed part, as before, priced the width-768 block at tp = 4 three times what it took.
"""

from __future__ import annotations

from .cluster import Cluster
from .profile import ModelProfile

PROBE_OPS = 4
"""Forward ops of the calibration's per-action probe (calibrate.action_overhead: linear, relu, linear, sum): the
probe's seconds / PROBE_OPS is what one op's forward and backward cost beyond their arithmetic."""


def fixed_shares(profile: ModelProfile, cluster: Cluster, tp: int) -> list[float]:
    """Per block, the fraction of its measured fixed seconds one rank of a `tp` group pays: the ops' dispatch
    whole (at most all of the fixed part), the rest x the block's parameter share on one rank. All kept (1) at
    tp = 1, for a profile not measured, or without a traced op count."""
    if tp == 1 or not profile.ops or profile.measured is None:
        return [1.0] * profile.num_blocks
    per_op = cluster.per_action_overhead_s / PROBE_OPS
    shares = []
    for m, ops, mine, whole in zip(profile.measured, profile.ops, profile.at_tp(tp).params, profile.params):
        fixed = m.forward_fixed_s + m.backward_fixed_s
        dispatch = min(ops * per_op / fixed, 1.0) if fixed > 0 else 1.0
        shares.append(dispatch + (1.0 - dispatch) * (mine / whole if whole else 1.0))
    return shares
