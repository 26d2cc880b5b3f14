"""Who is in the job and how to reach them: the address book every node and the scheduler share.

``PeerInfo`` is one node as the scheduler's address book lists it. ``Membership`` holds the book a
node received (its own rank, every peer by identity, workers and servers by rank) and picks the
endpoint for a peer: the same-host endpoint for a peer on this host (same boot and network
namespace, unless ``PSLAUNCH_SAME_HOST=tcp``), TCP otherwise. The scheduler uses the same
``PeerInfo`` and ``endpoint_of`` to reach the nodes.

Written once (at registration, on the thread that registers), read-only afterwards: no lock.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from .errors import ProtocolError
from .transport import Transport

__all__ = ["PeerInfo", "Membership", "host_fingerprint", "endpoint_of"]

SCHEDULER = b"scheduler"
"""The scheduler's identity on the wire."""


@dataclass(frozen=True)
class PeerInfo:
    """A node of the job as the address book lists it."""

    role: str
    rank: int
    host: str
    port: int
    uid: str
    fingerprint: str
    local_name: str
    shm_probe: int = 0  # wire reference of the node's shared-memory probe (0: none)
    pid: int = 0  # its process id (a shared-memory reference from it must name this process)

    def describe(self) -> str:
        """``server 1 on 10.0.0.2:4567``: how errors name a node."""
        return f"{self.role} {self.rank} on {self.host}:{self.port}"

    def as_record(self) -> dict[str, Any]:
        """The address book's JSON record of this node."""
        return asdict(self)

    @classmethod
    def from_record(cls, item: Any) -> "PeerInfo":
        """A peer from an address book record.

        Raises:
            ProtocolError: a field is missing or of the wrong type (the message names it).
        """
        if not isinstance(item, dict):
            raise ProtocolError(f"an address book entry is a {type(item).__name__}, not an object")
        try:
            return cls(str(item["role"]), int(item["rank"]), str(item["host"]), int(item["port"]), str(item["uid"]),
                       str(item["fingerprint"]), str(item["local_name"]), int(item.get("shm_probe") or 0),
                       int(item.get("pid") or 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"a malformed address book entry: {type(exc).__name__}: {exc}") from exc


def host_fingerprint() -> str:
    """Same value for processes that can reach each other's same-host endpoints (boot id + network namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"unknown-{os.getpid()}"  # never matches another process: TCP everywhere
    return f"{boot}:{netns}"


def endpoint_of(peer: PeerInfo, transport: Transport, fingerprint: str, same_host: str) -> str:
    """The endpoint to reach ``peer`` from a process with ``fingerprint``: same-host unless
    ``same_host`` is ``tcp`` or the peer is elsewhere, TCP otherwise."""
    if same_host in ("ipc", "shm") and peer.fingerprint == fingerprint:
        return transport.same_host_endpoint(peer.local_name)
    return f"tcp://{peer.host}:{peer.port}"


class Membership:
    """The address book one node received: its rank, its peers, workers and servers by rank."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.rank = -1
        self.peers: dict[bytes, PeerInfo] = {}
        self.workers: list[PeerInfo] = []
        self.servers: list[PeerInfo] = []

    def apply(self, book: Any) -> list[PeerInfo]:
        """Take the scheduler's address book; return the peers this node connects to (workers to
        servers, servers to workers).

        Raises:
            ProtocolError: the book is malformed (the message says how).
        """
        if not isinstance(book, dict) or not isinstance(book.get("nodes"), list):
            raise ProtocolError("the address book is not an object with a list of nodes")
        try:
            rank = int(book["rank"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"the address book has no valid rank: {exc}") from exc
        peers = {}
        for item in book["nodes"]:
            peer = PeerInfo.from_record(item)
            peers[peer.uid.encode()] = peer
        self.rank = rank
        self.peers = peers
        self.workers = sorted((p for p in peers.values() if p.role == "worker"), key=lambda p: p.rank)
        self.servers = sorted((p for p in peers.values() if p.role == "server"), key=lambda p: p.rank)
        return self.servers if self.role == "worker" else self.workers

    def get(self, sender: bytes) -> PeerInfo | None:
        """The peer whose identity is ``sender``, or None."""
        return self.peers.get(sender)
