"""Fault tolerance: restarts, preemption, hangs, bad numbers, checkpoint integrity, resume as typed.

Faults are injected with AUTOPAR_FAULT (autopar/train/faults.py). The command-line tests start
real processes (as a user's job runs); the rest use the rank pool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import max_relative_difference, train_builtin

ROOT = Path(__file__).resolve().parents[1]
# as tests/test_cli.py; warmup 20 is the CLI default, given to the Trainer API reference explicitly
SMALL = ["--model", "gpt-tiny", "--seq-len", "32", "--global-batch-size", "8", "--lr", "1e-3", "--no-progress",
         "--eval-batches", "1", "--micro-batch-size", "2"]
REFERENCE = dict(steps=8, warmup_steps=20, lr=1e-3, global_batch_size=8, micro_batch_size=2, eval_batches=1)


def autopar(*args: str, fault: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "AUTOPAR_FAULT"}
    if fault:
        env["AUTOPAR_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------- restart and preemption


@pytest.mark.timeout(600)  # four job starts: 3 min measured at load average 30 on 2 cores
def test_sigterm_then_a_killed_rank_finish_with_the_uninterrupted_losses(rank_pool, tmp_path):
    """SIGTERM at step 3 saves step 3 and exits 75; `--resume RUN_DIR` (nothing else) continues with the run's
    own config; rank 1 killed at step 6 under --max-restarts 1 restarts from step 4's checkpoint; the
    losses of all 8 steps are those of an uninterrupted run."""
    reference = rank_pool(2).run(train_builtin, "gpt-tiny", str(tmp_path / "reference"), **REFERENCE)[0]["losses"]
    run = tmp_path / "run"
    stopped = autopar("train", *SMALL, "--nproc", "2", "--steps", "8", "--out", str(run),
                      fault="sigterm:rank=1:step=3")
    assert stopped.returncode == 75, stopped.stderr
    assert "stopped on a signal after step 3 of 8" in stopped.stderr and f"--resume {run}" in stopped.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000003"]
    assert len(losses(run)) == 3
    done = autopar("train", "--resume", str(run), "--max-restarts", "1", "--checkpoint-every", "2",
                   fault="kill:rank=1:step=6")
    assert done.returncode == 0, done.stderr
    assert "rank 1 was killed by SIGKILL; restart 1 of 1, from step_00000004" in done.stderr
    restarts = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert [(r["restart"], r["cause"], r["resumes_from"]) for r in restarts] == \
        [(1, "rank 1 was killed by SIGKILL", "step_00000004")]
    got = losses(run)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, 9))
    assert max_relative_difference(reference, got) < 1e-5, (reference, got)


def test_a_hang_is_reported_with_rank_and_operation(tmp_path):
    import re
    run = tmp_path / "run"
    hung = autopar("train", *SMALL, "--nproc", "2", "--steps", "4", "--hang-timeout-s", "5", "--out", str(run),
                   fault="hang:rank=1:step=2")
    assert hung.returncode == 124, hung.stderr
    idle = [int(s) for s in re.findall(r"no step finished for (\d+) s", hung.stderr)]
    assert idle and all(5 <= s < 5 + 30 for s in idle), hung.stderr  # reported within timeout + 30 s of the hang
    # rank 0 waits for rank 1 in a collective of step 2; rank 1 sits in the injected sleep
    assert "hang on rank 0" in hung.stderr and "rank 0 is in step 2: torch.distributed all_reduce" in hung.stderr
    assert "rank 1 is in step 2: at autopar/train/faults.py" in hung.stderr
    for rank in (0, 1):
        report = (run / f"hang_rank{rank}.txt").read_text()
        assert "stacks of every thread" in report and "File " in report and "most recent call first" in report


def test_bad_exit_codes_are_not_restarted(tmp_path):
    from autopar.launch import launch
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(2 if os.environ['RANK'] == '1' else 0)\n")
    assert launch([sys.executable, str(script)], 2, max_restarts=3, run_dir=str(tmp_path)) == 2
    assert not (tmp_path / "restarts.jsonl").exists()  # bad input fails the same way again: no restart


# ---------------------------------------------------------------------------- bad numbers


def _bad_steps(out: str) -> dict:
    """NaN loss share on rank 1 at step 3, then at steps 2 and 3 with --max-bad-steps 1, then at 2 with 0."""
    from autopar.errors import TrainingError
    results = {}
    try:
        os.environ["AUTOPAR_FAULT"] = "nan:rank=1:step=3"
        results["one"] = train_builtin("gpt-tiny", out + "/one", steps=4, max_bad_steps=1)
        for name, fault, allowed in (("two", "nan:rank=1:step=2", 0),):
            os.environ["AUTOPAR_FAULT"] = fault
            try:
                train_builtin("gpt-tiny", out + "/" + name, steps=4, max_bad_steps=allowed, checkpoint_every=1)
                results[name] = "no error"
            except TrainingError as exc:
                results[name] = str(exc)
    finally:
        del os.environ["AUTOPAR_FAULT"]
    return results


def test_a_non_finite_step_is_skipped_on_every_rank_and_counted(rank_pool, tmp_path):
    import math
    ranks = rank_pool(2).run(_bad_steps, str(tmp_path))
    one = ranks[0]["one"]
    assert math.isnan(one["losses"][2]) and all(math.isfinite(x) for i, x in enumerate(one["losses"]) if i != 2)
    for other in ranks[1:]:  # replicas agree: the skip was decided together (no update anywhere)
        assert all((other["one"]["params"][k] == v).all() for k, v in one["params"].items())
    records = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"] is None, r.get("skipped"), r.get("bad_steps")) for r in records] == \
        [(1, False, None, None), (2, False, None, None), (3, True, True, 1), (4, False, False, 1)]
    for r in ranks:  # --max-bad-steps 0 stops at once, on every rank, before a checkpoint of that step
        assert "the loss is nan at step 2" in r["two"] and "Lower the learning rate" in r["two"], r["two"]
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["latest", "step_00000001"]


# ---------------------------------------------------------------------------- checkpoint integrity


def _resume_error(path: str, out: str) -> str:
    from autopar.errors import CheckpointError
    try:
        train_builtin("gpt-tiny", out, steps=6, resume=path)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(rank_pool, tmp_path):
    from autopar.train.manifest import describe
    pool = rank_pool(2)
    full = pool.run(train_builtin, "gpt-tiny", str(tmp_path / "run"), steps=6, checkpoint_every=3)[0]
    root = tmp_path / "run" / "checkpoints"
    manifest = json.loads((root / "step_00000006" / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["layout"]["dp"] == 2 and len(manifest["config_sha256"]) == 64
    assert {".metadata", "trainer.json", "rng_rank0.pt", "rng_rank1.pt"} <= manifest["files"].keys()
    shard = next(root.glob("step_00000006/__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, different checksum
    shard.write_bytes(bytes(data))
    listing = describe(tmp_path / "run")
    assert "step_00000006" in listing and "damaged: __1_0.distcp does not match the sha256" in listing
    assert "step_00000003" in listing and "complete  [--resume uses this]" in listing
    # from the run folder: a warning and step 3; --keep-checkpoints 1 then keeps only the newest
    again = pool.run(train_builtin, "gpt-tiny", str(tmp_path / "again"), steps=6, resume=str(tmp_path / "run"),
                     checkpoint_every=1, keep_checkpoints=1)[0]
    assert again["first_step"] == 4
    assert again["losses"] == full["losses"][3:]  # bitwise: same ops on the same restored state
    assert sorted(p.name for p in (tmp_path / "again" / "checkpoints").iterdir()) == ["latest", "step_00000006"]
    # the damaged folder itself is refused by name; a run folder without checkpoints says so, and a run
    # that fails before its first step leaves no run folder behind
    messages = pool.run(_resume_error, str(root / "step_00000006"), str(tmp_path / "o1"))
    assert all("does not match the sha256" in m and "corrupt" in m for m in messages), messages
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "run.json").write_text("{}")
    messages = pool.run(_resume_error, str(empty), str(tmp_path / "o2"))
    assert all("has no complete checkpoint yet" in m for m in messages), messages
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


# ---------------------------------------------------------------------------- resume as users type it


def _parse(*argv: str):
    from autopar.cli import build_parser, resolve_job
    return resolve_job(build_parser().parse_args(["train", *argv]))


def test_resume_and_config_read_a_run_folder_as_users_mean_it(tmp_path):
    from autopar.config import JobConfig, merge, to_toml
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    written = merge(JobConfig(), {"model": {"name": "gpt-tiny"}, "strategy": {"dp": 2, "pp": 1},
                                  "train": {"steps": 9, "out": str(run)}, "launch": {"nproc": 2}})
    (run / "config.toml").write_text(to_toml(written))  # an older run's file may still name its folder
    resumed = _parse("--resume", str(run), "--steps", "12", "--nproc", "4")
    assert (resumed.model.name, resumed.train.steps, resumed.launch.nproc) == ("gpt-tiny", 12, 4)
    assert resumed.train.out == str(run) and resumed.train.resume == str(run)  # continues in its own folder
    assert resumed.strategy.dp is None  # re-derived from the new process count
    from_checkpoint = _parse("--resume", str(run / "checkpoints" / "step_00000005"))
    assert from_checkpoint.model.name == "gpt-tiny" and from_checkpoint.train.out == str(run)
    fresh = _parse("--config", str(run / "config.toml"))
    assert fresh.model.name == "gpt-tiny" and fresh.train.out is None and fresh.train.resume is None
    assert _parse().train.checkpoint_interval == 100  # checkpoints by default
    assert _parse("--checkpoint-every", "0").train.checkpoint_interval == 0


def test_fault_specs_parse_or_say_what_would_work():
    from autopar.errors import ConfigError
    from autopar.train.faults import Fault
    assert Fault.parse("kill:rank=1:step=7") == Fault("kill", rank=1, step=7, attempt=0)
    assert Fault.parse("nan:step=2:rank=0:attempt=1").due(0, 2, 1)
    for bad, words in (("explode:rank=1:step=2", "unknown fault 'explode'"), ("kill:rank=1", "missing step"),
                       ("kill:rank=x:step=1", "'rank=x' is not rank=N")):
        with pytest.raises(ConfigError, match=words):
            Fault.parse(bad)


# ---------------------------------------------------------------------------- two torchrun "nodes" on loopback


def _agent(port: int, run: Path, *args: str, nnodes: str = "2", max_restarts: int = 0,
           layout: tuple[str, ...] = ("--pp", "2")) -> subprocess.Popen:
    """One torchrun agent (a "node") with 2 worker processes, in a session of its own (killed as one)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "loopback",
               "--rdzv-conf", "last_call_timeout=20,join_timeout=300", "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
               "-m", "autopar", "train", *SMALL, *layout, "--out", str(run), *args]
    env = {k: v for k, v in os.environ.items() if k not in ("AUTOPAR_FAULT", "RANK", "WORLD_SIZE")}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _wait_for_store(port: int, timeout: float = 120) -> None:
    import socket
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"no rendezvous store on port {port} after {timeout} s"
            time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_torchrun_agents_train_dp_x_pp_as_one_process(rank_pool, tmp_path):
    from autopar.launch import free_port
    reference = rank_pool(1).run(train_builtin, "gpt-tiny", str(tmp_path / "one"), **{**REFERENCE, "steps": 4})[0]
    run, port = tmp_path / "run", free_port()
    agents = [_agent(port, run, "--steps", "4") for _ in range(2)]
    outputs = [a.communicate(timeout=400)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    assert json.loads((run / "run.json").read_text())["world_size"] == 4
    assert max_relative_difference(reference["losses"], losses(run)) < 1e-5  # dp=2 x pp=2 over two "nodes"


def _kill_second_agent_after_step_2(run: Path, *args: str, layout: tuple[str, ...]) -> tuple[str, list[dict]]:
    """Two agents of 2 workers; agent 2 dies (workers and all) once the step-2 checkpoint exists; agent 1
    restarts into a world of 2. Returns agent 1's output and the run's restarts log."""
    import signal
    from autopar.launch import free_port
    port = free_port()
    agents = [_agent(port, run, *args, nnodes="1:2", max_restarts=1, layout=layout)]
    _wait_for_store(port)  # agent 1 hosts the rendezvous store; agent 2, killed below, only joins it
    agents.append(_agent(port, run, *args, nnodes="1:2", max_restarts=1, layout=layout))
    deadline = time.monotonic() + 400
    while not (run / "checkpoints" / "step_00000002").is_dir():
        assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "no checkpoint of step 2"
        time.sleep(0.2)
    for pid in [agents[1].pid, *_descendants(agents[1].pid)]:  # the "node" goes away, workers and all
        os.kill(pid, signal.SIGKILL)  # (torchrun starts its workers in sessions of their own)
    output = agents[0].communicate(timeout=400)[0]
    agents[1].wait()
    assert agents[0].returncode == 0, output
    return output, [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_torchrun_agent_restarts_elastically_re_plans_and_resumes(rank_pool, tmp_path):
    """--strategy auto with pp fixed at 2 over two agents (world 4); agent 2 (half the job) dies after the step-2
    checkpoint; agent 1 restarts its workers (torchrun --max-restarts), which meet again as a world of 2 once
    the rendezvous's last call (20 s) has passed; rank 0 searches again for 2 processes (pp 2 kept, dp
    re-derived: 1), every rank runs that plan, and the newest checkpoint resumes under it (resharded) with
    the uninterrupted run's losses. (One launch for all of it: each costs a minute on 2 cores.)"""
    reference = rank_pool(1).run(train_builtin, "gpt-tiny", str(tmp_path / "one"), **{**REFERENCE, "steps": 6})[0]
    run = tmp_path / "run"
    output, restarts = _kill_second_agent_after_step_2(run, "--steps", "6", "--checkpoint-every", "2",
                                                       layout=("--strategy", "auto", "--pp", "2"))
    assert [(r["restart"], r["by"], r["world_size"]) for r in restarts] == [(1, "torchrun", 2)], restarts
    assert restarts[0]["resumes_from"] is not None, restarts  # resumed from a checkpoint, not from step 0
    plan = json.loads((run / "plan.json").read_text())
    assert plan["nproc"] == 2 and plan["replanned"] == {"from_nproc": 4, "to_nproc": 2, "how": "searched again"}
    assert [p["nproc"] for p in plan["earlier_plans"]] == [4]
    assert plan["earlier_plans"][0]["strategy"]["pp"] == 2
    strategy = plan["strategy"]
    assert (strategy["dp"], strategy["tp"], strategy["pp"]) == (1, 1, 2), strategy
    assert "world changed from 4 to 2: re-planned: " in output, output
    assert json.loads((run / "run.json").read_text())["world_size"] == 2
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))
    assert max_relative_difference(reference["losses"], losses(run)) < 1e-5
