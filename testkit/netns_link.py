"""A rate-limited link between two network namespaces, for benchmarks that show what bandwidth costs.

    with RateLimitedLink(rate="1gbit") as link:
        argv = link.run_in("a", [sys.executable, "-m", "psnode", "server"])   # starts in namespace a
        link.address("a")                                                     # 198.18.0.1

Two namespaces (``a`` and ``b``) joined by a veth pair whose both ends shape their egress with a
token bucket (``tc qdisc ... tbf``), so traffic between them is capped at ``rate`` each way. Their
addresses come from 198.18.0.0/15 (RFC 2544's benchmarking range) only, and before anything else
the root namespace gets ``ip route add unreachable 198.18.0.0/15``: no packet for those addresses
can leave the machine, whatever else goes wrong. Leaving the ``with`` block (or an exception, or a
exception; the caller turns TERM into one) deletes the namespaces (which removes the veth pair and
its queues), and the route when no other run's namespaces are left (runs may overlap: the last one
out removes it). A run that was killed outright leaves its namespaces behind: the next run deletes
those of processes that no longer exist. Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Sequence

__all__ = ["RateLimitedLink", "LinkError", "BENCH_NET"]

BENCH_NET = "198.18.0.0/15"
_ADDRESSES = {"a": "198.18.0.1", "b": "198.18.0.2"}
_PREFIX = "pslbench-"
_STALE = re.compile(rf"^{_PREFIX}(\d+)-[ab]\b")


class LinkError(RuntimeError):
    """The link could not be set up (no root, no iproute2, ...); the message says which command failed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise LinkError(f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


class RateLimitedLink:
    """Namespaces ``a`` and ``b`` joined at ``rate`` (a tc rate: ``1gbit``, ``100mbit``); see the module docstring."""

    def __init__(self, rate: str = "1gbit", burst: str = "1mb", latency: str = "50ms") -> None:
        self.rate, self.burst, self.latency = rate, burst, latency
        tag = str(os.getpid())
        self.namespaces = {side: f"{_PREFIX}{tag}-{side}" for side in _ADDRESSES}
        self._veth = {side: f"pslb{tag}{side}" for side in _ADDRESSES}  # at most 12 of the 15 characters allowed
        self._route_added = False
        self._created: list[str] = []

    def address(self, side: str) -> str:
        """The address of namespace ``side`` (``a`` or ``b``) on the link."""
        return _ADDRESSES[side]

    def run_in(self, side: str, argv: Sequence[str]) -> list[str]:
        """``argv`` started inside namespace ``side`` (``ip netns exec`` execs it: the pid stays the program's)."""
        return ["ip", "netns", "exec", self.namespaces[side], *argv]

    def describe(self) -> str:
        """One line for reports: the link and its shaping."""
        return (f"veth pair between network namespaces {self.namespaces['a']} ({_ADDRESSES['a']}) and "
                f"{self.namespaces['b']} ({_ADDRESSES['b']}), tc tbf rate {self.rate} burst {self.burst} "
                f"latency {self.latency} on both ends; {BENCH_NET} unreachable from the root namespace")

    def __enter__(self) -> "RateLimitedLink":
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise LinkError("the rate-limited link needs iproute2's `ip` and `tc` (apt-get install iproute2)")
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def _setup(self) -> None:
        # first: nothing addressed to the benchmark range may leave through the machine's real routes
        added = _ip("route", "add", "unreachable", BENCH_NET, check=False)
        if added.returncode != 0 and "File exists" not in added.stderr:  # (present: an overlapping run's)
            raise LinkError(f"`ip route add unreachable {BENCH_NET}` exited {added.returncode}: {added.stderr.strip()}")
        self._route_added = True
        self._sweep_stale()
        for side, ns in self.namespaces.items():
            _ip("netns", "add", ns)
            self._created.append(ns)
        a, b = self._veth["a"], self._veth["b"]
        _ip("link", "add", a, "netns", self.namespaces["a"], "type", "veth", "peer", "name", b, "netns", self.namespaces["b"])
        for side, ns in self.namespaces.items():
            dev = self._veth[side]
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{_ADDRESSES[side]}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", self.burst,
                  "latency", self.latency])

    @staticmethod
    def _sweep_stale() -> bool:
        """Delete the namespaces of runs whose process is gone; True when a live run still has some."""
        live = False
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            match = _STALE.match(line)
            if match is None:
                continue
            if os.path.exists(f"/proc/{match.group(1)}"):
                live = True
            else:
                _ip("netns", "del", line.split()[0], check=False)
        return live

    def close(self) -> None:
        """Delete what this link created (idempotent); deleting a namespace removes its veth end and queue."""
        for ns in reversed(self._created):
            _ip("netns", "del", ns, check=False)
        self._created = []
        if self._route_added and not self._sweep_stale():
            _ip("route", "del", "unreachable", BENCH_NET, check=False)
        self._route_added = False

    def __exit__(self, *exc: object) -> None:
        self.close()
