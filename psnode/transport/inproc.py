"""A transport whose peers live in the same process: the runtime's parts tested without sockets.

Every ``InProcTransport`` belongs to a hub (``InProcHub``; one shared hub by default). ``bind``
takes a port number in the hub (any free number, or the one asked for) and, with a local name, the
same-host endpoint ``inproc://<name>``; ``connect`` names a peer by any endpoint ending in that port
(``tcp://127.0.0.1:<port>``: the host does not matter in one process) or by its same-host endpoint.
A message is delivered to the receiver's queue at once, its frames copied as the wire would (the
sender may change its buffers right after ``send``), in the order sent per sender.

What it is for: the scheduler, servers and workers run together in one test process on one thread
or several, so their protocol, the round machine and the request logic are tested in milliseconds
(``testkit.InProcJob``). It also lets a test see and steer what travels: ``outgoing`` keeps
every message sent as ``(peer, [bytes, ...])`` while ``record`` is on, and a peer in ``full`` makes
non-blocking sends to it raise ``WouldBlock`` as a full ZeroMQ queue does.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Sequence

import numpy as np

from psnode.errors import ClosedError, TransportError, WouldBlock
from psnode.transport.base import Frame, Transport

__all__ = ["InProcHub", "InProcTransport", "default_hub"]


class _Done:
    """The tracker of a tracked send: the frames were copied, so the buffers are free at once."""

    done = True

    def wait(self, timeout: float | None = None) -> None:
        return None


_DONE = _Done()


def _copy(frame: Any) -> Frame:
    if isinstance(frame, np.ndarray):
        return Frame(memoryview(np.ascontiguousarray(frame).tobytes()))
    return Frame(memoryview(bytes(frame)))


class InProcHub:
    """The endpoints of in-process transports that can reach each other (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_endpoint: dict[str, "InProcTransport"] = {}
        self._next_port = 40000

    def bind(self, transport: "InProcTransport", port: int, local_name: str | None) -> int:
        with self._lock:
            if port == 0:
                while f"port:{self._next_port}" in self._by_endpoint:
                    self._next_port += 1
                port = self._next_port
                self._next_port += 1
            elif f"port:{port}" in self._by_endpoint:
                raise TransportError(f"cannot bind TCP port {port} (with local name {local_name!r}): it is taken in this hub")
            self._by_endpoint[f"port:{port}"] = transport
            if local_name:
                self._by_endpoint[f"inproc://{local_name}"] = transport
        return port

    def unbind(self, transport: "InProcTransport") -> None:
        with self._lock:
            for name in [n for n, t in self._by_endpoint.items() if t is transport]:
                del self._by_endpoint[name]

    def find(self, endpoint: str) -> "InProcTransport | None":
        """The transport bound at ``endpoint`` (``tcp://host:port`` or ``inproc://name``), if any."""
        if endpoint.startswith("inproc://"):
            key = endpoint
        else:
            key = "port:" + endpoint.rsplit(":", 1)[-1]
        with self._lock:
            return self._by_endpoint.get(key)


_DEFAULT_HUB = InProcHub()


def default_hub() -> InProcHub:
    """The hub transports join when none is given."""
    return _DEFAULT_HUB


class InProcTransport(Transport):
    """Frames between transports of one hub; see the module docstring."""

    def __init__(self, identity: bytes, hub: InProcHub | None = None, **_: Any) -> None:
        super().__init__(identity)
        self.hub = hub or _DEFAULT_HUB
        self._cond = threading.Condition()
        self._queue: deque = deque()
        self._woken = False
        self._bound = False
        self._closed = False
        self._peers: dict[bytes, tuple[str, bytes]] = {}  # peer -> (endpoint, our identity when connected)
        self.record = False
        self.outgoing: list[tuple[bytes, list[bytes]]] = []  # what was sent while ``record`` was on
        self.full: set[bytes] = set()  # peers whose queue is full (non-blocking sends raise WouldBlock)

    @staticmethod
    def same_host_endpoint(local_name: str) -> str:
        return f"inproc://{local_name}"

    def bind(self, port: int = 0, local_name: str | None = None, host: str | None = None) -> int:
        self._check_open()
        port = self.hub.bind(self, port, local_name)
        self._bound = True
        return port

    def connect(self, peer: bytes, endpoint: str, watch: bool = False) -> None:
        self._check_open()
        self._peers.setdefault(peer, (endpoint, self.identity))

    def send(self, peer: bytes, frames: Sequence[Any], track: bool = False, block: bool = True) -> Any:
        self._check_open()
        entry = self._peers.get(peer)
        if entry is None:
            raise TransportError(f"no connection to peer {peer.decode(errors='replace')}")
        if not block and peer in self.full:
            raise WouldBlock(f"the queue to {peer.decode(errors='replace')} is full")
        endpoint, identity = entry
        target = self.hub.find(endpoint)
        message = [_copy(f) for f in frames]
        if self.record:
            self.outgoing.append((peer, [f.buffer.obj for f in message]))
        if target is not None:  # like ZeroMQ, a message to an endpoint nobody binds is dropped
            target._deliver(identity, message)
        return _DONE if track else None

    def _deliver(self, sender: bytes, frames: list) -> None:
        with self._cond:
            if self._closed:
                return
            self._queue.append((sender, frames))
            self._cond.notify_all()

    def poll(self, timeout: float) -> bool:
        self._check_open()
        with self._cond:
            if not self._queue and not self._woken and timeout > 0:
                self._cond.wait(timeout)
            self._woken = False
            return bool(self._queue)

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def recv(self) -> tuple[bytes, list[Any]]:
        self._check_open()
        with self._cond:
            if not self._queue:
                raise TransportError("receive found no message (call poll first)")
            return self._queue.popleft()

    def close(self, linger: float = 0.0) -> None:
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self.hub.unbind(self)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the transport was closed")
