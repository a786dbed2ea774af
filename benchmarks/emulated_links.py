"""Emulated links on one host: every rank in its own Linux network namespace, behind a rate-limited veth.

Why: on one host all ranks exchange data through one memory bus, so a transfer's time follows the
total bytes copied, and a method that puts fewer bytes on each link (Alpa's scatter-gather and
broadcast) cannot show its gain. Between hosts, each rank has a NIC of its own and the busiest link
decides. This module gives each rank such a link, on this host:

    rank r  --  namespace <tag>r<r>, interface <tag>n<r> (10.x.y.(r+1)/24)
            --  veth pair  --  <tag>h<r> in the root namespace, a port of bridge <tag>b

with `tc` HTB on both ends of each veth: the namespace end shapes what the rank sends, the bridge
end what it receives, each at --link-gbit (full duplex, like a NIC). Optionally, ranks of one
group (a pipeline stage: "one node") talk to each other at a faster rate (--intra-gbit), as
NVLink inside a node against a NIC between nodes; that is the case Megatron's scatter-gather is for.

This is an emulation, not a cluster: the ranks still share this host's cores, memory and kernel
(the bytes are still copied by the same CPUs), and no latency is added (the sch_netem module is
not available here). What it does make true is that each rank's bytes queue on its own link of a
known rate, which is the property the resharding methods differ in.

Needs root and iproute2 (`ip`, `tc`); `EmulatedLinks.check()` refuses clearly otherwise. Set-up
and tear-down belong to the parent process (`with EmulatedLinks(...) as links:`; everything it made is
removed on exit, on an error and on SIGTERM); each rank calls `links.enter(rank)` first thing, before
torch.distributed starts, which moves the process into its namespace and names the interface gloo binds to.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess

CLONE_NEWNET = 0x40000000


class EmulatedLinksError(RuntimeError):
    """Set-up is impossible here (not root, no iproute2, a kernel without HTB): the message says what to do."""


class EmulatedLinks:
    """Namespaces, veths, a bridge and tc shaping for `world` ranks; a context manager in the parent."""

    def __init__(self, world: int, gbit: float, *, intra_gbit: float | None = None,
                 groups: list[list[int]] | None = None, mtu: int = 9000):
        if world < 2 or world > 200:
            raise EmulatedLinksError(f"emulated links: world must be 2..200 ranks, got {world}")
        if not gbit > 0 or (intra_gbit is not None and not intra_gbit > 0):
            raise EmulatedLinksError(f"emulated links: rates must be > 0 Gbit/s, got --link-gbit {gbit} and "
                                     f"--intra-gbit {intra_gbit}")
        self.world, self.gbit, self.intra_gbit, self.mtu = world, gbit, intra_gbit, mtu
        self.groups = [list(g) for g in groups] if groups else [[r] for r in range(world)]
        pid = os.getpid()
        self.tag = f"ap{pid % 100000}"  # names of at most 15 characters, unique to this run
        self.subnet = f"10.{200 + pid % 50}.{(pid // 50) % 250}"
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), to remove in reverse
        self._old_term = None

    # ------------------------------------------------------------------ names

    def netns(self, rank: int) -> str:
        return f"{self.tag}r{rank}"

    def interface(self, rank: int) -> str:
        """The rank's interface inside its namespace (GLOO_SOCKET_IFNAME)."""
        return f"{self.tag}n{rank}"

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def describe(self) -> str:
        intra = (f", {self.intra_gbit:g} Gbit/s between ranks of one group {self.groups}"
                 if self.intra_gbit is not None else "")
        return (f"emulated links: {self.world} ranks, each in its own network namespace behind a veth shaped by "
                f"tc htb to {self.gbit:g} Gbit/s each way{intra}; MTU {self.mtu}; no added latency; one host "
                f"({os.cpu_count()} cores shared), not a cluster")

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def check() -> None:
        """Refuse clearly, before anything is made, where the emulation cannot run."""
        if os.geteuid() != 0:
            raise EmulatedLinksError(f"--emulate-links needs root (network namespaces, veth pairs and tc), but "
                                     f"this runs as uid {os.geteuid()}; run it as root or drop --emulate-links")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise EmulatedLinksError(f"--emulate-links needs iproute2's {' and '.join(missing)} on PATH (apt-get "
                                     f"install iproute2); not found")

    def _run(self, *argv: str, netns: str | None = None) -> None:
        cmd = (["ip", "netns", "exec", netns] if netns else []) + list(argv)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise EmulatedLinksError(f"emulated links: `{' '.join(cmd)}` failed ({done.returncode}): "
                                     f"{done.stderr.strip()}")

    def _shape(self, device: str, rank: int, direction: str, netns: str | None) -> None:
        """HTB on one veth end: default class at --link-gbit; with --intra-gbit, a class for the rank's
        group peers (matched by destination when the rank sends, by source when it receives)."""
        rate = f"{self.gbit * 1000:g}mbit"
        self._run("tc", "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "20", "r2q", "1000",
                  netns=netns)
        self._run("tc", "class", "add", "dev", device, "parent", "1:", "classid", "1:20", "htb", "rate", rate,
                  "ceil", rate, netns=netns)
        if self.intra_gbit is None:
            return
        fast = f"{self.intra_gbit * 1000:g}mbit"
        self._run("tc", "class", "add", "dev", device, "parent", "1:", "classid", "1:10", "htb", "rate", fast,
                  "ceil", fast, netns=netns)
        group = next((g for g in self.groups if rank in g), [rank])
        for peer in group:
            if peer != rank:
                self._run("tc", "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                          "match", "ip", direction, f"{self.address(peer)}/32", "flowid", "1:10", netns=netns)

    def up(self) -> None:
        self.check()
        bridge = f"{self.tag}b"
        self._run("ip", "link", "add", bridge, "type", "bridge")
        self._made.append(("link", bridge))
        self._run("ip", "link", "set", bridge, "mtu", str(self.mtu), "up")
        for rank in range(self.world):
            ns, inner, outer = self.netns(rank), self.interface(rank), f"{self.tag}h{rank}"
            self._run("ip", "netns", "add", ns)
            self._made.append(("netns", ns))
            self._run("ip", "link", "set", "lo", "up", netns=ns)
            self._run("ip", "link", "add", outer, "mtu", str(self.mtu), "type", "veth", "peer", "name", inner,
                      "mtu", str(self.mtu))
            self._made.append(("link", outer))  # removing its namespace removes the pair too; kept for failures
            self._run("ip", "link", "set", inner, "netns", ns)
            self._run("ip", "addr", "add", f"{self.address(rank)}/24", "dev", inner, netns=ns)
            self._run("ip", "link", "set", inner, "up", netns=ns)
            self._run("ip", "link", "set", outer, "master", bridge, "up")
            self._shape(inner, rank, "dst", ns)  # what the rank sends
            self._shape(outer, rank, "src", None)  # what the bridge delivers to it

    def down(self) -> list[str]:
        """Remove everything this object made (newest first); returns what could not be removed."""
        left = []
        for kind, name in reversed(self._made):
            if kind == "netns":
                argv = ["ip", "netns", "del", name]
            else:
                if subprocess.run(["ip", "link", "show", name], capture_output=True).returncode != 0:
                    continue  # went with its namespace
                argv = ["ip", "link", "del", name]
            if subprocess.run(argv, capture_output=True).returncode != 0:
                left.append(name)
        self._made = []
        return left

    def __enter__(self) -> EmulatedLinks:
        self._old_term = signal.signal(signal.SIGTERM, _raise_exit)  # so `with` cleans up on SIGTERM as well
        try:
            self.up()
        except BaseException:
            self.down()
            signal.signal(signal.SIGTERM, self._old_term)
            raise
        return self

    def __exit__(self, *exc) -> None:
        left = self.down()
        signal.signal(signal.SIGTERM, self._old_term)
        if left:
            print(f"emulated links: could not remove {left}; remove them with `ip netns del` / `ip link del`",
                  flush=True)

    def __getstate__(self) -> dict:
        """What a spawned rank needs (names and addresses); the parent keeps what it made and its handler."""
        return {**self.__dict__, "_made": [], "_old_term": None}

    # ------------------------------------------------------------------ in a rank

    def enter(self, rank: int) -> None:
        """Move this process into rank `rank`'s namespace and point gloo at its interface (call before
        init_process_group; MASTER_ADDR becomes rank 0's address)."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.netns(rank)}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise EmulatedLinksError(f"rank {rank}: setns into {self.netns(rank)} failed: {os.strerror(err)}")
        finally:
            os.close(fd)
        os.environ.update(GLOO_SOCKET_IFNAME=self.interface(rank), MASTER_ADDR=self.address(0))


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)
