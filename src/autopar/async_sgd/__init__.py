"""Asynchronous data parallelism: a sharded parameter server with bounded staleness, and delayed SGD.

Design (`--dp-mode async --staleness S --servers K`):
- the last K ranks are servers, the first W = world - K are workers; the model's trainable
  parameters form one flat fp32 vector (layout.py) cut into K contiguous shards;
- a worker's step: forward/backward on its 1/W of the global batch (loss scaled so that
  the W gradients sum to the global-batch mean gradient), then one PUSH per server (its
  gradient slice, the step number and the learning rate), which also requests the next
  step's parameters (worker.py, protocol.py);
- a server applies every push at once as one SGD update of its shard and answers a pull for
  step c when every worker has pushed step c - S - 1 (stale-synchronous parallel; S = 0
  is exactly synchronous averaged SGD); every push records its staleness (server.py);
- the transport is point-to-point torch.distributed (gloo receives from any source)
  through `autopar.data_parallel.links.Links`, so benchmarks can inject latency and a
  bandwidth cap; there is no collective during training, workers really run ahead;
- in the Trainer (engine.py, loop.py) servers run their serve loop instead of training
  steps; at the end every rank gets the final parameters, evaluates, writes the run folder
  (metrics.jsonl per step with the loss of the global batch, the staleness of that step's
  pushes, and on the last line the staleness histogram; staleness.json with every push and
  pull) and saves the final checkpoint like any other run.

For benchmarks (`autopar reproduce dpsgd`): `train_with_parameter_server(model, loss_fn,
batch_fn, steps=, lr=, staleness=, servers=, link_model=LinkModel(...))`, called on every
rank of the default group, trains a given model on given data and returns an
`AsyncRunResult` (per-step losses, per-step wall-clock `step_end_s`, `wall_s`, bytes and
messages sent, every push's staleness), the same on every rank.

Single-process reference: `DelayedSGD` (delayed.py) with `FixedDelay`, `RandomDelay`,
`ScheduledDelay`; `autopar reproduce delayed-sgd` uses it for the generalization study.
"""

from .delayed import DelayedSGD, FixedDelay, RandomDelay, ScheduledDelay
from .layout import FlatLayout
from .roles import Roles
from .runner import AsyncRunResult, train_with_parameter_server
from .server import ParameterServer, PullRecord, PushRecord
from .worker import ServerClient

__all__ = ["AsyncRunResult", "DelayedSGD", "FixedDelay", "FlatLayout", "ParameterServer", "PullRecord",
           "PushRecord", "RandomDelay", "Roles", "ScheduledDelay", "ServerClient", "train_with_parameter_server"]
