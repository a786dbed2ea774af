"""One real step of the model calibrates the level of the time-shared bound (CPU hosts only).

The step model prices a time-shared step as its modelled CPU over the cores the ranks get (cost.py,
Cluster.cores_per_node from the sharing probe). Its shape holds well (benchmarks/strategy_search.py: rank
correlation 0.9-0.98), but its level misses what a real step adds when ranks share cores: caches refilled
after every switch between ranks, the trainer's own per-step work, gloo threads that poll while busy. They
vary with the model and the machine's state, so no synthetic probe measures them; one step of the model
itself does. The reference is the plainest layout every model runs (replicated data parallelism, one
micro-batch, no recomputation): its measured step time over its predicted bound is the factor
(Cluster.time_shared_scale) every bound is multiplied by.

A uniform factor leaves the search's ranking of bound-ruled configurations unchanged; where a reference was
measured it makes the predicted times mean seconds on this machine. `autopar calibrate` knows no model and
writes 1; the validation benchmark measures the reference in the same launch as the configurations it checks
and leaves it out of its error statistics.
"""

from __future__ import annotations

from ..errors import ConfigError
from .cost import Candidate, Estimate


def reference_candidate(nproc: int, global_batch_size: int) -> Candidate:
    """Replicated data parallelism over every rank, one micro-batch each: no pipeline, no TP, no ZeRO."""
    if global_batch_size % nproc:
        raise ConfigError(f"reference step: global batch size {global_batch_size} does not split over {nproc} ranks; "
                          f"use a multiple of {nproc}")
    return Candidate(dp=nproc, tp=1, pp=1, micro_batch_size=global_batch_size // nproc, num_microbatches=1,
                     schedule="1f1b", recompute="none", partition="uniform", zero=0)


def time_shared_scale(measured_step_s: float, reference: Estimate) -> float:
    """Measured step time of the reference over its predicted time-shared bound (the factor that makes them equal).

    1 when the bound does not rule the reference (each rank has a core: nothing is time-shared) or nothing was
    measured. `reference` must be scored with the scale at 1."""
    bound = reference.parts.get("time_shared_s", 0.0)
    if measured_step_s <= 0 or bound <= 0 or bound < reference.parts.get("timeline_step_s", 0.0):
        return 1.0
    return measured_step_s / bound



def reference_profile():
    """The calibration's reference model (reference_step.py) as the search sees a user's model: traced, and its
    blocks measured on this machine, one thread (measure_profile.py)."""
    import torch

    from ..trace import trace
    from .measure_profile import measure_module_blocks, with_measured_blocks
    from .profile import profile_graph
    from .reference_step import SEQ_LEN, ReferenceGPT
    with torch.device("meta"):
        model = ReferenceGPT()
    graph = trace(model, (torch.zeros(1, SEQ_LEN, dtype=torch.long, device="meta"),))
    profile = profile_graph(graph, name="calibration reference", seq_len=SEQ_LEN)
    blocks = measure_module_blocks(model, seq_len=SEQ_LEN, repeats=3)
    return with_measured_blocks(profile, blocks)  # the reference updates as the trainer does (fused AdamW)


def reference_level(cluster, measured_step_s: float, profile=None) -> float:
    """Cluster.time_shared_scale from the calibration's reference step (reference_step.py) on `cluster`'s
    ranks: the same model and step priced as the search prices a user's model (`profile`, default
    reference_profile(); replicated data parallelism over every rank), the measured time over that bound."""
    from .cost import StepModel
    from .reference_step import MICRO_BATCH
    nproc = cluster.num_devices
    step = StepModel(profile or reference_profile(), cluster.replace(time_shared_scale=1.0),
                     global_batch_size=MICRO_BATCH * nproc)
    return time_shared_scale(measured_step_s, step.evaluate(reference_candidate(nproc, MICRO_BATCH * nproc)))
