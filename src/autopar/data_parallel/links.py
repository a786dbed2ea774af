"""A communication layer with an injected network: per-message latency and a bandwidth cap.

Why: on one machine (gloo over loopback) every transfer is nearly free, so the questions
that decide between all-reduce, gossip and a parameter server (how many messages in a
row, how many bytes through the busiest link) cannot be seen. `Links` wraps the
torch.distributed calls the data-parallel modes use and delays each message as a slow
network would, so the same code can be benchmarked under several network settings.

Delay model (`LinkModel`), applied on the SENDER side, so the receiver sees the message late:
- each rank has one outgoing link (its network card). A message of `nbytes` occupies it
  for `nbytes / bandwidth_bytes_per_s` (messages from one rank queue behind each other:
  the bandwidth cap is per sender, shared by all its destinations), then travels for
  `latency_s`; latencies of back-to-back messages overlap (the link is pipelined).
  A message posted at time t is handed to the real transport at
      start = max(t, link_free);  link_free = start + nbytes / bw;  release = link_free + latency_s
  and a lone message costs `message_delay(nbytes) = latency_s + nbytes / bw`;
- `isend` returns at once: a sender thread holds the message until its release time and
  then posts it, so the delay overlaps the caller's computation (as a real NIC would);
  `send` is `isend(...).wait()`;
- `all_reduce` models a ring all-reduce: 2(n-1) dependent steps, each a message of
  nbytes/n, so it costs `allreduce_delay(nbytes, n) = 2(n-1) * message_delay(nbytes/n)`
  on top of the real reduction (every rank waits it out after the reduction);
- receives add nothing: the delay was paid by the sender.
The injected delay adds to the real transport time (small on loopback). With `LinkModel()`
(no latency, no cap) every call goes straight to torch.distributed: no thread, no sleep.

Ranks are GLOBAL ranks (as torch.distributed's `dst`/`src`), whatever `group` is.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .._torch_internals import work_source_rank
from ..errors import ConfigError, DistributedError


@dataclass(frozen=True)
class LinkModel:
    """An injected network: `latency_s` per message, a bandwidth cap in bytes/s (inf: none)."""

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = float("inf")

    def __post_init__(self):
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ConfigError(f"link latency must be a finite number of seconds >= 0, got {self.latency_s}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ConfigError(f"link bandwidth must be > 0 bytes/s (inf: no cap), got {self.bandwidth_bytes_per_s}")

    @property
    def is_free(self) -> bool:
        """True when the model adds nothing (the fast path)."""
        return self.latency_s == 0 and math.isinf(self.bandwidth_bytes_per_s)

    def transfer_time(self, nbytes: float) -> float:
        """How long `nbytes` occupy the sender's link (the bandwidth part only)."""
        return 0.0 if math.isinf(self.bandwidth_bytes_per_s) else nbytes / self.bandwidth_bytes_per_s

    def message_delay(self, nbytes: int) -> float:
        """Delay of one lone message: latency plus its bytes over the bandwidth."""
        return self.latency_s + self.transfer_time(nbytes)

    def allreduce_delay(self, nbytes: int, world: int) -> float:
        """Ring all-reduce of `nbytes` over `world` ranks: 2(n-1) dependent messages of nbytes/n."""
        if world <= 1:
            return 0.0
        return 2 * (world - 1) * self.message_delay(nbytes / world)


class _Handle:
    """What `isend`/`irecv` return: `.wait()` blocks until the transfer is done."""

    def __init__(self, timeout_s: float, work=None, source: int | None = None):
        self._timeout_s = timeout_s
        self._work = work
        self._source = source
        self._posted = threading.Event()
        self._error: BaseException | None = None
        if work is not None:
            self._posted.set()

    def _set_work(self, work) -> None:
        self._work = work
        self._posted.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._posted.set()

    def wait(self) -> int | None:
        """Wait for the transfer; for a receive, returns the source rank."""
        if not self._posted.wait(self._timeout_s):
            raise DistributedError(f"a delayed send was not posted within {self._timeout_s:g} s")
        if self._error is not None:
            raise DistributedError(f"a delayed send failed: {self._error}") from self._error
        if self._work is not None:
            self._work.wait(timedelta(seconds=self._timeout_s))
            if self._source is None:
                self._source = work_source_rank(self._work)
        return self._source

    def is_completed(self) -> bool:
        return self._posted.is_set() and (self._work is None or self._work.is_completed())


class Links:
    """torch.distributed p2p and all-reduce with the `LinkModel` delay applied (see module doc)."""

    def __init__(self, model: LinkModel, group=None, *, timeout_s: float = 300.0):
        self.model = model
        self.group = group
        self.timeout_s = timeout_s
        self.bytes_sent = 0
        self.messages_sent = 0
        self._link_free = 0.0  # perf_counter time when this rank's outgoing link is idle again
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ sends

    def _count(self, nbytes: int, messages: int = 1) -> None:
        self.bytes_sent += int(nbytes)
        self.messages_sent += messages

    def _release_time(self, nbytes: int) -> float:
        start = max(time.perf_counter(), self._link_free)
        self._link_free = start + self.model.transfer_time(nbytes)
        return self._link_free + self.model.latency_s

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> _Handle:
        """Post a send; the delay runs in a sender thread, so it overlaps the caller's work.

        As with torch.distributed.isend, `tensor` must stay unchanged until `.wait()` returns
        (with a delay, the transport reads it only at the release time)."""
        nbytes = tensor.numel() * tensor.element_size()
        self._count(nbytes)
        if self.model.is_free:
            return _Handle(self.timeout_s, dist.isend(tensor, dst, group=self.group, tag=tag))
        handle = _Handle(self.timeout_s)
        self._sender().put((self._release_time(nbytes), tensor, dst, tag, handle))
        return handle

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def _sender(self) -> queue.Queue:
        if self._thread is None:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._send_loop, args=(self._queue,), daemon=True,
                                            name="autopar-links-sender")
            self._thread.start()
        return self._queue

    def _send_loop(self, pending: queue.Queue) -> None:
        """Post each message at its release time, in posting order (release times never decrease)."""
        while True:
            item = pending.get()
            if item is None:
                return
            release, tensor, dst, tag, handle = item
            delay = release - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            try:
                handle._set_work(dist.isend(tensor, dst, group=self.group, tag=tag))
            except BaseException as exc:  # surfaced to the caller by handle.wait()
                handle._fail(exc)

    # ------------------------------------------------------------------ receives

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> _Handle:
        """Post a receive (no delay: the sender paid it); `.wait()` returns the source rank."""
        return _Handle(self.timeout_s, dist.irecv(tensor, src, group=self.group, tag=tag), source=src)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
        return self.irecv(tensor, src, tag).wait()

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor, group=None) -> None:
        """Sum over the group, then wait out the modelled ring all-reduce delay (every rank the same, on top of
        the real reduction, as for messages)."""
        group = group if group is not None else self.group
        world = dist.get_world_size(group)
        nbytes = tensor.numel() * tensor.element_size()
        if world > 1:
            self._count(2 * (world - 1) * nbytes / world, 2 * (world - 1))
        dist.all_reduce(tensor, group=group)
        if not self.model.is_free and world > 1:
            time.sleep(self.model.allreduce_delay(nbytes, world))

    def close(self) -> None:
        """Stop the sender thread once every message it holds is posted."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(self.timeout_s)
            self._thread, self._queue = None, None

    def __del__(self):
        try:
            if self._queue is not None:
                self._queue.put(None)
        except Exception:
            pass
