"""The delayed-SGD simulator: tau=0 is SGD bit for bit, fixed and random delays read the right past
iterate, and the parameter server in round-robin order is the simulator bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from autopar.async_sgd import DelayedSGD, FixedDelay, RandomDelay, ScheduledDelay, train_with_parameter_server
from autopar.errors import ConfigError
from test_param_server import tiny_problem


def _quadratic(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(16, 6, generator=gen), torch.randn(16, generator=gen)
    weight = nn.Parameter(torch.randn(6, generator=gen))
    bias = nn.Parameter(torch.zeros(()))
    return weight, bias, lambda w, c, t: ((a[t % 16] @ w + c - b[t % 16]) ** 2 + 0.1 * (w ** 2).sum())


def test_zero_delay_is_plain_sgd_bit_for_bit():
    w1, c1, loss1 = _quadratic()
    w2, c2, loss2 = _quadratic()
    plain = torch.optim.SGD([w1, c1], lr=0.05, weight_decay=0.01, foreach=True)
    delayed = DelayedSGD([w2, c2], lr=0.05, delay=0, weight_decay=0.01)
    for t in range(30):
        loss1(w1, c1, t).backward()
        plain.step()
        plain.zero_grad()
        with delayed.delayed_parameters() as tau:
            assert tau == 0
            loss2(w2, c2, t).backward()
        delayed.step()
        delayed.zero_grad()
    assert torch.equal(w1, w2) and torch.equal(c1, c2)  # bitwise: DelayedSGD runs the same torch SGD ops


def _explicit_delayed_run(delays: list[int], lr: float) -> list[torch.Tensor]:
    """The recursion written out with every iterate kept: w_{t+1} = w_t - lr * grad(w_{max(0, t - tau_t)})."""
    w, c, loss = _quadratic()
    iterates = [(w.detach().clone(), c.detach().clone())]
    for t, tau in enumerate(delays):
        old_w, old_c = (x.clone().requires_grad_() for x in iterates[max(0, t - tau)])
        loss(old_w, old_c, t).backward()
        current_w, current_c = iterates[-1]
        iterates.append((current_w - lr * old_w.grad, current_c - lr * old_c.grad))
    return [torch.cat([x.reshape(-1), y.reshape(-1)]) for x, y in iterates]


@pytest.mark.parametrize("delay", [FixedDelay(3), RandomDelay(5, seed=7),
                                   ScheduledDelay(lambda t: t % 3, max_delay=2)], ids=repr)
def test_delays_read_the_right_past_iterate(delay):
    steps, lr = 40, 0.02
    w, c, loss = _quadratic()
    opt = DelayedSGD([w, c], lr=lr, delay=delay)
    used = []
    for t in range(steps):
        with opt.delayed_parameters() as tau:
            loss(w, c, t).backward()
        used.append(tau)
        opt.step()
        opt.zero_grad()
    assert used == [min(delay(t), t) for t in range(steps)]  # before the start: w_0
    assert all(0 <= tau <= delay.max_delay for tau in used)
    expected = _explicit_delayed_run(used, lr)[-1]
    got = torch.cat([w.detach().reshape(-1), c.detach().reshape(-1)])
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-7)
    # and the delay mattered: plain SGD ends elsewhere
    assert not torch.allclose(got, _explicit_delayed_run([0] * steps, lr)[-1], rtol=1e-4, atol=1e-5)


def test_random_delay_is_seeded_and_covers_its_range():
    draws = [RandomDelay(4, seed=3)(t) for t in range(200)]
    again = RandomDelay(4, seed=3)
    assert [again(t) for t in range(200)] == draws
    assert set(draws) == {0, 1, 2, 3, 4}
    assert [RandomDelay(4, seed=4)(t) for t in range(200)] != draws


def test_bad_delays_are_clear_errors():
    w, c, _ = _quadratic()
    with pytest.raises(ConfigError, match="tau must be an integer >= 0.*got -1"):
        FixedDelay(-1)
    with pytest.raises(ConfigError, match="tau_max must be an integer >= 0.*got 1.5"):
        RandomDelay(1.5)
    with pytest.raises(ConfigError, match="lr must be > 0"):
        DelayedSGD([w, c], lr=0.0, delay=1)
    schedule = DelayedSGD([w, c], lr=0.1, delay=ScheduledDelay(lambda t: 5, max_delay=2))
    with pytest.raises(ConfigError, match="tau=5 at step 0, outside \\[0, 2\\]"):
        with schedule.delayed_parameters():
            pass


# ---------------------------------------------------------------------------- the parameter server's model


def _round_robin_run(staleness: int, servers: int, steps: int) -> dict:
    model, batch_fn, loss_fn = tiny_problem()
    result = train_with_parameter_server(model, loss_fn, batch_fn, steps=steps, lr=0.05, staleness=staleness,
                                         servers=servers, weight_decay=0.01, round_robin=True, timeout_s=60)
    return {"params": result.params, "worker_losses": result.worker_losses, "pushes": result.pushes,
            "workers": torch.distributed.get_world_size() - servers}


def _simulate(delay, workers: int, steps: int) -> tuple[torch.Tensor, list[float]]:
    """Update u applies worker u % W's gradient of its step u // W, as the round-robin server does."""
    model, batch_fn, loss_fn = tiny_problem()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = DelayedSGD([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                     lr=0.05, delay=delay)
    losses = []
    for u in range(steps * workers):
        with opt.delayed_parameters():
            loss = loss_fn(model, batch_fn(u // workers, u % workers, workers))
            (loss * (1.0 / workers)).backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), losses


@pytest.mark.parametrize("servers", [1, 2])
def test_round_robin_server_is_delayed_sgd_bit_for_bit(rank_pool, servers):
    """Loose bound: W workers in turn give the fixed delay tau = W - 1. Bound 0: a synchronous round,
    where the i-th push of a step is i updates stale. Both equal the simulator exactly."""
    steps = 8
    for staleness, delay_of in ((50, lambda w: FixedDelay(w - 1)),
                                (0, lambda w: ScheduledDelay(lambda u: u % w, max_delay=w - 1))):
        got = rank_pool(4).run(_round_robin_run, staleness, servers, steps)[0]
        workers = got["workers"]
        params, losses = _simulate(delay_of(workers), workers, steps)
        # bitwise: same forward/backward shapes per worker, same elementwise SGD update on same-size tensors
        assert torch.equal(params, got["params"]), (staleness, float((params - got["params"]).abs().max()))
        ps_losses = [got["worker_losses"][u % workers][u // workers] for u in range(steps * workers)]
        assert ps_losses == losses
        if staleness:
            assert {p.staleness for p in got["pushes"] if p.clock > 0} == {workers - 1}


# ---------------------------------------------------------------------------- the study


@pytest.mark.parametrize("name", ["least-squares", "logistic"])
def test_study_gradient_matches_autograd(name):
    from autopar.reproduce.delayed_sgd import PROBLEMS, make_data, sample_gradient, sample_losses
    problem = PROBLEMS[name]
    data = make_data(problem, seeds=3)
    w = (0.3 * torch.randn(3, problem.dim, dtype=torch.float64)).requires_grad_()
    x, y = data["x_train"][:, 5], data["y_train"][:, 5]
    objective = sample_losses(problem, w, x[:, None], y[:, None]).sum() + 0.5 * problem.l2 * (w ** 2).sum()
    objective.backward()
    written = sample_gradient(problem, w.detach(), x, y, out=torch.empty_like(w))
    assert torch.allclose(written, w.grad, rtol=1e-12, atol=1e-12)


def test_study_quick_run_writes_table_plot_and_json(tmp_path, capsys):
    from autopar.reproduce import run_study
    assert run_study("delayed-sgd", ["--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "generalization gap" in printed and "| tau |" in printed
    results = json.loads((tmp_path / "delayed_sgd.json").read_text())
    assert (tmp_path / "delayed_sgd.png").stat().st_size > 10_000
    assert (tmp_path / "table.md").read_text() in printed
    cells = results["problems"]["least-squares"]["cells"]
    final = str(results["steps"])
    # every cell has every seed's losses, and the delay changed the trajectory (but tau=0 rules coincide)
    assert len(cells["fixed, constant eta|8"]["by_step"][final]["gap"]) == results["seeds"]
    assert cells["fixed, constant eta|8"]["by_step"][final] != cells["fixed, constant eta|0"]["by_step"][final]
    assert cells["fixed, eta/(1+tau)|0"] == cells["fixed, constant eta|0"]
    with pytest.raises(ConfigError, match="unknown problem"):
        run_study("delayed-sgd", ["--quick", "--problems", "svm", "--out", str(tmp_path)])
