"""The toolkit of one training step: losses, optimizer, metrics, checkpoints, the data-parallel engine.

The Trainer that drives them is one level up (autopar/trainer.py); its loop is made of parts from
here, read in this order: steps.py (`Steps`: one step, synchronous or deferred.py's late updates,
from inputs.py's batches and losses), bad_steps.py, metrics.py (`MetricsLog`), evaluator.py and
checkpointer.py, each deciding from the step number whether it acts; faults.py wraps the steps
only when a fault is injected. A strategy's own loop gets base.py's `LoopServices`.
"""
