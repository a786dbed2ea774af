"""PipeDream-2BW and PipeDream (weight stashing): the no-flush lists are sound, and the pipelined runs
equal their single-process rules.

The rule (pipeline/async_schedules.py, train/two_bw_oracle.py): W(t+1) = opt(W(t), grad f_t(W(t-1))).
The oracle is a world of one running it on the whole model; the pipelined runs (pp 2 and 4, with
dp 2) must give the same losses (1e-5 relative), gradient norms, eval loss and parameters, across
an eval in the middle of training (a flush and a fresh warm-up).
"""

from __future__ import annotations

import re

import pytest

from autopar import Strategy, TrainConfig
from autopar.errors import ConfigError
from autopar.pipeline.async_lowering import lower_calls
from autopar.pipeline.async_schedules import (check_stash_versions, check_versions, runs_of, segment, segment_lists,
                                              stash_lists, steady_state_bubble, step_time_with_meeting,
                                              tied_steps_due, whole_run)
from autopar.pipeline.schedules import build_schedule
from autopar.pipeline.simulate import check, simulate
from autopar.strategies import resolve
from helpers import max_relative_difference
from pipedream_helpers import train_2bw, train_stash, train_stash_oracle, train_until_signal, train_with_a_slow_stage

STEPS = 4
COMMON = dict(steps=STEPS, global_batch_size=8, eval_every=2)
MODELS = {"gpt-tiny": {"n_layer": 3}, "hf:llama": {"num_hidden_layers": 3}}
_oracles: dict = {}


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (3, 5)])
def test_no_flush_lists_run_without_deadlock_on_two_versions_and_no_steady_bubble(pp, m):
    steps = 6
    lists = segment_lists(pp=pp, m=m, steps=range(steps), flush_after={2, steps - 1})  # a flush mid-run
    run = whole_run(lists)
    check(run, pp=pp, num_stages=pp, num_microbatches=steps * m)  # complete, paired, no deadlock
    versions = check_versions(lists, m=m)
    assert max(versions.values()) == 2 and versions[pp - 1] == 1  # the last stage never looks ahead
    no_flush = segment_lists(pp=pp, m=m, steps=range(steps), flush_after={steps - 1})
    timeline = simulate(whole_run(no_flush), pp=pp, num_stages=pp, num_microbatches=steps * m)
    assert max(steady_state_bubble(timeline, no_flush).values()) == 0.0  # unit costs: exact
    one_f_one_b = simulate(build_schedule("1f1b", pp=pp, num_microbatches=m), pp=pp, num_stages=pp,
                           num_microbatches=m)
    assert min(one_f_one_b.bubble.values()) > 0.1
    assert timeline.makespan < steps * one_f_one_b.makespan
    # with the ranks meeting between steps (as the trainer's do) one backward chain is left per step
    assert step_time_with_meeting(pp=pp, m=m) == m * 3 + (pp - 1) * 2 < one_f_one_b.makespan


def test_version_check_catches_a_third_version():
    lists = segment_lists(pp=4, m=4, steps=range(3), flush_after={2})
    with pytest.raises(ValueError, match=r"0F4 in step 0 needs W\(1\), made only at the end of step 0"):
        check_versions(lists, m=2)  # read as m=2, step 0 runs step 2's micro-batches: W(1) is not made yet


@pytest.mark.parametrize("strategy,match", [
    ({"pp": 2, "schedule": "pipedream-2bw", "chunks": 2}, "interleaving"),
    ({"pp": 2, "schedule": "pipedream-2bw", "dp_mode": "async"}, "parameter server"),
    ({"pp": 2, "schedule": "pipedream-2bw", "recompute": "all"}, "recomputation"),
    ({"pp": 2, "schedule": "pipedream-2bw", "tp": 2}, "tensor-parallel"),
])
def test_bad_combinations_are_refused_before_ranks_start(strategy, match):
    with pytest.raises(ConfigError, match=match):
        resolve(Strategy(**strategy), TrainConfig(global_batch_size=8, micro_batch_size=1), world=4)


def test_too_few_micro_batches_are_refused():
    with pytest.raises(ConfigError, match="at least pp=4 micro-batches"):
        resolve(Strategy(pp=4, schedule="pipedream-2bw"), TrainConfig(global_batch_size=8, micro_batch_size=4),
                world=4)


def test_resuming_a_synchronous_checkpoint_is_refused(tmp_path):
    import json
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    for name, keys in (("sync", ["w"]), ("2bw", ["w", "pipedream_2bw.step"])):
        path = tmp_path / name
        with warnings.catch_warnings():  # DCP warns that it saves without a process group
            warnings.simplefilter("ignore")
            dcp.save({"model": {k: torch.zeros(2) for k in keys}}, checkpoint_id=str(path))
        (path / "trainer.json").write_text(json.dumps({"step": 2}))
    config = dict(global_batch_size=8, micro_batch_size=2)
    with pytest.raises(ConfigError, match="not written by a pipedream-2bw run"):
        resolve(Strategy(pp=2, schedule="pipedream-2bw"), TrainConfig(**config, resume=str(tmp_path / "sync")),
                world=2)
    resolve(Strategy(pp=2, schedule="pipedream-2bw"), TrainConfig(**config, resume=str(tmp_path / "2bw")), world=2)


def oracle(rank_pool, tmp_path_factory, model: str) -> dict:
    if model not in _oracles:
        _oracles[model] = rank_pool(1).run(train_2bw, model, str(tmp_path_factory.mktemp("oracle")),
                                           model_args=MODELS[model], strategy={"schedule": "pipedream-2bw"},
                                           micro_batch_size=8, **COMMON)[0]
    return _oracles[model]


# (world, strategy, micro-batch size): m = 8 / (micro * dp) micro-batches per replica
LAYOUTS = [  # pp=2 alone is the dp=2 layout's pipeline; left out to keep the suite fast
    (4, {"pp": 4}, 2),
    (4, {"pp": 2, "dp": 2}, 1),
]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("world,strategy,micro", LAYOUTS, ids=lambda v: str(v))
def test_2bw_matches_its_single_process_rule(rank_pool, tmp_path, tmp_path_factory, model, world, strategy, micro):
    expected = oracle(rank_pool, tmp_path_factory, model)
    results = rank_pool(world).run(train_2bw, model, str(tmp_path), model_args=MODELS[model],
                                   strategy={**strategy, "schedule": "pipedream-2bw"}, micro_batch_size=micro,
                                   **COMMON)
    for rank, got in enumerate(results):
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, expected, got["losses"])
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4, rank
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5, rank
        for name, value in got["params"].items():
            assert (value - expected["params"][name]).abs().max() < 1e-5, (rank, name)
        assert got["peak_storages"] == 2 * got["num_params"]  # two weight versions, never a third
    owned = set().union(*(r["params"] for r in results))
    assert set(expected["params"]) - owned <= {"lm_head.weight"}


def test_the_oracle_is_not_synchronous_sgd(rank_pool, tmp_path, tmp_path_factory):
    """The rule differs from synchronous training from step 2 on (so the tests above can fail): step 1
    computes on W(0) in both, step 2 on W(0) in 2BW but on W(1) synchronously."""
    expected = oracle(rank_pool, tmp_path_factory, "gpt-tiny")
    sync = rank_pool(1).run(train_2bw, "gpt-tiny", str(tmp_path), model_args=MODELS["gpt-tiny"],
                            micro_batch_size=8, **COMMON)[0]
    assert expected["losses"][0] == sync["losses"][0]  # bitwise: the same model, batch and ops on W(0)
    assert min(abs(a - b) / a for a, b in zip(sync["losses"][1:], expected["losses"][1:])) > 1e-5


@pytest.mark.parametrize("schedule", ["pipedream-2bw", "pipedream"])
def test_resume_continues_the_exact_trajectory(rank_pool, tmp_path, schedule):
    """What a checkpoint holds is what the rule needs next. 2BW: both versions, the optimizer and the step;
    its checkpoint here is a stop on a signal (SIGTERM in step 1, known to all ranks during step 2 since the
    update is deferred: step 2 is settled, its look-ahead forwards dropped, step 2 saved), and the resumed
    run retraces an uninterrupted one with no checkpoint at all (the 2BW rule does not change at a flush).
    PipeDream: the newest weights (its rule restarts at a flush, so the uninterrupted run checkpoints at
    the same step)."""
    stash = schedule == "pipedream"
    args = dict(model_args=MODELS["gpt-tiny"], strategy={"pp": 2, "schedule": schedule}, micro_batch_size=2,
                steps=STEPS, global_batch_size=2 if stash else 8)
    train = train_stash if stash else train_2bw
    whole = rank_pool(2).run(train, "gpt-tiny", str(tmp_path / "whole"), **args, checkpoint_every=2 if stash else 0)
    if stash:
        source = tmp_path / "whole"
    else:
        source = tmp_path / "stopped"
        said = rank_pool(2).run(train_until_signal, "gpt-tiny", str(source), fault="sigterm:rank=1:step=1", **args)
        assert all(f"stopped on a signal after step 2 of {STEPS}" in text for text in said), said
    resumed = rank_pool(2).run(train, "gpt-tiny", str(tmp_path / "resumed"), **args,
                               resume=str(source / "checkpoints" / "step_00000002"))
    for a, b in zip(whole, resumed):
        assert b["first_step"] == 3
        # the same ops in the same order on the same values (the checkpoint round trip is exact): 1e-6 is slack
        assert max_relative_difference(a["losses"][2:], b["losses"]) < 1e-6, (a["losses"], b["losses"])
        assert max_relative_difference(a["grad_norms"][2:], b["grad_norms"]) < 1e-6
        for name, value in b["params"].items():
            assert (value - a["params"][name]).abs().max() < 1e-6, name
        for name, value in b.get("older", {}).items():
            assert (value - a["older"][name]).abs().max() < 1e-6, name


def test_look_ahead_forwards_draw_their_own_steps_dropout(rank_pool, tmp_path, tmp_path_factory):
    """Stage 0 runs step t+1's first forward inside step t: it must draw step t+1's masks, as one process does."""
    args = {"n_layer": 2, "dropout": 0.1}
    expected = rank_pool(1).run(train_2bw, "gpt-tiny", str(tmp_path_factory.mktemp("oracle_dropout")),
                                model_args=args, strategy={"schedule": "pipedream-2bw"}, micro_batch_size=8,
                                **COMMON)[0]
    results = rank_pool(4).run(train_2bw, "gpt-tiny", str(tmp_path), model_args=args, micro_batch_size=1,
                               strategy={"pp": 2, "dp": 2, "schedule": "pipedream-2bw"}, **COMMON)
    for got in results:
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (expected["losses"], got["losses"])
        for name, value in got["params"].items():
            assert (value - expected["params"][name]).abs().max() < 1e-5, name


# ---------------------------------------------------------------- PipeDream (weight stashing)


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("vertical_sync", [False, True])
def test_stash_lists_run_without_deadlock_and_hold_at_most_pp_minus_s_versions(pp, vertical_sync):
    steps = 16
    flush = {3, steps - 1}  # a flush mid-run, then a steady run long enough to fill every stage
    lists = stash_lists(pp=pp, steps=range(steps), flush_after=flush)
    check(whole_run(lists), pp=pp, num_stages=pp, num_microbatches=steps)  # complete, paired, no deadlock
    held = check_stash_versions(lists, pp=pp, flush_after=flush, vertical_sync=vertical_sync)
    # each backward on its forward's version (checked inside); pp - s versions at most, reached in steady state
    assert held == ({s: pp for s in range(pp)} if vertical_sync else {s: pp - s for s in range(pp)}), held
    lowered = lower_calls(lists, pp=pp, flush_after=flush)  # batched groups, both ends in one step
    check(whole_run(lowered), pp=pp, num_stages=pp, num_microbatches=steps)
    no_flush = stash_lists(pp=pp, steps=range(steps), flush_after={steps - 1})
    timeline = simulate(whole_run(no_flush), pp=pp, num_stages=pp, num_microbatches=steps)
    steady = {t: no_flush[t] for t in range(steps - pp + 1)}  # leave out the warm-up and the final drain's steps
    assert max(steady_state_bubble(timeline, steady, skip=pp).values()) == 0.0  # unit costs: exact
    # with the ranks meeting after every step (one micro-batch), its backward climbs the whole pipe each time
    segment_t = {s: acts for s, acts in no_flush[pp].items()}
    assert step_time_with_meeting(pp=pp, m=1, lists=segment_t) == 1 + 2 * pp


def test_stash_version_check_catches_a_missing_stash():
    lists = stash_lists(pp=3, steps=range(6), flush_after={5})
    forward = lists[2][0].pop(0)  # stage 0's F4 moved into step 1: it would need W(2), made at the end of step 1
    lists[1][0].insert(1, forward)
    with pytest.raises(ValueError, match=r"rank 0: F4 in step 1 runs on W\(2\); the newest is W\(1\)"):
        check_stash_versions(lists, pp=3, flush_after={5}, vertical_sync=False)


@pytest.mark.parametrize("delay", [0, 1, 3, 7])
def test_the_tied_rule_applies_every_step_s_gradient_once_in_its_own_run(delay):
    """A tied weight's summed gradient of step u is applied at step u + delay, or at its run's drain if that comes
    first; never in another run, never twice, never before it exists."""
    runs = runs_of(range(12), {3, 4, 9})
    applied = {t: tied_steps_due(t, run_start=runs[t][0], run_end=runs[t][1], delay=delay) for t in range(12)}
    assert sorted(u for due in applied.values() for u in due) == list(range(12))
    for t, due in applied.items():
        start, end = runs[t]
        expected = range(max(start, t - delay), t + 1) if t == end else range(t - delay, t - delay + 1)
        assert list(due) == [u for u in expected if u >= start], (t, list(due))
    assert list(applied[8]) == ([8 - delay] if 8 - delay >= 5 else [])  # run 5..9


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4)])
def test_2bw_calls_are_batched_with_both_ends_in_one_step(pp, m):
    """NCCL-safe transfers: every transfer of the no-flush lists is in a batched group whose two ends sit
    in the same optimizer step (the ranks meet between steps), and the whole run still checks."""
    steps, flush = 6, {2, 5}
    compute, warm = {}, True
    for t in range(steps):
        compute[t] = {s: segment(s, pp=pp, m=m, step=t, warm=warm, drain=t in flush) for s in range(pp)}
        warm = t in flush
    lowered = lower_calls(compute, pp=pp, flush_after=flush)
    assert all(a.step is not None for acts in whole_run(lowered).values() for a in acts if a.op.is_comm)
    check(whole_run(lowered), pp=pp, num_stages=pp, num_microbatches=steps * m)


@pytest.mark.parametrize("strategy,match", [
    ({"pp": 2, "schedule": "pipedream", "chunks": 2}, "interleaving"),
    ({"pp": 2, "schedule": "pipedream", "dp_mode": "async"}, "parameter server"),
    ({"pp": 2, "schedule": "pipedream", "dp_mode": "gossip"}, "gossip"),
    ({"pp": 2, "schedule": "pipedream", "recompute": "all"}, "recomputation"),
    ({"pp": 2, "schedule": "pipedream", "zero": 1, "dp": 2}, "zero 1"),
    ({"pp": 2, "schedule": "1f1b", "vertical_sync": True}, "belongs to --schedule pipedream"),
    ({"pp": 2, "schedule": "pipedream-2bw", "tied_delay": 1}, r"tied_delay \(--tied-delay\) belongs to"),
    ({"pp": 2, "schedule": "pipedream", "tied_delay": -1}, "non-negative integer, got -1"),
])
def test_stash_bad_combinations_are_refused_before_ranks_start(strategy, match):
    with pytest.raises(ConfigError, match=match):
        resolve(Strategy(**strategy), TrainConfig(global_batch_size=2, micro_batch_size=1), world=4)


def test_stash_needs_one_micro_batch_per_replica_per_step():
    with pytest.raises(ConfigError, match=r"updates after every micro-batch.*set --global-batch-size to micro-batch "
                                          r"size x dp = 4"):
        resolve(Strategy(pp=2, dp=2, schedule="pipedream"), TrainConfig(global_batch_size=8, micro_batch_size=2),
                world=4)
    with pytest.raises(ConfigError, match="bf16"):
        resolve(Strategy(pp=2, schedule="pipedream"), TrainConfig(global_batch_size=2, micro_batch_size=2,
                                                                  dtype="bf16"), world=2)


STASH_STEPS = 6
STASH_COMMON = dict(steps=STASH_STEPS, global_batch_size=2, eval_every=4, warmup_steps=1)
# (model, world, strategy, micro-batch size, vertical sync); gpt-tiny ties its embedding and head across the
# first and last stage: the tied rule's delay is pp - 1 by default, 0 (the sum each step) where given
STASH_LAYOUTS = [
    ("gpt-tiny", 2, {"pp": 2}, 2, False),
    ("gpt-tiny", 4, {"pp": 4}, 2, False),
    ("gpt-tiny", 4, {"pp": 2, "dp": 2, "tied_delay": 0}, 1, True),
    ("hf:llama", 4, {"pp": 4}, 2, False),
]


@pytest.mark.parametrize("model,world,strategy,micro,vertical_sync", STASH_LAYOUTS, ids=lambda v: str(v))
def test_stash_matches_its_single_process_rule(rank_pool, tmp_path, model, world, strategy, micro, vertical_sync):
    """The pipelined run against tests/stash_oracle.py (per-stage delays pp-1-s, or pp-1 for all with
    vertical sync; the eval after step 4 flushes, so the next steps warm up again on the newest weights)."""
    results = rank_pool(world).run(train_stash, model, str(tmp_path / "pipe"), model_args=MODELS[model],
                                   strategy={**strategy, "schedule": "pipedream", "vertical_sync": vertical_sync},
                                   micro_batch_size=micro, **STASH_COMMON)
    stages_of: dict = {}
    for got in results:
        stages_of.update(got["stages_of"])
    expected = rank_pool(1).run(train_stash_oracle, model, str(tmp_path / "oracle"), pp=strategy["pp"],
                                stages_of=stages_of, vertical_sync=vertical_sync, model_args=MODELS[model],
                                tied_delay=strategy.get("tied_delay"), micro_batch_size=2, **STASH_COMMON)[0]
    if ("sync", model) not in _oracles:  # the rule at pp=1: synchronous SGD (once per model)
        _oracles[("sync", model)] = rank_pool(1).run(train_stash_oracle, model, str(tmp_path / "sync"), pp=1,
                                                     stages_of={k: [0] for k in stages_of}, vertical_sync=False,
                                                     model_args=MODELS[model], micro_batch_size=2, **STASH_COMMON)[0]
    sync = _oracles[("sync", model)]
    # the rule differs from synchronous SGD (so this test can fail): step 2 runs stage 0 on W(0), not W(1)
    assert min(abs(a - b) / a for a, b in zip(sync["losses"][1:4], expected["losses"][1:4])) > 1e-6
    for got in results:
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (expected["losses"], got["losses"])
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5
        for name, value in got["params"].items():
            assert (value - expected["params"][name]).abs().max() < 1e-5, name
        pp, s = strategy["pp"], got["stage"]
        # weight storages per parameter: pp - s versions (pp with vertical sync) at most
        assert got["peak_storages"] <= (pp if vertical_sync else pp - s) * got["num_params"], got["peak_storages"]


def test_a_stop_between_drains_applies_the_held_tied_gradients(rank_pool, tmp_path):
    """The tied rule holds a tied weight's last pp - 1 summed gradients until later steps; a stop on a signal
    between drains applies them as one last update of that weight alone, at the last step's rate, so none is
    lost. With plain SGD that update is linear: the stop's checkpoint equals a drain's at the same step, and the
    runs resumed from the two continue alike (dropping the held gradients, or applying them at the next step's
    rate of the warm-up, fails this)."""
    args = dict(model_args=MODELS["gpt-tiny"], strategy={"pp": 2, "schedule": "pipedream"}, micro_batch_size=2,
                global_batch_size=2, steps=5, optimizer="sgd", lr=0.2, warmup_steps=4, min_lr_ratio=1.0,
                weight_decay=0.0, grad_clip=0.0)
    said = rank_pool(2).run(train_until_signal, "gpt-tiny", str(tmp_path / "stopped"), fault="sigterm:rank=1:step=1",
                            checkpoint_every=0, **args)
    stop = int(re.search(r"stopped on a signal after step (\d+) of", said[0]).group(1))
    assert 1 < stop < 4, said
    drained = rank_pool(2).run(train_stash, "gpt-tiny", str(tmp_path / "drained"), checkpoint_every=stop, **args)
    resumed = rank_pool(2).run(train_stash, "gpt-tiny", str(tmp_path / "resumed"), checkpoint_every=stop, **args,
                               resume=str(tmp_path / "stopped" / "checkpoints" / f"step_{stop:08d}"))
    for a, b in zip(drained, resumed):
        assert b["first_step"] == stop + 1
        assert max_relative_difference(a["losses"][stop:], b["losses"]) < 1e-5, (a["losses"], b["losses"])
        for name, value in b["params"].items():
            assert (value - a["params"][name]).abs().max() < 1e-5, name


DELAY_S = 0.04  # per forward of the slow stage: ten times and more gpt-tiny's compute per micro-batch


@pytest.mark.parametrize("schedule,slow,steps,batch", [("1f1b", 1, 4, 4), ("pipedream-2bw", 0, 4, 4),
                                                       ("pipedream", 1, 6, 2)])
def test_blocked_time_is_the_wait_for_a_slower_stage(rank_pool, tmp_path, schedule, slow, steps, batch):
    """The bubble as measured (`blocked_s_per_stage`, benchmarks/async_pipeline.py's idle) is time spent waiting
    for pipeline peers: with one stage made slower by a known sleep in each forward, the other stage's recorded
    waits cover at least most of those sleeps in steady state, while the slow stage records at most the fast one's
    compute (1f1b's flush: its first forward and last backward) and the transfers; waits and compute never
    overlap (blocked + busy <= the step's wall). Timing the whole step as a wait, or no wait at all, fails.
    gpt-tiny ties its embedding and head across the two stages (their sum is one of the waits)."""
    records = rank_pool(2).run(train_with_a_slow_stage, "gpt-tiny", str(tmp_path), slow_stage=slow, delay_s=DELAY_S,
                               model_args={"n_layer": 2}, strategy={"pp": 2, "schedule": schedule}, steps=steps,
                               global_batch_size=batch, micro_batch_size=2, eval_every=0, log_every=1)[0]
    assert len(records) == steps
    for r in records:
        for s in range(2):
            assert r["blocked_s_per_stage"][s] >= 0 and r["dp_wait_s_per_stage"][s] >= 0, r
            assert r["blocked_s_per_stage"][s] + r["busy_s_per_stage"][s] <= r["step_s_per_stage"][s] + 1e-4, r
    steady = records[1:-1]  # the first step's warm-up (and channel set-up) and the last (a drain) left out
    slept = len(steady) * batch // 2 * DELAY_S  # the slow stage's sleeps in those steps (a forward per micro-batch)
    fast_waited = sum(r["blocked_s_per_stage"][1 - slow] for r in steady)
    slow_waited = sum(r["blocked_s_per_stage"][slow] for r in steady)
    fast_computed = sum(r["busy_s_per_stage"][1 - slow] for r in steady)  # what the slow one may wait for at most
    assert fast_waited >= 0.7 * slept, (fast_waited, slept, steady)
    assert slow_waited <= 0.1 * slept + fast_computed, (slow_waited, slept, fast_computed, steady)
