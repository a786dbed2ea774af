"""Decentralized data parallelism: D-PSGD gossip over a graph of replicas (`--dp-mode gossip`)."""

from .engine import GOSSIP_ORDERS, GossipEngine, GossipOptions, check_gossip_strategy
from .mixer import GossipMixer
from .topology import BUILTIN, Topology, build_topology, from_matrix, metropolis_weights

__all__ = ["BUILTIN", "GOSSIP_ORDERS", "GossipEngine", "GossipOptions", "GossipMixer", "Topology", "build_topology",
           "check_gossip_strategy", "from_matrix", "metropolis_weights"]
