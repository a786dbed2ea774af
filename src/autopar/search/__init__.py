"""Automatic strategy search: a cluster description, a cost and memory model of one training step, and
the search over data, tensor and pipeline degrees, micro-batching, schedules and recomputation."""
