"""Who is in the job and how to reach them: the address book every node and the scheduler share.

``PeerInfo`` is one node as the scheduler's address book lists it. ``Membership`` holds the book a
node received (its own rank, every peer by identity, workers and servers by rank) and picks the
endpoint for a peer: the same-host endpoint for a peer on this host (same boot and network
namespace, unless ``PSLAUNCH_SAME_HOST=tcp``), TCP otherwise. The scheduler uses the same
``PeerInfo`` and ``endpoint_of`` to reach the nodes.

Written at registration (on the thread that registers) and, when a restarted worker rejoins, by the
receiving thread, which swaps in new dicts and lists whole: readers need no lock.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from psnode.errors import ProtocolError
from psnode.transport.base import Transport

__all__ = ["PeerInfo", "Membership", "host_fingerprint", "on_this_host", "endpoint_of", "unreachable", "MAX_SOCKET_NAME"]

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
    lane_port: int = 0  # a worker's port for lanes (``psnode.transport.lanes``) on ``host``; 0: it has none
    data_port: int = 0  # its port for data lanes (``psnode.node.data_lanes``) on ``host``; 0: it has none
    stream_port: int = 0  # a server's port for workers' streams (``psnode.transport.streams``) on ``host``; 0: none
    # the abstract Unix socket where a server also takes the streams of workers on its host ('' none)
    stream_socket: str = ""

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
            peer = cls(str(item["role"]), int(item["rank"]), str(item["host"]), int(item["port"]), str(item["uid"]),
                       str(item["fingerprint"]), str(item["local_name"]), int(item.get("shm_probe") or 0),
                       int(item.get("pid") or 0), int(item.get("lane_port") or 0), int(item.get("data_port") or 0),
                       int(item.get("stream_port") or 0), str(item.get("stream_socket") or ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"a malformed address book entry: {type(exc).__name__}: {exc}") from exc
        name = peer.stream_socket
        if len(name) > MAX_SOCKET_NAME or not (name.isascii() and name.isprintable()):
            raise ProtocolError(f"an address book entry with stream socket {name[:120]!r}: not a printable ASCII "
                                f"name of at most {MAX_SOCKET_NAME} characters")
        for what, port in (("lane port", peer.lane_port), ("data lane port", peer.data_port),
                           ("stream port", peer.stream_port)):
            if not 0 <= port <= 65535:
                raise ProtocolError(f"an address book entry with {what} {port}, not 0..65535")
        return peer


MAX_SOCKET_NAME = 100  # an abstract Unix socket's name: 107 bytes at most after its NUL


def host_fingerprint() -> str:
    """Same value for processes that can reach each other's same-host endpoints (boot id + network namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"unknown-{os.getpid()}"  # never matches another process: TCP everywhere
    return f"{boot}:{netns}"


def on_this_host(peer: PeerInfo, fingerprint: str, same_host: str) -> bool:
    """Whether a process with ``fingerprint`` reaches ``peer`` by the same-host path: the peer shares
    its host and network namespace, and ``same_host`` (``PSLAUNCH_SAME_HOST``) is not ``tcp``."""
    return same_host in ("ipc", "shm") and peer.fingerprint == fingerprint


def endpoint_of(peer: PeerInfo, transport: Transport, fingerprint: str, same_host: str) -> str:
    """The endpoint to reach ``peer`` from a process with ``fingerprint``: same-host unless
    ``same_host`` is ``tcp`` or the peer is elsewhere, TCP otherwise."""
    if on_this_host(peer, fingerprint, same_host):
        return transport.same_host_endpoint(peer.local_name)
    return f"tcp://{peer.host}:{peer.port}"


def unreachable(peers: list[PeerInfo], fingerprint: str, same_host: str, timeout: float) -> list[tuple[PeerInfo, str]]:
    """The peers whose advertised TCP address does not accept a connection from here within
    ``timeout`` seconds, each with why (``No route to host``, ``no answer within 5 s``). Peers
    reached through the same-host path are not tried. Blocks up to about ``timeout``; the tries run
    in parallel (a plain connect, closed at once: the node's socket drops it)."""

    def one(peer: PeerInfo) -> tuple[PeerInfo, str] | None:
        try:
            socket.create_connection((peer.host, peer.port), timeout).close()
        except socket.timeout:
            return peer, f"no answer within {timeout:g} s"
        except OSError as exc:
            return peer, exc.strerror or str(exc)
        return None

    remote = [p for p in peers if not on_this_host(p, fingerprint, same_host)]
    if not remote:
        return []
    with ThreadPoolExecutor(max_workers=min(64, len(remote))) as pool:
        return [found for found in pool.map(one, remote) if found is not None]


class Membership:
    """The address book one node received: its rank, its peers, workers and servers by rank."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.rank = -1
        self.peers: dict[bytes, PeerInfo] = {}
        self.workers: list[PeerInfo] = []
        self.servers: list[PeerInfo] = []
        # a server's replicas by its rank (PSLAUNCH_SERVER_REPLICAS): they hold copies of its keys; one
        # takes its place in ``servers`` once it is lost (``server_lost``)
        self.replicas: dict[int, list[PeerInfo]] = {}
        self.rejoined = False  # this worker took the rank of one that died (PSLAUNCH_RESTART_SCOPE=worker)
        # an elastic job's ranks that hold no member: those that left (``WORKER_LEFT``) or were never
        # taken yet (a job started with fewer than DMLC_NUM_WORKER); a joiner takes the lowest free one
        self.left: set[int] = set()
        self._versions: dict[int, int] = {}  # rank -> the scheduler's number of its last change seen here
        self.joined_at = 0  # a worker that joined a running elastic job: the round it counts from
        self.late = False  # a replica that joined a running job (its book says so)
        # False for a worker of a job with servers: its book holds the servers alone (the scheduler's
        # books are O(nodes x servers) in all, not O(nodes^2)); the workers come on request (PEERS)
        self.complete = True

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
        self.rejoined = book.get("rejoined") is True
        joined = book.get("joined")
        if joined is not None:  # a worker joining a running elastic job: the ranks free now, its first round
            free = book.get("free")
            if (type(joined) is not int or joined < 1 or not isinstance(free, list)
                    or not all(type(r) is int and 0 <= r < 1 << 20 for r in free)):
                raise ProtocolError(f"a joiner's address book with start round {joined!r} and free ranks {free!r:.80}")
            self.joined_at, self.left, self.rejoined = joined, set(free), True
        self.late = book.get("late") is True  # a replica joining a running job: its server's keys come to it
        self.complete = book.get("workers") != "on-request"
        self.peers = peers
        self.workers = sorted((p for p in peers.values() if p.role == "worker"), key=lambda p: p.rank)
        self.servers = sorted((p for p in peers.values() if p.role == "server"), key=lambda p: p.rank)
        replicas: dict[int, list[PeerInfo]] = {}
        for peer in sorted((p for p in peers.values() if p.role == "replica"), key=lambda p: p.uid):
            if not 0 <= peer.rank < len(self.servers):
                raise ProtocolError(f"the address book lists a replica of server {peer.rank}, but the job has "
                                    f"{len(self.servers)} servers")
            replicas.setdefault(peer.rank, []).append(peer)
        self.replicas = replicas
        if self.role == "worker":
            return self.servers + [p for held in replicas.values() for p in held]
        return self.workers + (self.servers if self.role == "replica" else [])  # a late replica's server sends it its keys

    def replica_joined(self, rank: int, peer: PeerInfo) -> None:
        """``peer`` joined the job as a replica of server ``rank``.

        Raises:
            ProtocolError: ``peer`` is not a replica of a server of this book.
        """
        if peer.role != "replica" or peer.rank != rank or not 0 <= rank < len(self.servers):
            raise ProtocolError(f"a {peer.role} of rank {peer.rank} joined as a replica of server {rank}, of "
                                f"{len(self.servers)}")
        peers = dict(self.peers)
        peers[peer.uid.encode()] = peer
        replicas = {r: list(held) for r, held in self.replicas.items()}
        replicas.setdefault(rank, []).append(peer)
        # whole new objects: a thread reading the book meanwhile sees the old one or the new one
        self.peers, self.replicas = peers, replicas

    def server_lost(self, rank: int, lost: str, by: str | None) -> PeerInfo | None:
        """Server ``rank``'s process ``lost`` (its uid: the server, or one of its replicas) is gone; ``by``,
        one of its replicas, serves its keys from now on (as a server of that rank); None: a replica
        was lost and the server stays. Returns the lost peer as the book had it (None: unknown).

        Raises:
            ProtocolError: ``by`` is not a replica of server ``rank`` in this book.
        """
        peers = dict(self.peers)
        gone = peers.pop(lost.encode(), None)
        replicas = {r: [p for p in held if p.uid != lost] for r, held in self.replicas.items()}
        servers = list(self.servers)
        if by is not None:
            taking = next((p for p in replicas.get(rank, []) if p.uid == by), None)
            if taking is None or not 0 <= rank < len(servers):
                raise ProtocolError(f"server {rank} is said to be replaced by {by!r}, which is no replica of it here")
            replicas[rank] = [p for p in replicas[rank] if p.uid != by]
            promoted = dataclasses.replace(taking, role="server", rank=rank)
            peers[by.encode()] = promoted
            servers[rank] = promoted
        # whole new objects: a thread reading the book meanwhile sees the old one or the new one
        self.peers, self.replicas, self.servers = peers, replicas, servers
        return gone

    def take_workers(self, records: list) -> None:
        """Add every worker's record (the scheduler's answer to PEERS) to a book that held none.

        Raises:
            ProtocolError: a malformed record, or not the job's workers by rank 0..n-1.
        """
        workers = sorted((PeerInfo.from_record(item) for item in records), key=lambda p: p.rank)
        if any(p.role != "worker" or p.rank != i for i, p in enumerate(workers)):
            raise ProtocolError("a PEERS reply that is not the job's workers, one per rank")
        peers = dict(self.peers)
        peers.update((p.uid.encode(), p) for p in workers)
        # whole new objects: a thread reading the book meanwhile sees the old one or the new one
        self.peers, self.workers, self.complete = peers, workers, True

    def replace_worker(self, old_uid: str, peer: PeerInfo) -> None:
        """A restarted worker ``peer`` took the rank of the worker whose identity was ``old_uid``.

        Raises:
            ProtocolError: ``peer`` is not a worker of a rank this book holds.
        """
        if not self.complete:  # it knows no worker: the new one comes with the rest, on request
            return
        if peer.role != "worker" or not 0 <= peer.rank < len(self.workers):
            raise ProtocolError(f"a rejoined {peer.role} of rank {peer.rank}, not one of the {len(self.workers)} workers")
        peers = dict(self.peers)
        peers.pop(old_uid.encode(), None)
        peers[peer.uid.encode()] = peer
        workers = list(self.workers)
        workers[peer.rank] = peer
        # whole new objects: a thread reading the book meanwhile sees the old one or the new one
        self.peers, self.workers = peers, workers

    def change(self, rank: int, member: bool, version: int) -> bool:
        """An elastic job's worker ``rank`` joined (``member``) or left it; True when that is news. The
        scheduler numbers its changes (``version``): a join's note comes through a server, a leave's
        from the scheduler, so the older of two changes of one rank may arrive last (and is ignored)."""
        if version <= self._versions.get(rank, 0):
            return False
        self._versions[rank] = version
        left = set(self.left)
        if member:
            left.discard(rank)
        else:
            left.add(rank)
        self.left = left  # a whole new set: readers on other threads need no lock
        return True

    def version_of(self, rank: int) -> int:
        """The scheduler's number of the last change of worker ``rank`` seen here (0: none)."""
        return self._versions.get(rank, 0)

    def add_worker(self, peer: PeerInfo, limit: int) -> None:
        """A worker ``peer`` joined the running job with a rank no member holds, below ``limit``
        (DMLC_NUM_WORKER). Ranks never held yet below it stand in the list as place-holders.

        Raises:
            ProtocolError: ``peer`` is no worker, or its rank is not below ``limit``.
        """
        if peer.role != "worker" or not 0 <= peer.rank < limit:
            raise ProtocolError(f"a joining {peer.role} of rank {peer.rank}, not one of the job's 0..{limit - 1}")
        peers = dict(self.peers)
        workers = list(self.workers)
        workers += [PeerInfo("worker", rank, "", 0, f"no-worker-{rank}", "", "") for rank in range(len(workers), peer.rank + 1)]
        peers.pop(workers[peer.rank].uid.encode(), None)  # the rank's holder left the job before, or a place-holder
        workers[peer.rank] = peer
        peers[peer.uid.encode()] = peer
        # whole new objects: a thread reading the book meanwhile sees the old one or the new one
        self.peers, self.workers = peers, workers

    def get(self, sender: bytes) -> PeerInfo | None:
        """The peer whose identity is ``sender``, or None."""
        return self.peers.get(sender)
