"""Checkpoints: exact resume, resume under another layout, atomic saves, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import max_param_difference, max_relative_difference, train_builtin

STEPS = 10


def test_resume_gives_the_uninterrupted_losses(rank_pool, tmp_path):
    pool = rank_pool(2)
    full = pool.run(train_builtin, "gpt-tiny", str(tmp_path / "full"), steps=STEPS, checkpoint_every=4)[0]
    checkpoints = sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir())
    assert checkpoints == ["latest", "step_00000004", "step_00000008", "step_00000010"]
    # resume from a checkpoint folder, and from a run folder (its latest = the final one: nothing left to do)
    resumed = pool.run(train_builtin, "gpt-tiny", str(tmp_path / "resumed"), steps=STEPS,
                       resume=str(tmp_path / "full" / "checkpoints" / "step_00000004"))[0]
    assert resumed["first_step"] == 5
    assert resumed["losses"] == full["losses"][4:]  # bitwise: same ops on the same state
    assert max_param_difference(full["params"], resumed["params"]) == 0.0  # bitwise: same ops, shapes, order


def test_resume_under_another_data_parallel_layout(rank_pool, tmp_path):
    full = rank_pool(2).run(train_builtin, "gpt-tiny", str(tmp_path / "dp2"), steps=STEPS, checkpoint_every=5)[0]
    resumed = rank_pool(4).run(train_builtin, "gpt-tiny", str(tmp_path / "dp4"), steps=STEPS, micro_batch_size=1,
                               resume=str(tmp_path / "dp2"))
    for got in resumed:  # run folder -> latest is step 10 (final); resume from 5 explicitly instead
        assert got["losses"] == []
    resumed = rank_pool(4).run(train_builtin, "gpt-tiny", str(tmp_path / "dp4b"), steps=STEPS, micro_batch_size=1,
                               resume=str(tmp_path / "dp2" / "checkpoints" / "step_00000005"))[0]
    assert max_relative_difference(full["losses"][5:], resumed["losses"]) < 1e-5


def _crash_during_save(run_dir: str) -> dict:
    """Train 4 steps (checkpoint at 4), then a save of step 6 that dies half-way on every rank."""
    import torch.distributed.checkpoint as dcp

    from autopar.train import checkpoint as ckpt
    result = train_builtin("gpt-tiny", run_dir, steps=4)
    real_save = dcp.save

    def dying_save(state, checkpoint_id):
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"half-written")
        raise OSError("disk full (simulated)")

    ckpt.dcp.save = dying_save
    try:
        import torch.nn as nn
        import torch
        model = nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        ckpt.save_checkpoint(Path(run_dir), 6, model, optimizer, {})
        raised = None
    except OSError as exc:
        raised = str(exc)
    finally:
        ckpt.dcp.save = real_save
    return {"raised": raised, "losses": result["losses"]}


def test_a_crash_mid_save_leaves_the_previous_checkpoint(rank_pool, tmp_path):
    run = tmp_path / "run"
    results = rank_pool(2).run(_crash_during_save, str(run))
    assert all(r["raised"] == "disk full (simulated)" for r in results)
    root = run / "checkpoints"
    assert (root / "latest").read_text() == "step_00000004"
    assert not (root / "step_00000006").exists() and (root / "step_00000006.partial").exists()
    # the run folder still resumes, from step 4 (and continues to 6)
    resumed = rank_pool(2).run(train_builtin, "gpt-tiny", str(tmp_path / "again"), steps=6, resume=str(run))[0]
    assert resumed["first_step"] == 5 and len(resumed["losses"]) == 2


def _resume_error(path: str, out: str) -> str:
    from autopar.errors import CheckpointError
    try:
        train_builtin("gpt-tiny", out, steps=6, resume=path)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_missing_incomplete_and_corrupt_checkpoints(rank_pool, tmp_path):
    pool = rank_pool(2)
    pool.run(train_builtin, "gpt-tiny", str(tmp_path / "run"), steps=2)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    messages = pool.run(_resume_error, str(tmp_path / "nowhere"), str(tmp_path / "o1"))
    assert all("no such folder" in m for m in messages)
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    assert all("no complete checkpoint" in m for m in pool.run(_resume_error, str(empty), str(tmp_path / "o2")))
    for shard in ckpt.glob("*.distcp"):
        shard.write_bytes(b"\x00garbage" * 10)
    messages = pool.run(_resume_error, str(ckpt), str(tmp_path / "o3"))
    assert all("cannot be loaded" in m and "corrupt" in m for m in messages), messages
    (ckpt / ".metadata").unlink()
    assert all("missing .metadata" in m for m in pool.run(_resume_error, str(ckpt), str(tmp_path / "o4")))


def test_corrupt_checkpoint_message_names_the_cause(rank_pool, tmp_path):
    pool = rank_pool(2)
    pool.run(train_builtin, "gpt-tiny", str(tmp_path / "run"), steps=2)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    for shard in ckpt.glob("*.distcp"):
        shard.write_bytes(b"")
    (ckpt / "manifest.json").unlink()  # as a checkpoint saved before manifests: DCP itself finds the damage
    messages = pool.run(_resume_error, str(ckpt), str(tmp_path / "o"))
    assert all("EOFError" in m for m in messages), messages


@pytest.mark.parametrize("first,second", [({"pp": 2}, {"dp": 2}), ({"dp": 2}, {"pp": 2, "schedule": "zb-h1"})])
def test_resume_across_pipeline_and_data_parallel_layouts(rank_pool, tmp_path, first, second):
    full = rank_pool(2).run(train_builtin, "gpt-tiny", str(tmp_path / "a"), steps=STEPS, checkpoint_every=5,
                            strategy=first)[0]
    resumed = rank_pool(2).run(train_builtin, "gpt-tiny", str(tmp_path / "b"), steps=STEPS, strategy=second,
                               resume=str(tmp_path / "a" / "checkpoints" / "step_00000005"))[0]
    assert max_relative_difference(full["losses"][5:], resumed["losses"]) < 1e-5


# (model, world, layout written, world, layout resumed): checkpoints hold whole tensors, so any
# (dp, tp, pp) resumes any other, AdamW moments included.
TP_LAYOUTS = [
    ("gpt-tiny", 8, {"dp": 2, "tp": 2, "pp": 2}, 2, {"tp": 2}),
    ("gpt-tiny", 2, {"tp": 2}, 4, {"tp": 2, "pp": 2}),
    ("hf:llama", 4, {"tp": 2, "dp": 2}, 2, {"dp": 2}),
    ("hf:llama", 2, {"pp": 2}, 4, {"tp": 2, "pp": 2}),
]


@pytest.mark.parametrize("model,world_a,first,world_b,second", TP_LAYOUTS, ids=lambda v: str(v))
def test_resume_across_tensor_parallel_layouts(rank_pool, tmp_path, model, world_a, first, world_b, second):
    args = {"n_layer": 2} if model == "gpt-tiny" else {"num_hidden_layers": 2}
    ranks = rank_pool(world_a).run(train_builtin, model, str(tmp_path / "a"), model_args=args, steps=STEPS,
                                   checkpoint_every=5, strategy=first, micro_batch_size=2)
    full = {**ranks[0], "params": {k: v for r in ranks for k, v in r["params"].items()}}  # every stage's
    resumed = rank_pool(world_b).run(train_builtin, model, str(tmp_path / "b"), model_args=args, steps=STEPS,
                                     strategy=second, micro_batch_size=2,
                                     resume=str(tmp_path / "a" / "checkpoints" / "step_00000005"))
    for got in resumed:
        assert got["first_step"] == 6
        assert max_relative_difference(full["losses"][5:], got["losses"]) < 1e-5, (full["losses"], got["losses"])
        for name, value in got["params"].items():
            assert (value - full["params"][name]).abs().max() < 1e-5, name
