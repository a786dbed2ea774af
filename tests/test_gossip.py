"""D-PSGD gossip: mixing matrices and rho, the invariants of reference §3.6, and bad input."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.data_parallel import LinkModel, Links
from autopar.errors import ConfigError
from autopar.gossip import GossipEngine, GossipMixer, GossipOptions, build_topology, check_gossip_strategy, from_matrix
from autopar.mesh import ProcessMesh

from helpers import max_param_difference, max_relative_difference, train_builtin

# ---------------------------------------------------------------- topologies (single process)

RING_SQRT_RHO = {3: 0.0, 4: 0.3333, 8: 0.8047, 16: 0.9493, 32: 0.9872}  # reference §3.2 table


@pytest.mark.parametrize("n", sorted(RING_SQRT_RHO))
def test_ring_rho_matches_reference(n):
    topology = build_topology("ring", n)
    assert topology.sqrt_rho == pytest.approx(RING_SQRT_RHO[n], abs=5e-5)
    assert topology.rho == pytest.approx(RING_SQRT_RHO[n] ** 2, abs=1e-4)
    if n > 3:
        assert torch.allclose(topology.weights.diagonal(), torch.full((n,), 1 / 3, dtype=torch.float64))
        assert all(len(nbrs) == 2 for nbrs in topology.in_neighbors)


@pytest.mark.parametrize("name", ["ring", "torus", "exponential", "complete"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 12])
def test_builtin_graphs_are_symmetric_doubly_stochastic(name, n):
    topology = build_topology(name, n)
    w = topology.weights
    assert torch.equal(w, w.T) and (w >= 0).all()  # exact: each weight is computed once and mirrored
    assert torch.allclose(w.sum(0), torch.ones(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(w.sum(1), torch.ones(n, dtype=torch.float64), atol=1e-12)
    assert 0 <= topology.rho < 1
    eigen = torch.linalg.eigvalsh(w).abs().sort().values
    assert topology.sqrt_rho == pytest.approx(float(eigen[-2]) if n > 1 else 0.0, abs=1e-9)
    for i in range(n):  # undirected: who I hear from is who hears me
        assert topology.in_neighbors[i] == topology.out_neighbors[i]


def test_graph_shapes():
    assert build_topology("ring", 2).weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    assert build_topology("complete", 5).rho == pytest.approx(0.0, abs=1e-12)
    torus = build_topology("torus", 16)  # 4 x 4 grid, degree 4, Metropolis weight 1/5
    assert {len(n) for n in torus.in_neighbors} == {4}
    assert torus.weights[0, 1] == pytest.approx(0.2) and torus.weights[0, 4] == pytest.approx(0.2)
    exponential = build_topology("exponential", 16)  # hops 1, 2, 4, 8 both ways (8 coincides): degree 7
    assert {len(n) for n in exponential.in_neighbors} == {7}
    assert exponential.sqrt_rho < build_topology("ring", 16).sqrt_rho


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "w.txt"
    path.write_text(text)
    return str(path)


def test_topology_file(tmp_path):
    # a directed 3-cycle with self weights: doubly stochastic, not symmetric
    path = _write(tmp_path, "# my graph\n0.5, 0.5, 0\n0 0.5 0.5\n0.5 0 0.5\n")
    topology = build_topology(path, 3)
    assert topology.in_neighbors == ((1,), (2,), (0,)) and topology.out_neighbors == ((2,), (0,), (1,))
    assert topology.sqrt_rho == pytest.approx(0.5, abs=1e-9)  # singular value of W - J: |0.5 + 0.5 e^{2 pi i/3}|


@pytest.mark.parametrize("text, n, message", [
    ("0.5 0.5 0 0\n0.5 0.5 0 0\n0 0 0.5 0.5\n0 0 0.5 0.5\n", 4, "not connected"),
    ("0.5 0.5 0 0\n0.5 0.4 0.1 0\n0 0.1 0.5 0.5\n0 0 0.5 0.5\n", 4, "not doubly stochastic"),
    ("0.6 0.4\n0.3 0.7\n", 2, "not doubly stochastic"),  # rows fine, columns not
    ("1.5 -0.5\n-0.5 1.5\n", 2, ">= 0"),
    ("0.5 0.5\n0.5 0.5\n", 4, "there are 4 data-parallel replicas"),
    ("0.5 0.5 0\n0.5 0.5\n", 2, "square"),
    ("0.5 x\n", 1, "expected numbers"),
    ("0 1\n1 0\n", 2, "does not contract"),
])
def test_bad_topology_file(tmp_path, text, n, message):
    with pytest.raises(ConfigError, match=message):
        build_topology(_write(tmp_path, text), n)


def test_unknown_topology_and_bad_strategies():
    with pytest.raises(ConfigError, match="unknown topology 'hypercube'.*ring\\|torus"):
        build_topology("hypercube", 4)
    from autopar.strategies import resolve
    with pytest.raises(ConfigError, match="data-parallel only.*rule gossip-data-parallel-only"):
        resolve(autopar.Strategy(dp=2, pp=2, dp_mode="gossip"), autopar.TrainConfig(global_batch_size=8), 4)
    with pytest.raises(ConfigError, match="gossip_order"):
        autopar.Strategy(dp=2, dp_mode="gossip", gossip_order="cta").resolved(2)
    with pytest.raises(ConfigError, match="square"):
        from_matrix(torch.ones(2, 3) / 3, name="x")


def test_trainer_rejects_bad_topology_before_any_process_group(tmp_path):
    trainer = autopar.Trainer(nn.Linear(2, 2), [{"inputs": torch.zeros(2), "labels": torch.zeros(2)}] * 4,
                              strategy=autopar.Strategy(dp_mode="gossip", topology=str(tmp_path / "missing.txt")),
                              config=autopar.TrainConfig(global_batch_size=2, micro_batch_size=2, progress=False))
    with pytest.raises(ConfigError, match="unknown topology"):
        trainer.train()
    assert not dist.is_initialized()


# ---------------------------------------------------------------- pure gossip (reference §3.6 tests 1, 2)


def _consensus(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(mean over replicas, ||X - mean||_F), from every replica's vector."""
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)
    stacked = torch.stack(everyone)
    mean = stacked.mean(0)
    return mean, float((stacked - mean).norm())


def _pure_gossip(name: str, steps: int) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    topology = build_topology(name, n)
    links = Links(LinkModel(), timeout_s=30)
    mixer = GossipMixer(topology, links, rank, list(range(n)))
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(300, dtype=torch.float64, generator=generator) * (rank + 1)
    ratios, mean_errors = [], []
    for _ in range(steps):
        mean, distance = _consensus(x)
        mixer.mix([x])
        new_mean, new_distance = _consensus(x)
        ratios.append(new_distance / distance)
        mean_errors.append(float((new_mean - mean).abs().max() / mean.abs().max()))
    # the slowest mode: x_i = v[i] * z with v the eigenvector of W of largest |lambda| below 1
    values, vectors = torch.linalg.eigh(topology.weights)
    slow = int(values.abs().where(values < 1 - 1e-9, torch.tensor(-1.0, dtype=torch.float64)).argmax())
    z = torch.randn(300, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    x = vectors[rank, slow] * z
    _, distance = _consensus(x)
    mixer.mix([x])
    _, new_distance = _consensus(x)
    mixer.close()
    return {"sqrt_rho": topology.sqrt_rho, "ratios": ratios, "mean_errors": mean_errors,
            "slowest_ratio": new_distance / distance}


@pytest.mark.parametrize("world, name", [(4, "ring"), (8, "ring"), (8, "torus"), (8, "exponential")])
def test_pure_gossip_keeps_mean_and_contracts_by_sqrt_rho(rank_pool, world, name):
    result = rank_pool(world).run(_pure_gossip, name, 6)[0]
    if name == "ring":
        assert result["sqrt_rho"] == pytest.approx(RING_SQRT_RHO[world], abs=5e-5)
    # zero step: the mean of the replicas is kept (1^T W = 1^T), to float64 rounding
    assert max(result["mean_errors"]) < 1e-13
    # each step shrinks the consensus distance by at most sqrt(rho) ...
    assert all(r <= result["sqrt_rho"] + 1e-12 for r in result["ratios"]), result["ratios"]
    assert all(r > 0 for r in result["ratios"])
    # ... and the slowest mode shrinks by exactly sqrt(rho): the bound is tight, rho is the right one
    assert result["slowest_ratio"] == pytest.approx(result["sqrt_rho"], rel=1e-9)


# ---------------------------------------------------------------- the average iterate (test 4), overlap


def _average_iterate(order: str, lr: float, latency: float, steps: int = 5, perturb: bool = False) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    strategy = autopar.Strategy(dp_mode="gossip", topology="ring", gossip_order=order).resolved(n)
    mesh = ProcessMesh.build(strategy, timeout_s=60)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    links = Links(LinkModel(latency_s=latency), group=mesh.group("dp"), timeout_s=30)
    engine = GossipEngine(model, mesh, device=torch.device("cpu"), seed=0, forward_fn=lambda m, b: m(b["inputs"]),
                          autocast=contextlib.nullcontext, links=links, verbose=False,
                          options=GossipOptions.of(strategy))
    if perturb:  # replicas start apart (they start equal otherwise)
        with torch.no_grad():
            for p in engine.flat.params:
                p.add_(torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(rank)))
    optimizer = torch.optim.SGD(engine.module.parameters(), lr=lr)
    loss_share = lambda out, batch: (out - batch["labels"]).square().mean() / n  # shares sum to the global mean

    def average() -> torch.Tensor:
        flat = engine.flat.gather()[0].clone()
        dist.all_reduce(flat)
        return flat / n

    errors, distances = [], []
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + rank)
        batch = {"inputs": torch.randn(8, 6, dtype=torch.float64, generator=generator),
                 "labels": torch.randn(8, 1, dtype=torch.float64, generator=generator) * (rank + 1)}
        before = average()
        engine.forward_backward([batch], loss_share)
        mean_gradient = torch.cat([p.grad.reshape(-1) for p in engine.flat.params])
        dist.all_reduce(mean_gradient)
        mean_gradient /= n
        optimizer.step()
        engine.zero_grad()
        after = average()  # atc: before combining; the combine keeps the mean
        expected = before - lr * mean_gradient
        errors.append(float((after - expected).abs().max() / expected.abs().max()))
        distances.append(engine.consensus_distance())
    if engine._combine_pending:
        engine.combine()
    final = engine.flat.gather()[0]
    engine.close()
    return {"errors": errors, "distances": distances, "final": final}


@pytest.mark.parametrize("order", ["dpsgd", "atc"])
def test_average_iterate_follows_averaged_gradient(rank_pool, order):
    pool = rank_pool(4)
    results = pool.run(_average_iterate, order, 0.1, 0.0)
    for r in results:
        assert max(r["errors"]) < 1e-12, r["errors"]
        assert min(r["distances"]) > 1e-3  # the replicas really differ: the rule is not trivial
    assert not torch.equal(results[0]["final"], results[1]["final"])
    # an injected latency changes the timing only: the same bits come out
    delayed = pool.run(_average_iterate, order, 0.1, 0.02)
    for r, d in zip(results, delayed):
        assert torch.equal(r["final"], d["final"])  # bitwise: a delay reorders nothing, same ops in same order


def test_zero_step_through_the_engine_keeps_the_mean(rank_pool):
    results = rank_pool(4).run(_average_iterate, "dpsgd", 0.0, 0.0, perturb=True)
    for r in results:
        assert max(r["errors"]) < 1e-13  # lr = 0: the average never moves while the replicas mix
        distances = r["distances"]
        assert distances[0] > 1.0
        # ring n=4: each round shrinks the distance to consensus by at least sqrt(rho) = 1/3
        assert all(b <= a / 3 * (1 + 1e-9) for a, b in zip(distances, distances[1:])), distances


# ---------------------------------------------------------------- complete graph vs all-reduce (test 3)

_TRAIN = dict(steps=6, optimizer="sgd", lr=0.2, grad_clip=0.0, warmup_steps=0, eval_every=3)


def test_complete_graph_atc_equals_allreduce_and_dpsgd_does_not(rank_pool, tmp_path):
    pool = rank_pool(4)
    runs = {}
    for label, strategy in [("allreduce", {}),
                            ("atc", {"dp_mode": "gossip", "topology": "complete", "gossip_order": "atc"}),
                            ("dpsgd", {"dp_mode": "gossip", "topology": "complete", "gossip_order": "dpsgd"})]:
        runs[label] = pool.run(train_builtin, "gpt-tiny", str(tmp_path / label), strategy=strategy, **_TRAIN)
    reference = runs["allreduce"][0]
    for rank_result in runs["atc"]:
        assert max_relative_difference(rank_result["losses"], reference["losses"]) < 1e-5
        assert max_param_difference(rank_result["params"], reference["params"]) < 1e-5
        assert abs(rank_result["eval_loss"] - reference["eval_loss"]) < 1e-5 * reference["eval_loss"]
    dpsgd = runs["dpsgd"]
    assert max_param_difference(dpsgd[0]["params"], reference["params"]) > 1e-3
    assert max_relative_difference(dpsgd[0]["losses"][1:], reference["losses"][1:]) > 1e-4
    assert dpsgd[0]["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-6)  # same start
    for other in dpsgd[1:]:  # the checkpoint at the end set every replica to the average
        assert max_param_difference(other["params"], dpsgd[0]["params"]) == 0.0  # bitwise: one all-reduce result


# ---------------------------------------------------------------- checkpoints hold the average


def test_gossip_resume_continues_from_the_averaged_checkpoint(rank_pool, tmp_path):
    pool = rank_pool(4)
    strategy = {"dp_mode": "gossip", "topology": "ring"}
    settings = dict(steps=6, optimizer="sgd", lr=0.2, grad_clip=0.0, checkpoint_every=3)
    full = pool.run(train_builtin, "gpt-tiny", str(tmp_path / "full"), strategy=strategy, **settings)
    resumed = pool.run(train_builtin, "gpt-tiny", str(tmp_path / "resumed"), strategy=strategy,
                       resume=str(tmp_path / "full" / "checkpoints" / "step_00000003"), **settings)
    for f, r in zip(full, resumed):
        assert r["first_step"] == 4
        # the uninterrupted run also set its replicas to the average at step 3: same state, same bits
        assert r["losses"] == f["losses"][3:]  # bitwise: same ops, shapes and order on the same state
        assert max_param_difference(f["params"], r["params"]) == 0.0  # (the same)


# ---------------------------------------------------------------- from the command line


def _autopar(*args: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True, timeout=180,
                          cwd=root)


def test_command_line_gossip_run_and_bad_topology(tmp_path):
    small = ["train", "--model", "gpt-tiny", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
             "--no-progress", "--eval-batches", "1", "--steps", "3", "--optimizer", "sgd", "--lr", "0.1",
             "--dp-mode", "gossip"]
    done = _autopar(*small, "--nproc", "2", "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert "gossip topology ring: 2 replicas" in done.stdout
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["gossip"]["rho"] == 0.0 and info["gossip"]["mixing_matrix"] == [[0.5, 0.5], [0.5, 0.5]]
    assert info["strategy"]["dp_mode"] == "gossip"
    split = tmp_path / "split.txt"
    split.write_text("1 0\n0 1\n")
    done = _autopar(*small, "--nproc", "2", "--topology", str(split))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    # refused by `autopar train` itself (strategies.resolve), before any rank starts
    assert "not connected" in done.stderr and "(rank " not in done.stderr, done.stderr
