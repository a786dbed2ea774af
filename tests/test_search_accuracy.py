"""The strategy search's memory model against a measured peak, and its measuring tools.

The measured quantity is the one the model predicts: peak bytes of live tensors per rank
(search/live_memory.py), not the resident set (which holds the Python/torch/gloo runtime).
The case is the one the FLOP-based model got worst (stage 0 +73%, stage 1 -29%): a 2-stage
1F1B pipeline of gpt-tiny with 4 micro-batches, where stage 0 holds 2 micro-batches' activations
and stage 1 one, plus the loss's softmax; and the same under zb-h1, whose I keeps the gradients
at every weight-consuming op for its W (and the graph with them), which the model once left out
(-20..-50% on the worst rank). Stated error: 20% per rank (the issue's target).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.search.cluster import resolve_cluster
from autopar.search.cost import Candidate, StepModel
from autopar.search.live_memory import LiveTensorPeak
from autopar.search.measure_profile import measure_blocks, with_measured_blocks
from autopar.search.profile import profile_model

SEQ_LEN = 64
GLOBAL_BATCH, MICRO_BATCH = 16, 4
MEMORY_TOLERANCE = 0.20


CASES = {  # name -> the strategy on 2 ranks (4 micro-batches of 4)
    "1f1b": dict(pp=2, schedule="1f1b", partition="uniform"),
    "zb-h1": dict(pp=2, schedule="zb-h1", partition="uniform"),
    # FSDP2 refills its gathered parameters by resizing storages (live_memory.fsdp_resizable_tensors)
    "dp2-zero3": dict(dp=2, zero=3),
    # the fp32 master shards and their gradients live in the optimizer, not the model
    "dp2-zero1": dict(dp=2, zero=1),
    # no pipeline, no TP: the engine runs the model itself, which keeps less than its traced stages (hf:llama's
    # layers 0.8x; measure_profile.BlockCosts.eager_saved_per_seq); the traced bytes over-predicted by 25-29%
    "llama-dp2-zero2": dict(dp=2, zero=2),
}
MODEL_OF = {"llama-dp2-zero2": "hf:llama"}  # default gpt-tiny
TOLERANCE_OF = {"llama-dp2-zero2": 0.10}  # the traced bytes miss this one (the test's default llama) by 16%


def _pipeline_peak(out: str, case: str) -> int:
    """On each of 2 ranks: gpt-tiny (or MODEL_OF[case]), 4 micro-batches of CASES[case]; this rank's peak live tensor bytes of step 2."""
    import autopar
    from autopar.data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
    from autopar.models import build_model
    from autopar.search.live_memory import step_peak_bytes
    tokenizer = build_tokenizer("byte")
    model, info = build_model(MODEL_OF.get(case, "gpt-tiny"), {}, vocab_size=padded_vocab_size(tokenizer.vocab_size), device="meta")
    train, _ = build_datasets(load_corpus("stdlib"), tokenizer, seq_len=SEQ_LEN, task=info.task, seed=0)
    trainer = autopar.Trainer(model, train, strategy=autopar.Strategy(**CASES[case]),
                              config=autopar.TrainConfig(steps=10, global_batch_size=GLOBAL_BATCH,
                                                         micro_batch_size=MICRO_BATCH, progress=False, out=out))
    trainer._setup()
    trainer.train_step(0)  # gradient buffers and optimizer states exist from here on
    try:
        return step_peak_bytes(trainer, 1)
    finally:
        trainer.engine.close()


@pytest.mark.parametrize("case", list(CASES))
def test_memory_model_matches_measured_pipeline_peak(rank_pool, tmp_path, case):
    measured = rank_pool(2).run(_pipeline_peak, str(tmp_path), case)
    strategy = CASES[case]
    dp, pp, schedule = strategy.get("dp", 1), strategy.get("pp", 1), strategy.get("schedule", "1f1b")
    name = MODEL_OF.get(case, "gpt-tiny")
    profile = with_measured_blocks(profile_model(name, seq_len=SEQ_LEN), measure_blocks(name, seq_len=SEQ_LEN, repeats=1))
    cluster = resolve_cluster("cpu-local", nproc=2).replace(memory_headroom=1.0)  # the live bytes themselves
    estimate = StepModel(profile, cluster, global_batch_size=GLOBAL_BATCH).evaluate(
        Candidate(dp=dp, tp=1, pp=pp, micro_batch_size=MICRO_BATCH, num_microbatches=GLOBAL_BATCH // MICRO_BATCH // dp,
                  schedule=schedule, partition="uniform", zero=strategy.get("zero", 0)))
    predicted = [estimate.memory_per_rank[r * pp // 2] for r in range(2)]  # a stage's dp replicas are consecutive
    errors = [(want - got) / got for want, got in zip(predicted, measured)]
    assert all(abs(e) <= TOLERANCE_OF.get(case, MEMORY_TOLERANCE) for e in errors), (
        f"predicted {[round(v / 2**20, 2) for v in predicted]} MiB per rank, measured "
        f"{[round(v / 2**20, 2) for v in measured]} MiB: errors {[f'{e:+.0%}' for e in errors]}")
    if case == "1f1b":
        assert measured[0] > measured[1]  # stage 0 holds more micro-batches in flight, as the model says
        # the data-parallel engine's update (its foreach norm) is timed beside the other engines' float64 one
        assert all(b.update_foreach_norm_s > 0 for b in profile.measured if b.update_s > 0)


def test_live_tensor_peak_counts_new_storages_once_and_frees_them():
    weight = torch.zeros(1000)  # resident: never counted
    outside = torch.zeros(500)  # made before counting: its views are not new memory either
    with LiveTensorPeak({weight.untyped_storage().data_ptr()}) as counter:
        a = weight + 1  # 4000 bytes
        b = a.view(10, 100)  # a view: no new storage
        a.mul_(2)  # in place: nothing new
        c = outside[:100]  # a view of an older storage
        d = torch.ones(250)  # 1000 bytes; live 5000
        del a, b, d  # 0 live
        e = torch.ones(100)  # 400 bytes
    assert counter.peak == 5000
    assert counter.live == 400
    del c, e


def test_live_tensor_peak_sees_storages_resized_in_place():
    """FSDP2 frees and refills its gathered parameters by resizing a storage made earlier; no op says so."""
    gathered = torch.zeros(1000)  # 4000 bytes, made before counting, then freed as FSDP2 does
    gathered.untyped_storage().resize_(0)
    with LiveTensorPeak(resizable=[gathered]) as counter:
        a = torch.ones(100)  # 400 bytes
        gathered.untyped_storage().resize_(4000)  # all-gathered again: 4400 alive
        b = a + 1  # 400 more: 4800
        gathered.untyped_storage().resize_(0)  # resharded
        del a, b
        c = torch.ones(10)
    assert counter.peak == 4800
    del c


def _toy(measured=None):
    from autopar.search.cluster import Cluster, Link
    from autopar.search.profile import ModelProfile, TPProfile
    flops, params, saved = (1e5, 4e6, 4e6, 2e6), (1000, 2000, 2000, 500), (1e4, 1e5, 1e5, 5e4)
    tp1 = TPProfile(1, flops, params, saved, (0.0,) * 4, (0,) * 4)
    tp2 = TPProfile(2, (1e5, 2e6, 2e6, 2e6), (1000, 1000, 1000, 500), saved, (0.0,) * 4, (0,) * 4)
    profile = ModelProfile(name="toy", seq_len=8, block_names=("a", "b", "c", "d"), flops=flops, saved_bytes=saved,
                           params=params, boundary_bytes=(1e3,) * 3, shared_params=0, tp={1: tp1, 2: tp2},
                           measured=measured)
    cluster = Cluster(name="toy", source="test", num_devices=8, devices_per_node=8, memory_per_device_gb=1.0,
                      flops_per_s={"fp32": 1e9}, compute_efficiency=1.0, memory_bandwidth_bytes_per_s=1e10,
                      intra_node=Link(0.0, 1e12), inter_node=Link(0.0, 1e12))
    return profile, cluster


def test_time_sharing_charges_summed_work_over_cores():
    profile, cluster = _toy()
    c = Candidate(dp=8, tp=1, pp=1, micro_batch_size=1, num_microbatches=1)
    alone = StepModel(profile, cluster, global_batch_size=8).evaluate(c)
    shared = StepModel(profile, cluster.replace(cores_per_node=2), global_batch_size=8).evaluate(c)
    # 8 equal replicas on 2 cores: each core runs 4 replicas' compute and optimizer (the all-reduce is free here)
    work = alone.parts["pipeline_s"] + alone.parts["optimizer_s"]
    # rel 1e-3: the timeline's busy time comes from stage costs rounded to 3 digits (timeline.normalised)
    assert shared.step_time_s == pytest.approx(8 * work / 2, rel=1e-3)
    assert StepModel(profile, cluster.replace(cores_per_node=8), global_batch_size=8).evaluate(c).step_time_s == \
        pytest.approx(alone.step_time_s)  # a core per rank: no sharing


def test_measured_block_costs_replace_flops_and_scale_with_tp():
    from autopar.search.measure_profile import BlockCosts
    blocks = tuple(BlockCosts(forward_fixed_s=1e-3, forward_per_seq_s=2e-3, backward_fixed_s=3e-3,
                              backward_per_seq_s=4e-3, saved_per_seq=1e4, transient_fixed=0.0,
                              transient_per_seq=1e3) for _ in range(4))
    profile, cluster = _toy(measured=blocks)
    model = StepModel(profile, cluster, global_batch_size=8)
    forward, backward, _ = model.block_times(1, 4)
    assert forward == pytest.approx([1e-3 + 4 * 2e-3] * 4) and backward == pytest.approx([3e-3 + 4 * 4e-3] * 4)
    forward2, _, _ = model.block_times(2, 4)  # blocks b and c hold half their FLOPs at tp=2: fixed part stays
    assert forward2 == pytest.approx([9e-3, 1e-3 + 4e-3, 1e-3 + 4e-3, 9e-3])  # (no traced op count: all of it)
    # with the blocks' traced ops, only their dispatch stays (10 ops x 40 us / 4 probe ops = 0.1 ms of the 4 ms
    # fixed forward+backward, 1/40); the rest follows the parameters, half of them on a rank in blocks b and c
    counted = StepModel(dataclasses.replace(profile, ops=(10,) * 4), cluster.replace(per_action_overhead_s=4e-5),
                        global_batch_size=8)
    kept = 1 / 40 + (1 - 1 / 40) * 0.5
    forward2, backward2, _ = counted.block_times(2, 4)
    assert forward2 == pytest.approx([9e-3, 1e-3 * kept + 4e-3, 1e-3 * kept + 4e-3, 9e-3])
    assert backward2 == pytest.approx([19e-3, 3e-3 * kept + 8e-3, 3e-3 * kept + 8e-3, 19e-3])
    assert counted.block_times(1, 4)[0] == pytest.approx(forward)  # tp=1: nothing split


def test_measured_update_time_and_fractional_cores():
    """The update after the backward (gradient norm, clip, optimizer) is the measured per-block seconds summed
    over a rank's blocks; a measured fractional core count divides the summed work exactly."""
    from autopar.search.measure_profile import BlockCosts
    blocks = tuple(BlockCosts(forward_fixed_s=1e-3, forward_per_seq_s=0.0, backward_fixed_s=2e-3,
                              backward_per_seq_s=0.0, saved_per_seq=1e4, transient_fixed=0.0, transient_per_seq=0.0,
                              update_s=u) for u in (1e-3, 2e-3, 3e-3, 4e-3))
    profile, cluster = _toy(measured=blocks)
    pipeline = StepModel(profile, cluster, global_batch_size=8).evaluate(
        Candidate(dp=1, tp=1, pp=2, micro_batch_size=8, num_microbatches=1, partition="uniform"))
    assert pipeline.bounds == (0, 2, 4)
    assert pipeline.parts["optimizer_s"] == pytest.approx(3e-3 + 4e-3)  # the slower rank: blocks c and d
    c = Candidate(dp=4, tp=1, pp=1, micro_batch_size=2, num_microbatches=1)
    alone = StepModel(profile, cluster, global_batch_size=8).evaluate(c)
    assert alone.parts["optimizer_s"] == pytest.approx(10e-3)
    shared = StepModel(profile, cluster.replace(cores_per_node=2.5), global_batch_size=8).evaluate(c)
    # 4 replicas of (forward + backward + update) on 2.5 cores; rel 1e-3: stage costs rounded (timeline.normalised)
    assert shared.step_time_s == pytest.approx(4 * (alone.parts["pipeline_s"] + 10e-3) / 2.5, rel=1e-3)


def test_time_shared_bound_counts_every_ranks_cpu_with_collectives():
    """Hand-computed: dp=2 x pp=2 on one core. The bound is the CPU of all four ranks: forward and backward
    (FLOPs at the rate), the update (AdamW bytes at the bandwidth), each boundary's activation and gradient
    (p2p CPU), each stage's gradient all-reduce over dp, and the step's small syncs (loss and peak over all 4
    ranks, target count over each dp group, gradient norm over each pp group), at the calibrated CPU costs."""
    from autopar.search.cluster import Link, cluster_from_dict
    from autopar.search.cost import ADAM_BYTES_PER_PARAM
    profile, cluster = _toy()
    table = {2: Link(1e-3, 1e9), 4: Link(2e-3, 1e9)}
    cluster = cluster.replace(allreduce_cpu_table=table, p2p_cpu=Link(2e-4, 1e9), cores_per_node=1)
    assert cluster_from_dict(cluster.to_dict()) == cluster  # the new fields survive the TOML form

    def ar(nbytes: float, n: int) -> float:
        return 2 * (n - 1) * table[n].latency_s + 2 * (n - 1) / n * nbytes / table[n].bandwidth_bytes_per_s

    c = Candidate(dp=2, tp=1, pp=2, micro_batch_size=1, num_microbatches=4, schedule="1f1b", partition="uniform")
    estimate = StepModel(profile, cluster, global_batch_size=8).evaluate(c)
    a, cut, b = estimate.bounds
    flops, params = profile.flops, profile.params
    compute = sum(4 * 3 * f / 1e9 for f in flops)  # 4 micro-batches, forward + backward (2x), both stages
    update = sum(p * ADAM_BYTES_PER_PARAM / 1e10 for p in params)
    p2p = 2 * 4 * (2e-4 + profile.boundary_bytes[cut - 1] / 1e9)  # one activation and one gradient per micro-batch
    grads = ar(sum(params[a:cut]) * 4.0, 2) + ar(sum(params[cut:b]) * 4.0, 2)
    syncs = 2 * ar(16, 4) + 2 * ar(16, 2) + 2 * ar(16, 2)
    # both replicas compute, update and send; each stage's all-reduce CPU is already summed over its dp group
    want = 2 * (compute + update + p2p) + grads + syncs
    assert estimate.parts["cpu_s"] == pytest.approx(want, rel=1e-3)
    assert estimate.step_time_s == pytest.approx(max(estimate.parts["cpu_s"] / 1, estimate.parts["timeline_step_s"]))
    # a group larger than any calibrated one costs what the largest does, per rank; nothing without a table
    assert cluster.all_reduce_cpu(1e6, 8) == pytest.approx(ar(1e6, 4) * 2)
    assert cluster.replace(allreduce_cpu_table={}).all_reduce_cpu(1e6, 2) == 0.0


def test_zero3_collectives_are_counted_per_fsdp_unit():
    """Hand-computed: ZeRO-3 under dp alone gathers and reduces each FSDP2 unit on its own (each repeated layer,
    the root holding the first and last blocks), so each unit pays the collective's fixed CPU, and each of its
    collectives (two all-gathers a micro-batch, one reduce-scatter) is a blocking wait on every rank."""
    from autopar.search.cluster import Link
    profile, cluster = _toy()
    cluster = cluster.replace(allreduce_cpu_table={4: Link(1e-3, 1e9)}, cores_per_node=1, sync_cpu_s=1e-4)
    c = Candidate(dp=4, tp=1, pp=1, micro_batch_size=1, num_microbatches=2, zero=3)
    parts = StepModel(profile, cluster, global_batch_size=8).evaluate(c).parts
    units = [1000 + 500, 2000, 2000]  # the root (blocks a and d), then b and c

    def ar(nbytes: float) -> float:  # one all-reduce's CPU over 4 ranks
        return 6 * 1e-3 + 6 / 4 * nbytes / 1e9

    assert parts["cpu_dp_collectives_s"] == pytest.approx(sum(3 * ar(u * 4.0) for u in units))
    assert parts["cpu_waits_s"] == pytest.approx(5 * len(units) * 4 * 1e-4)


def test_background_cores_leave_fewer_cores_to_the_time_shared_step():
    """Hand-computed: 8 replicas on 2 cores of which idle gloo threads take 0.5 (Cluster.background_cores): the
    bound is the same summed CPU over 1.5 cores; the CPU itself does not change, and its terms add up to it.
    A background of the whole cores or more is refused in a cluster file, naming the field."""
    from autopar.errors import ConfigError
    from autopar.search.cluster import cluster_from_dict
    profile, cluster = _toy()
    c = Candidate(dp=8, tp=1, pp=1, micro_batch_size=1, num_microbatches=1)
    plain = StepModel(profile, cluster.replace(cores_per_node=2), global_batch_size=8).evaluate(c)
    busy = cluster.replace(cores_per_node=2, background_cores=0.5)
    shared = StepModel(profile, busy, global_batch_size=8).evaluate(c)
    assert shared.parts["cpu_s"] == pytest.approx(plain.parts["cpu_s"])
    assert shared.step_time_s == pytest.approx(plain.parts["cpu_s"] / 1.5)
    assert plain.step_time_s == pytest.approx(plain.parts["cpu_s"] / 2)
    terms = [v for k, v in shared.parts.items() if k.startswith("cpu_") and k != "cpu_s"]
    assert len(terms) == 7 and sum(terms) == pytest.approx(shared.parts["cpu_s"])
    assert cluster_from_dict(busy.to_dict()) == busy
    with pytest.raises(ConfigError, match="'background_cores' \\(2.5\\) must be less than 'cores_per_node' \\(2\\)"):
        cluster_from_dict(busy.replace(background_cores=2.5).to_dict())


def test_tp_all_reduces_add_the_idle_they_cost_time_shared_cores():
    """Hand-computed: on cores the ranks time-share, a TP all-reduce idles them until every member of its group has
    run (Cluster.wait_idle_table, calibrate_ranks.wait_idle); the time-shared bound adds it per all-reduce of a
    rank's step (forward and backward, every micro-batch). Plans without TP are unchanged, a group size not
    measured takes the largest measured below it, and the table survives a cluster file."""
    from autopar.search.cluster import cluster_from_dict
    profile, cluster = _toy()
    tp2 = dataclasses.replace(profile.tp[2], allreduce_bytes=(1e3,) * 4, allreduce_count=(0, 2, 2, 0))
    profile = dataclasses.replace(profile, tp={**profile.tp, 2: tp2})
    shared = cluster.replace(cores_per_node=1)
    idle = shared.replace(wait_idle_table={2: 1e-3})
    c = Candidate(dp=4, tp=2, pp=1, micro_batch_size=1, num_microbatches=2)
    plain, waiting = (StepModel(profile, cl, global_batch_size=8).evaluate(c) for cl in (shared, idle))
    assert plain.parts["time_shared_s"] >= plain.parts["timeline_step_s"]  # the bound rules
    assert waiting.parts["time_shared_s"] - plain.parts["time_shared_s"] == pytest.approx(2 * 2 * 4 * 1e-3)
    dp = Candidate(dp=8, tp=1, pp=1, micro_batch_size=1, num_microbatches=1)
    assert (StepModel(profile, idle, global_batch_size=8).evaluate(dp).step_time_s
            == StepModel(profile, shared, global_batch_size=8).evaluate(dp).step_time_s)
    assert idle.wait_idle_s(4) == 1e-3 and idle.wait_idle_s(1) == 0.0 and shared.wait_idle_s(2) == 0.0
    assert cluster_from_dict(idle.to_dict()) == idle
    from autopar.errors import ConfigError
    for table, words in (({"x": 1e-3}, "key 'x' must be a group size >= 2"), ({"2": "slow"}, "must be a number"),
                         ({"2": -1.0}, "must be >= 0"), (0.001, "must be a table of group sizes")):
        with pytest.raises(ConfigError, match=words):
            cluster_from_dict({**idle.to_dict(), "wait_idle_table": table})


def test_reference_step_sets_the_level_of_the_time_shared_bound():
    """search/step_probe.py, hand-computed: the reference is replicated dp over every rank, one micro-batch each;
    its measured step over its predicted bound is the scale, which multiplies every bound (so the reference,
    scored again, predicts what was measured) and leaves the CPU terms alone. Without time-sharing, or with
    nothing measured, the scale is 1. A cluster file keeps the field and refuses a scale of 0 by name; a global
    batch that does not split over the ranks is refused."""
    from autopar.errors import ConfigError
    from autopar.search.cluster import cluster_from_dict
    from autopar.search.step_probe import reference_candidate, time_shared_scale
    profile, cluster = _toy()
    ref = reference_candidate(8, 16)
    assert (ref.dp, ref.tp, ref.pp, ref.micro_batch_size, ref.num_microbatches, ref.zero, ref.recompute) == \
        (8, 1, 1, 2, 1, 0, "none")
    with pytest.raises(ConfigError, match="global batch size 12 does not split over 8 ranks"):
        reference_candidate(8, 12)
    shared = cluster.replace(cores_per_node=2)
    before = StepModel(profile, shared, global_batch_size=16).evaluate(ref)
    scale = time_shared_scale(1.3 * before.step_time_s, before)
    assert scale == pytest.approx(1.3)
    scaled = shared.replace(time_shared_scale=scale)
    after = StepModel(profile, scaled, global_batch_size=16).evaluate(ref)
    assert after.step_time_s == pytest.approx(1.3 * before.step_time_s)
    assert after.parts["cpu_s"] == pytest.approx(before.parts["cpu_s"])
    other = Candidate(dp=4, tp=1, pp=2, micro_batch_size=1, num_microbatches=4, partition="uniform")
    assert StepModel(profile, scaled, global_batch_size=16).evaluate(other).parts["time_shared_s"] == \
        pytest.approx(1.3 * StepModel(profile, shared, global_batch_size=16).evaluate(other).parts["time_shared_s"])
    alone = StepModel(profile, cluster, global_batch_size=16).evaluate(ref)  # a core per rank: no bound
    assert time_shared_scale(2 * alone.step_time_s, alone) == 1.0
    assert time_shared_scale(0.0, before) == 1.0
    assert cluster_from_dict(scaled.to_dict()) == scaled
    with pytest.raises(ConfigError, match="'time_shared_scale' must be > 0, got 0"):
        cluster_from_dict(scaled.replace(time_shared_scale=0).to_dict())


def test_time_shared_bound_adds_the_cores_a_pipeline_leaves_idle():
    """cost.StepModel.idle_cores_s: a pp=4 pipeline of one replica on 2 cores is ready on fewer ranks than cores
    while it warms up and drains, so its time-shared step is above its CPU / cores by the processor-sharing
    makespan less the perfectly packed compute; pure data parallelism keeps every rank ready and pays nothing."""
    profile, cluster = _toy()
    shared = cluster.replace(cores_per_node=2)
    model = StepModel(profile, shared, global_batch_size=8)
    pipe = model.evaluate(Candidate(dp=1, tp=1, pp=4, micro_batch_size=1, num_microbatches=8, partition="uniform"))
    cpu = pipe.parts["cpu_s"] / 2
    assert pipe.parts["time_shared_s"] > cpu * 1.01
    dp = model.evaluate(Candidate(dp=8, tp=1, pp=1, micro_batch_size=1, num_microbatches=1))
    assert dp.parts["time_shared_s"] == pytest.approx(dp.parts["cpu_s"] / 2)


def test_other_threads_cpu_counts_another_threads_work():
    """calibrate_ranks.other_threads_cpu_s (what background_cores sums over the ranks) sees a busy thread's CPU
    and not the caller's own."""
    import threading
    import time

    from autopar.search.calibrate_ranks import other_threads_cpu_s

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    spun, done = threading.Event(), threading.Event()

    def work() -> None:  # spins, then stays alive (an exited thread leaves /proc/self/task) until told
        spin(0.1)
        spun.set()
        done.wait()

    before = other_threads_cpu_s()
    spin(0.05)  # the caller's own CPU: not counted
    mine = other_threads_cpu_s() - before
    worker = threading.Thread(target=work)
    worker.start()
    spun.wait()
    theirs = other_threads_cpu_s() - before - mine
    done.set()
    worker.join()
    assert mine < 0.02 and theirs >= 0.09
