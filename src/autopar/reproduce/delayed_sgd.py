"""`autopar reproduce delayed-sgd`: the generalization gap of delayed SGD against the delay tau
(Deng et al., arXiv 2308.09430: "asynchronous delays reduce the generalization error").

What runs, for each convex problem and each tau in the grid, on every seed:
- least squares, 0.5 (x.w - y)^2, and L2-regularised logistic regression,
  log(1 + exp(-y x.w)) + (lambda/2)|w|^2 (strongly convex); data generated from a random
  teacher with label noise (the seed is stated: problem seed s uses torch.Generator(s));
  n training samples, a large held-out set standing in for the population;
- single-sample SGD (i_t uniform, from a sampling stream of its own, the same for every
  tau) for T steps from w_0 = 0, through the `DelayedSGD` optimizer that the parameter
  server is tested against (async_sgd/delayed.py): fixed delay tau, and random delay
  tau_t uniform in {0..tau};
- step-size rules: "constant" (the same eta for every tau, small enough to be stable at
  the largest tau, fixed and random delays); "constant 5 eta" (fixed delays, nearer the
  stability limit, where a delay changes the trajectory more; it may diverge at large tau,
  reported as such); and "scaled" eta/(1+tau) (the condition eta <~ 1/(L tau) that
  stability analyses of delayed SGD assume), with a control for it: plain SGD (tau = 0)
  run with the same reduced step eta/(1+tau), which separates the effect of the delay
  from the effect of the smaller step.
Reported: the generalization gap, test loss minus training loss (the regulariser cancels),
at the end and at T/4, T/2, as mean and standard error over seeds, with the mean training
loss beside it (a smaller gap bought by fitting less is no gain); a table, a plot
(delayed_sgd.png) and every number (delayed_sgd.json) in --out.

The seeds' problems are independent rows of one (seeds x d) parameter, so one optimizer
step advances every seed at once; a random-delay run draws one delay sequence (seed 0),
shared by the seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..async_sgd.delayed import DelayedSGD, FixedDelay, RandomDelay
from ..errors import ConfigError


@dataclass(frozen=True)
class Problem:
    name: str
    dim: int
    train_samples: int
    eta: float  # constant-rule step size
    l2: float = 0.0  # logistic: lambda


PROBLEMS = {
    "least-squares": Problem("least-squares", dim=40, train_samples=50, eta=0.004),
    "logistic": Problem("logistic", dim=50, train_samples=100, eta=0.01, l2=1e-3),
}
TEST_SAMPLES = 4000


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar reproduce delayed-sgd", description=__doc__.split("\n\n")[0] +
                                " Step sizes: constant eta, 5 eta, and eta/(1+tau) with a same-step SGD control.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--taus", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32], help="delays to compare")
    p.add_argument("--seeds", type=int, default=20, help="independent problems (data and sampling) per cell")
    p.add_argument("--steps", type=int, default=2000, help="SGD steps T (single samples)")
    p.add_argument("--problems", nargs="+", default=list(PROBLEMS), help=" ".join(PROBLEMS))
    p.add_argument("--out", default="runs/reproduce-delayed-sgd", help="folder for delayed_sgd.json/.png, table.md")
    p.add_argument("--quick", action="store_true", help="a smoke run: 3 taus, 4 seeds, 200 steps")
    return p


def make_data(problem: Problem, seeds: int) -> dict[str, torch.Tensor]:
    """(seeds, n, d) features and (seeds, n) targets, train and test, from per-seed generators."""
    xs_train, ys_train, xs_test, ys_test = [], [], [], []
    for s in range(seeds):
        gen = torch.Generator().manual_seed(s)
        teacher = torch.randn(problem.dim, generator=gen, dtype=torch.float64)
        if problem.name == "least-squares":
            teacher /= math.sqrt(problem.dim)
        else:
            teacher *= 3 / math.sqrt(problem.dim)
        x = torch.randn(problem.train_samples + TEST_SAMPLES, problem.dim, generator=gen, dtype=torch.float64)
        signal = x @ teacher
        if problem.name == "least-squares":
            y = signal + 0.5 * torch.randn(signal.shape, generator=gen, dtype=torch.float64)
        else:  # labels +-1 drawn from the logistic model: noisy, not separable
            y = torch.where(torch.rand(signal.shape, generator=gen, dtype=torch.float64) < torch.sigmoid(signal),
                            1.0, -1.0).double()
        n = problem.train_samples
        xs_train.append(x[:n]), ys_train.append(y[:n]), xs_test.append(x[n:]), ys_test.append(y[n:])
    return {"x_train": torch.stack(xs_train), "y_train": torch.stack(ys_train),
            "x_test": torch.stack(xs_test), "y_test": torch.stack(ys_test)}


def sample_losses(problem: Problem, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample data loss (no regulariser): w (seeds, d), x (seeds, m, d), y (seeds, m) -> (seeds, m)."""
    margin = torch.einsum("smd,sd->sm", x, w)
    if problem.name == "least-squares":
        return 0.5 * (margin - y) ** 2
    return F.softplus(-y * margin)


def sample_gradient(problem: Problem, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *,
                    out: torch.Tensor) -> torch.Tensor:
    """Gradient of one sample's objective per seed (w, x: (seeds, d); y: (seeds,)), written out because
    autograd would triple the time of the study's loop; tests/test_delayed_sgd.py checks it against autograd."""
    margin = (x * w).sum(-1, keepdim=True)
    if problem.name == "least-squares":
        scale = margin - y[:, None]
    else:
        scale = -y[:, None] * torch.sigmoid(-y[:, None] * margin)
    torch.mul(x, scale, out=out)
    if problem.l2:
        out.add_(w, alpha=problem.l2)
    return out


def run_cell(problem: Problem, data: dict, indices: torch.Tensor, *, eta: float, delay, steps: int,
             checkpoints: list[int]) -> dict[str, dict]:
    """One (tau, rule) cell for every seed at once: returns {step: {train, test, gap: per-seed lists}}."""
    seeds = data["x_train"].shape[0]
    w = torch.zeros(seeds, problem.dim, dtype=torch.float64, requires_grad=True)
    w.grad = torch.zeros_like(w)
    opt = DelayedSGD([w], lr=eta, delay=delay)
    rows = torch.arange(seeds)
    x_steps = data["x_train"][rows, indices]  # (steps, seeds, d): the sample of each step, gathered once
    y_steps = data["y_train"][rows, indices]
    out = {}
    for t in range(steps):
        x, y = x_steps[t], y_steps[t]
        with opt.delayed_parameters(), torch.no_grad():
            sample_gradient(problem, w, x, y, out=w.grad)
        opt.step()
        if t + 1 in checkpoints:
            with torch.no_grad():
                train = sample_losses(problem, w, data["x_train"], data["y_train"]).mean(1)
                test = sample_losses(problem, w, data["x_test"], data["y_test"]).mean(1)
            out[str(t + 1)] = {"train": train.tolist(), "test": test.tolist(), "gap": (test - train).tolist()}
    return out


def _mean_se(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values) or not finite:
        return float("nan"), float("nan")
    mean = sum(finite) / len(finite)
    var = sum((v - mean) ** 2 for v in finite) / max(1, len(finite) - 1)
    return mean, math.sqrt(var / len(finite))


RULES = ("fixed, constant eta", "random, constant eta", "fixed, constant 5 eta", "fixed, eta/(1+tau)",
         "SGD (tau=0), eta/(1+tau)")
LARGE = 5.0  # the "constant 5 eta" rule: nearer the stability limit, where a delay changes the trajectory more


def run_study(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    steps = args.steps
    checkpoints = sorted({max(1, steps // 4), max(1, steps // 2), steps})
    results: dict = {"taus": args.taus, "seeds": args.seeds, "steps": steps, "checkpoints": checkpoints,
                     "rules": list(RULES), "problems": {}}
    for name in args.problems:
        problem = PROBLEMS[name]
        data = make_data(problem, args.seeds)
        gen = torch.Generator().manual_seed(12345)  # sampling stream: the same i_t for every tau and rule
        indices = torch.randint(problem.train_samples, (steps, args.seeds), generator=gen)
        cells: dict = {}
        for tau in args.taus:
            scaled = problem.eta / (1 + tau)
            runs = {RULES[0]: (problem.eta, FixedDelay(tau)), RULES[1]: (problem.eta, RandomDelay(tau, seed=0)),
                    RULES[2]: (LARGE * problem.eta, FixedDelay(tau)),
                    RULES[3]: (scaled, FixedDelay(tau)), RULES[4]: (scaled, FixedDelay(0))}
            for rule, (eta, delay) in runs.items():
                if tau == 0 and rule not in (RULES[0], RULES[2]):  # at tau = 0 these are the constant-eta run
                    cells[f"{rule}|{tau}"] = cells[f"{RULES[0]}|{tau}"]
                    continue
                cells[f"{rule}|{tau}"] = {"eta": eta, "by_step": run_cell(problem, data, indices, eta=eta, delay=delay,
                                                                          steps=steps, checkpoints=checkpoints)}
        with torch.no_grad():
            zeros = torch.zeros(args.seeds, problem.dim, dtype=torch.float64)
            start_loss = float(sample_losses(problem, zeros, data["x_train"], data["y_train"]).mean())
        results["problems"][name] = {"dim": problem.dim, "train_samples": problem.train_samples,
                                     "start_loss": start_loss,
                                     "test_samples": TEST_SAMPLES, "eta": problem.eta, "l2": problem.l2,
                                     "cells": cells}
    return results


DIVERGED = 100.0  # a run whose training loss ends above this many times its loss at w_0 diverged


def _diverged(cell: dict, step: str, start_loss: float) -> bool:
    train = cell["by_step"][step]["train"]
    return not all(math.isfinite(v) and v < DIVERGED * start_loss for v in train)


def summary(results: dict, name: str, step: int, key: str = "gap") -> dict[str, list[tuple[float, float]]]:
    """rule -> per tau (mean, standard error) over seeds of `key` (gap|train|test); nan where diverged."""
    info = results["problems"][name]
    cells = info["cells"]
    out = {}
    for rule in RULES:
        row = []
        for tau in results["taus"]:
            cell = cells[f"{rule}|{tau}"]
            row.append((float("nan"), float("nan")) if _diverged(cell, str(step), info["start_loss"])
                       else _mean_se(cell["by_step"][str(step)][key]))
        out[rule] = row
    return out


def paired_delay_effect(results: dict, name: str, step: int) -> dict[str, list[tuple[float, float, int]]]:
    """The gap change the delay causes, per seed against the same seed's run without delay at the same step
    size (constant rules: tau = 0; eta/(1+tau): the SGD control): rule -> per tau (mean, s.e., seeds > 0)."""
    info = results["problems"][name]
    cells, key = info["cells"], str(step)
    baseline = {RULES[0]: lambda tau: f"{RULES[0]}|0", RULES[1]: lambda tau: f"{RULES[0]}|0",
                RULES[2]: lambda tau: f"{RULES[2]}|0", RULES[3]: lambda tau: f"{RULES[4]}|{tau}"}
    out = {}
    for rule, base in baseline.items():
        row = []
        for tau in results["taus"]:
            cell, ref = cells[f"{rule}|{tau}"], cells[base(tau)]
            if _diverged(cell, key, info["start_loss"]) or _diverged(ref, key, info["start_loss"]):
                row.append((float("nan"), float("nan"), 0))
                continue
            diffs = [a - b for a, b in zip(cell["by_step"][key]["gap"], ref["by_step"][key]["gap"])]
            mean, se = _mean_se(diffs)
            row.append((mean, se, sum(d > 0 for d in diffs)))
        out[rule] = row
    return out


def table(results: dict) -> str:
    lines = []
    for name, info in results["problems"].items():
        for step in results["checkpoints"]:
            gaps = summary(results, name, step)
            lines.append(f"\n{name} (d={info['dim']}, n={info['train_samples']}, eta={info['eta']}"
                         f"{', lambda=' + str(info['l2']) if info['l2'] else ''}), generalization gap "
                         f"(test - train loss) after {step} steps, mean +- s.e. over {results['seeds']} seeds "
                         f"[mean training loss]\n")
            lines.append("| tau | " + " | ".join(RULES) + " |")
            lines.append("|---:|" + "---:|" * len(RULES))
            train = summary(results, name, step, "train")
            for k, tau in enumerate(results["taus"]):
                cells = [f"{m:.4f} +- {se:.4f} [{train[rule][k][0]:.3f}]" if math.isfinite(m) else "diverged"
                         for rule, (m, se) in ((rule, gaps[rule][k]) for rule in RULES)]
                lines.append(f"| {tau} | " + " | ".join(cells) + " |")
        step = results["checkpoints"][-1]
        effect = paired_delay_effect(results, name, step)
        lines.append(f"\n{name}: change of the gap caused by the delay after {step} steps, paired per seed against "
                     f"the same seed without delay at the same step size (mean +- s.e.; seeds where it grew)\n")
        lines.append("| tau | " + " | ".join(effect) + " |")
        lines.append("|---:|" + "---:|" * len(effect))
        for k, tau in enumerate(results["taus"][1:], start=1):
            cells = [f"{m:+.5f} +- {se:.5f} ({up}/{results['seeds']})" if math.isfinite(m) else "diverged"
                     for m, se, up in (effect[rule][k] for rule in effect)]
            lines.append(f"| {tau} | " + " | ".join(cells) + " |")
    return "\n".join(lines).lstrip("\n") + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["problems"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    step = results["steps"]
    for ax, name in zip(axes[0], names):
        gaps = summary(results, name, step)
        xs = [tau + 1 for tau in results["taus"]]
        for rule, style in zip(RULES, ("o-", "s--", "D-", "^-", "v:")):
            means = [m for m, _ in gaps[rule]]
            errs = [se for _, se in gaps[rule]]
            ax.errorbar(xs, means, yerr=errs, fmt=style, capsize=3, label=rule)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(t) for t in results["taus"]])
        ax.set_xlabel("delay tau (random: tau_max)")
        ax.set_ylabel(f"test - train loss after {step} steps")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"delayed SGD: generalization gap vs delay ({results['seeds']} seeds, mean +- s.e.)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.taus, args.seeds, args.steps = [0, 2, 8], 4, 200
    unknown = [p for p in args.problems if p not in PROBLEMS]
    if unknown:
        raise ConfigError(f"unknown problem(s) {unknown}; available: {', '.join(PROBLEMS)}")
    if any(t < 0 for t in args.taus) or args.seeds < 2 or args.steps < 1:
        raise ConfigError(f"--taus must be >= 0, --seeds >= 2 (for a standard error), --steps >= 1; got "
                          f"taus={args.taus} seeds={args.seeds} steps={args.steps}")
    began = time.perf_counter()
    results = run_study(args)
    results["wall_s"] = time.perf_counter() - began
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(results)
    (out / "table.md").write_text(text)
    (out / "delayed_sgd.json").write_text(json.dumps(results) + "\n")
    plot(results, out / "delayed_sgd.png")
    print(text)
    print(f"{results['wall_s']:.1f} s; wrote {out / 'table.md'}, {out / 'delayed_sgd.json'}, {out / 'delayed_sgd.png'}")
    return 0
