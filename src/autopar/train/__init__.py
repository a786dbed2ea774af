"""The toolkit of one training step: losses, optimizer, metrics, checkpoints, the data-parallel engine.

The Trainer that drives them is one level up (autopar/trainer.py).
"""
