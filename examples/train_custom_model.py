"""Train your own nn.Module with autopar, unchanged, on any number of processes.

    python examples/train_custom_model.py                          # one process
    autopar launch --nproc 2 examples/train_custom_model.py --dp 2   # two local processes
    torchrun --nproc-per-node 2 examples/train_custom_model.py --dp 2

The model below knows nothing about parallelism. It is built on the meta device (no
memory), and autopar materialises it on every rank from the seed, so each replica starts
from the same weights as a single-process run would.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import autopar


class Regressor(nn.Module):
    """A plain MLP: what a user already has."""

    def __init__(self, features: int = 16, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def make_data(samples: int, features: int = 16, seed: int = 0) -> TensorDataset:
    w = torch.randn(features, generator=torch.Generator().manual_seed(1234))  # the function to learn
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    y = torch.sin(x @ w / features**0.5) + 0.05 * torch.randn(samples, generator=gen)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: all processes)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default=None, help="run folder (default runs/<timestamp>)")
    args = parser.parse_args()

    with torch.device("meta"):
        model = Regressor()
    trainer = autopar.Trainer(
        model,
        make_data(4096),
        eval_data=make_data(512, seed=1),
        strategy=autopar.Strategy(dp=args.dp),
        config=autopar.TrainConfig(steps=args.steps, global_batch_size=64, micro_batch_size=16, lr=1e-2,
                                   warmup_steps=10, out=args.out),
        loss_fn=lambda prediction, batch: F.mse_loss(prediction, batch["labels"]),
    )
    result = trainer.train()
    print(f"first loss {result.losses[0]:.4f} -> last loss {result.losses[-1]:.4f}; eval {result.eval_loss:.4f}")


if __name__ == "__main__":
    main()
