"""One gossip step over flat buffers: x_i <- sum_j W[i, j] x_j, with the exchange in the background.

Why split into `start` and `finish`: in D-PSGD a replica's gradient does not depend on
its neighbours' models, so the exchange can run while the replica computes (posted
before forward, collected after backward). `start` copies the buffers into send
buffers (the caller may change its own right after) and posts every send and receive
through `Links` (so an injected latency or bandwidth cap applies); `finish` waits for
the receives and mixes in place. The sum runs in a fixed order (self first, then
in-neighbours by rank), so every run with the same inputs gives the same bits.
"""

from __future__ import annotations

import time

import torch

from ..data_parallel.links import Links
from ..errors import DistributedError
from .topology import Topology

GOSSIP_TAG = 0x6055  # tags GOSSIP_TAG + buffer index; distinct from the pipeline's p2p tags


class GossipMixer:
    """Exchanges flat buffers with this replica's neighbours and mixes them with its row of W."""

    def __init__(self, topology: Topology, links: Links, replica: int, global_ranks: list[int]):
        if len(global_ranks) != topology.n:
            raise DistributedError(f"the gossip topology has {topology.n} replicas but the data-parallel group has "
                                   f"{len(global_ranks)}")
        self.topology, self.links, self.replica = topology, links, replica
        self.global_ranks = list(global_ranks)
        self.self_weight = float(topology.weights[replica, replica])
        self.in_weights = [(j, float(topology.weights[replica, j])) for j in topology.in_neighbors[replica]]
        self.out_neighbors = topology.out_neighbors[replica]
        self._recv_buffers: list[dict[int, torch.Tensor]] = []
        self._recvs: list = []
        self._sends: list = []
        self._send_buffers: list[torch.Tensor] = []
        self.wait_s = 0.0  # time spent blocked in finish() (communication not hidden by computation)

    @property
    def in_flight(self) -> bool:
        return bool(self._recvs)

    def start(self, flats: list[torch.Tensor]) -> None:
        """Post this round's sends (copies of `flats`) and receives."""
        if self._recvs:
            raise DistributedError("gossip round started twice without finish(): every start() needs a finish()")
        self._wait_sends()
        if len(self._recv_buffers) != len(flats) or any(
                next(iter(bufs.values()), flat).shape != flat.shape for bufs, flat in zip(self._recv_buffers, flats)):
            self._recv_buffers = [{j: torch.empty_like(flat) for j, _ in self.in_weights} for flat in flats]
        for index, flat in enumerate(flats):
            tag = GOSSIP_TAG + index
            for j, _ in self.in_weights:
                self._recvs.append(self.links.irecv(self._recv_buffers[index][j], self.global_ranks[j], tag=tag))
            if self.out_neighbors:
                outgoing = flat.detach().clone()
                self._send_buffers.append(outgoing)
                for k in self.out_neighbors:
                    self._sends.append(self.links.isend(outgoing, self.global_ranks[k], tag=tag))

    def finish(self, flats: list[torch.Tensor]) -> None:
        """Wait for the neighbours' buffers and mix them into `flats` in place."""
        began = time.perf_counter()
        for handle in self._recvs:
            handle.wait()
        self._recvs = []
        self.wait_s += time.perf_counter() - began
        with torch.no_grad():
            for index, flat in enumerate(flats):
                mixed = flat * self.self_weight
                for j, weight in self.in_weights:
                    mixed.add_(self._recv_buffers[index][j], alpha=weight)
                flat.copy_(mixed)

    def mix(self, flats: list[torch.Tensor]) -> None:
        """A blocking gossip round."""
        self.start(flats)
        self.finish(flats)

    def _wait_sends(self) -> None:
        for handle in self._sends:
            handle.wait()
        self._sends, self._send_buffers = [], []

    def close(self) -> None:
        if self._recvs:  # an aborted round: let it land so no message is left half-received
            self.finish([])
        self._wait_sends()
