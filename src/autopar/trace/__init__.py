"""Model -> graph of operations with per-node and per-block cost (the proxy graph)."""

from .graph import Block, ModelGraph, NodeCost, find_layers, find_stacks, trace

__all__ = ["Block", "ModelGraph", "NodeCost", "find_layers", "find_stacks", "trace"]
