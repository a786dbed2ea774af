"""Model -> graph of operations with per-node and per-block cost (the proxy graph)."""

from .graph import Block, ModelGraph, NodeCost, trace
from .stacks import Stack, find_layers, find_stacks

__all__ = ["Block", "ModelGraph", "NodeCost", "Stack", "find_layers", "find_stacks", "trace"]
