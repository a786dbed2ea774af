"""Ranks that leave mid-run: `autopar train --on-rank-loss shrink` goes on with the surviving whole replicas.

One job of real processes (a rank killed with AUTOPAR_FAULT, autopar/train/faults.py) against one process's
losses; the rest without ranks: which devices and which cluster entries the smaller job is planned on, and the
refusals before any rank starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import max_relative_difference, train_builtin

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model", "gpt-tiny", "--seq-len", "32", "--global-batch-size", "8", "--lr", "1e-3", "--no-progress",
         "--eval-batches", "1", "--micro-batch-size", "2"]
REFERENCE = dict(steps=6, warmup_steps=20, lr=1e-3, global_batch_size=8, micro_batch_size=2, eval_batches=1)


def _autopar(*args: str, fault: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AUTOPAR_FAULT": fault}
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True, timeout=400,
                          cwd=ROOT, env=env)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(600)
def test_a_killed_rank_shrinks_dp2_x_pp2_to_the_surviving_pipeline_with_one_process_losses(rank_pool, tmp_path):
    """4 ranks, dp=2 x pp=2; rank 3 killed as step 3 begins: the job goes on as dp=1 x pp=2 on devices 0 and 1
    from the step-2 checkpoint (global batch unchanged), with the losses of one uninterrupted process."""
    reference = rank_pool(1).run(train_builtin, "gpt-tiny", str(tmp_path / "one"), **REFERENCE)[0]["losses"]
    run = tmp_path / "run"
    done = _autopar("train", *SMALL, "--nproc", "4", "--dp", "2", "--pp", "2", "--steps", "6", "--checkpoint-every",
                    "2", "--max-restarts", "1", "--on-rank-loss", "shrink", "--out", str(run),
                    fault="kill:rank=3:step=3")
    assert done.returncode == 0, done.stderr
    assert ("autopar launch: rank 3 was killed by SIGKILL; lost rank(s) 3: going on with 2 of 4 ranks (devices 0, 1) "
            "from step_00000002: dp=1 pp=2 (change 1 of 1, --on-rank-loss shrink)") in done.stderr, done.stderr
    [change] = _records(run / "restarts.jsonl")
    assert {k: change[k] for k in ("change", "cause", "lost_ranks", "old_world", "new_world", "new_devices",
                                   "resumes_from", "resumed_step", "layout")} == {
        "change": "shrink", "cause": "rank 3 was killed by SIGKILL", "lost_ranks": [3], "old_world": 4,
        "new_world": 2, "new_devices": [0, 1], "resumes_from": "step_00000002", "resumed_step": 2,
        "layout": {"dp": 1, "tp": 1, "pp": 2, "cp": 1}}
    assert json.loads((run / "run.json").read_text())["world_size"] == 2
    metrics = _records(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, 7))
    assert max_relative_difference(reference, [r["loss"] for r in metrics]) < 1e-5, (reference, metrics)


RANKS = """import os, signal, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["AUTOPAR_RESTART_COUNT"])
def stop(signum, frame):  # as the trainer answers a stop signal: says so, saves, leaves with 75
    print(f"autopar: rank {rank}: {signal.Signals(signum).name} received; saving", file=sys.stderr, flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
if attempt == 0 and rank == int(sys.argv[2]):
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGTERM)  # preempted: this rank alone gets the signal
if attempt == 0:
    time.sleep(0.5 if sys.argv[1] == "preempt" else 30)  # the peers: stop after the same step, or wait
    sys.exit(75)
with open(os.path.join(sys.argv[3], f"rank{rank}"), "w") as f:
    f.write(f"{os.environ['LOCAL_RANK']} {os.environ['WORLD_SIZE']}")
"""


@pytest.mark.parametrize("how", ["kill", "preempt"])
def test_the_launcher_tells_lost_ranks_from_their_peers_and_starts_the_smaller_world_on_the_kept_devices(
        tmp_path, how):
    """A rank killed (its peers then stopped by the launcher, which they say as a preempted rank would) or
    preempted alone (every rank saves and leaves with 75): only that rank is lost; the smaller world's ranks
    run on the devices the policy kept (LOCAL_RANK), and restarts.jsonl records the change."""
    from autopar.launch import Relaunch, launch
    script, out = tmp_path / "ranks.py", tmp_path / "out"
    script.write_text(RANKS)
    out.mkdir()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000004")
    seen = []

    def shrink(loss):
        seen.append(loss)
        return Relaunch(command=[sys.executable, str(script), how, "1", str(out)], devices=(0, 2),
                        record={"layout": {"dp": 2}}, says="dp=2")

    command = [sys.executable, str(script), how, "1", str(out)]
    assert launch(command, 4, grace_s=0.5, max_restarts=1, run_dir=str(tmp_path), on_rank_loss=shrink) == 0
    [loss] = seen
    assert (loss.lost, loss.world, loss.devices, loss.resumes_from) == ((1,), 4, (0, 1, 2, 3), "step_00000004")
    assert loss.cause == ("rank 1 was killed by SIGKILL" if how == "kill" else
                          "rank(s) 1 preempted (a stop signal; saved and stopped)")
    assert sorted(p.read_text() for p in out.iterdir()) == ["0 2", "2 2"]  # new ranks 0, 1 on devices 0, 2
    [change] = _records(tmp_path / "restarts.jsonl")
    assert {k: change[k] for k in ("change", "lost_ranks", "old_world", "new_world", "new_devices", "resumed_step",
                                   "layout")} == {"change": "shrink", "lost_ranks": [1], "old_world": 4,
                                                  "new_world": 2, "new_devices": [0, 2], "resumed_step": 4,
                                                  "layout": {"dp": 2}}


MIXED = """name = "mixed"
num_devices = 4
devices_per_node = 2
memory_per_device_gb = 8
compute_efficiency = 0.5
memory_bandwidth_bytes_per_s = 1e10
flops_per_s = {fp32 = 1e11, bf16 = 1e11}
intra_node = {latency_s = 1e-5, bandwidth_bytes_per_s = 1e10}
inter_node = {latency_s = 1e-3, bandwidth_bytes_per_s = 1e8}
[[devices]]
speed = 1.0
[[devices]]
speed = 0.3
memory_gb = 4
[[devices]]
speed = 0.5
[[devices]]
speed = 0.9
memory_gb = 6
[[links]]
a = [0]
b = [3]
latency_s = 5e-3
bandwidth_bytes_per_s = 1e7
"""


def test_the_smaller_plan_sees_the_surviving_devices_own_speeds_memory_and_links(tmp_path):
    """dp=4 on a mixed cluster loses rank 1: 3 survivors do not split the batch (the CLI's preparation refuses),
    so 2 go on: the fastest, devices 0 and 3, as ranks 0 and 1, with their own entries, their own link, and
    --dp-shares auto recomputed from their speeds."""
    from autopar.config import JobConfig, LaunchConfig, Strategy, TrainConfig
    from autopar.errors import ConfigError
    from autopar.launch import RankLoss
    from autopar.rank_loss import ShrinkOnRankLoss
    from autopar.search.cluster import load_cluster
    from autopar.search.device_speeds import with_auto_shares
    from autopar.search.hetero_cluster import device_memory_gb, device_speed, link_between
    cluster_file = tmp_path / "mixed.toml"
    cluster_file.write_text(MIXED)
    job = JobConfig(strategy=Strategy(dp_shares="auto", cluster=str(cluster_file)),
                    train=TrainConfig(global_batch_size=8, micro_batch_size=2, checkpoint_every=2),
                    launch=LaunchConfig(nproc=4, max_restarts=2, on_rank_loss="shrink"))
    asked = []

    def prepare(args):
        asked.append(args)
        world = int(args[args.index("--nproc") + 1])
        if world == 3:
            raise ConfigError("global_batch_size=8 cannot be split into dp*micro_batches")
        return ["ranks", *args], Strategy(dp=world, dp_shares="auto", cluster=args[args.index("--cluster") + 1])

    shrink = ShrinkOnRankLoss(job, Strategy(dp=4), str(tmp_path), prepare)
    relaunch = shrink(RankLoss(lost=(1,), world=4, devices=(0, 1, 2, 3), cause="rank 1 was killed by SIGKILL",
                               exit_code=-9, resumes_from="step_00000002"))
    assert [a[a.index("--nproc") + 1] for a in asked] == ["3", "2"]
    assert relaunch.devices == (0, 3) and relaunch.record["layout"]["dp"] == 2
    assert asked[-1][:5] == ["train", "--resume", str(tmp_path), "--nproc", "2"] and "--dp-shares" in asked[-1]
    seen = load_cluster(asked[-1][asked[-1].index("--cluster") + 1])
    assert seen.num_devices == 2 and [device_speed(seen, d) for d in (0, 1)] == [1.0, 0.9]
    assert [device_memory_gb(seen, d) for d in (0, 1)] == [8, 6]
    assert link_between(seen, 0, 1).bandwidth_bytes_per_s == 1e7  # the [[links]] entry between devices 0 and 3
    strategy = Strategy(dp=2, dp_shares="auto", cluster=str(asked[-1][asked[-1].index("--cluster") + 1]))
    assert with_auto_shares(strategy.resolved(2), 2).replicas.shares == "1,0.9"
    # a second loss counts from the devices the job now runs on: rank 0 (device 0) goes, device 3 is left
    with pytest.raises(ConfigError, match="no whole replica|cannot be split"):
        shrink(RankLoss(lost=(0, 1), world=2, devices=(0, 3), cause="", exit_code=-9, resumes_from="step_00000004"))
    last = shrink(RankLoss(lost=(0,), world=2, devices=(0, 3), cause="", exit_code=-9, resumes_from="step_00000004"))
    assert last.devices == (3,)
    seen = load_cluster(asked[-1][asked[-1].index("--cluster") + 1])
    assert seen.num_devices == 1 and device_speed(seen, 0) == 0.9


def test_shrink_is_refused_before_any_rank_starts_where_it_could_not_go_on(tmp_path):
    from autopar.config import JobConfig, LaunchConfig, Strategy, TrainConfig
    from autopar.errors import ConfigError
    from autopar.rank_loss import check_can_shrink
    job = JobConfig(train=TrainConfig(global_batch_size=8, micro_batch_size=2),
                    launch=LaunchConfig(nproc=2, max_restarts=1, on_rank_loss="shrink"))
    with pytest.raises(ConfigError, match=r"dp >= 2\), and this layout has dp=1 \(tp=1 pp=2 cp=1 on 2 ranks\).*"
                                          r"--nproc 4"):
        check_can_shrink(job, Strategy(dp=1, pp=2), 2)
    with pytest.raises(ConfigError, match="--max-restarts is 0"):
        check_can_shrink(JobConfig(launch=LaunchConfig(nproc=2, on_rank_loss="shrink")), Strategy(dp=2), 2)
    with pytest.raises(ConfigError, match="--checkpoint-every 0"):
        check_can_shrink(JobConfig(train=TrainConfig(checkpoint_every=0), launch=job.launch), Strategy(dp=2), 2)
    with pytest.raises(ConfigError, match="--dp-shares 3,1"):
        check_can_shrink(JobConfig(strategy=Strategy(dp_shares="3,1"), train=job.train, launch=job.launch),
                         Strategy(dp=2, dp_shares="3,1"), 2)
    with pytest.raises(ConfigError, match="could not go on with fewer replicas; on 1 ranks: .*rule parameter-server"):
        check_can_shrink(job, Strategy(dp=2, dp_mode="async"), 2)
    check_can_shrink(job, Strategy(dp=2), 2)  # dp=2 on 2 ranks: one replica may go
    with pytest.raises(ConfigError, match="launch.on_rank_loss must be one of"):
        JobConfig(launch=LaunchConfig(on_rank_loss="grow")).validate()


def test_one_reading_of_a_checkpoint_folders_step_for_the_launcher_and_the_checkpoints():
    """The launcher (which logs the step a shrunk job resumes from) and the checkpoint code read a folder's step
    with the same function, from a layer below both; a name that is not a checkpoint's gives no step."""
    from autopar import checkpoint_names, launch
    from autopar.train import checkpoint, manifest
    assert launch.step_of is manifest.step_of is checkpoint_names.step_of
    assert checkpoint.checkpoint_name is checkpoint_names.checkpoint_name
    for step in (0, 7, 123456789):
        assert checkpoint_names.step_of(checkpoint_names.checkpoint_name(step)) == step
    assert checkpoint_names.step_of("/runs/a_b/checkpoints/step_00000012.partial") == 12
    assert checkpoint_names.step_of(Path("runs/step_3x")) is None and checkpoint_names.step_of("latest") is None
