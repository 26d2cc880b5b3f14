"""The transport interface: frames between named peers, nothing more.

A transport binds one receiving endpoint per node, connects to peers by name, sends a list of
frames to a peer and receives ``(peer, frames)``. It knows nothing of registration, barriers or
heartbeats (those live in ``psnode.node.control``, shared by every transport). Nodes are given a
``Transport`` instance; ``create_transport(name)`` builds one by its registered name (the nodes of a
job use ``PSLAUNCH_TRANSPORT``, default ``zmq``), and an unknown name's error lists the known ones.

Registered: ``zmq`` (``psnode.transport.zeromq``, what jobs use across processes) and ``inproc``
(``psnode.transport.inproc``, every node in one process: the test kit's transport). Adding one is a
module with a ``Transport`` subclass and a line in ``_TRANSPORTS``; it must pass
tests/psnode/test_transport.py, which runs for every registered name.

Thread-safety (every transport): ``recv`` and ``poll`` are called by one thread at a time (whichever
thread receives for the node, under the node's lock); ``send`` and ``wake`` may be called from any
thread, and ``send`` is serialised internally.
"""

from __future__ import annotations

import abc
import importlib
import time
from typing import Any, Callable, Sequence

from psnode.errors import PSNodeError, WouldBlock

__all__ = ["Transport", "Frame", "register_transport", "create_transport", "node_transport", "transport_names",
           "WouldBlock", "send_while_full"]


class Frame:
    """A received frame that is not a ``zmq.Frame``: ``.buffer`` (a memoryview) and ``.bytes``, as one is."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer

    @property
    def bytes(self) -> bytes:
        return self.buffer.tobytes()


def send_while_full(send: Callable[[], Any], wait: float, wanted: Callable[[], bool]) -> Any:
    """``send()`` (a send with ``block=False``), tried again every millisecond while the peer's queue
    is full: for a message that must not be dropped while its peer may still take it. Gives up after
    ``wait`` seconds, or once ``wanted()`` is False, by raising that ``WouldBlock``.

    Raises:
        WouldBlock: given up. PSNodeError: as ``send`` raises it.
    """
    deadline = None
    while True:
        try:
            return send()
        except WouldBlock:
            now = time.monotonic()
            deadline = deadline or now + wait
            if now > deadline or not wanted():
                raise
            time.sleep(0.001)


class Transport(abc.ABC):
    """Frames between peers. ``identity`` names this node to the peers it sends to.

    A transport is built as ``factory(identity, io_sched=..., security=..., max_message=...)``:
    ``io_sched`` is the node's ``PSLAUNCH_IO_SCHED`` (``batch`` or ``normal``), how background I/O
    threads, if it has any, are scheduled; ``security`` a ``psnode.transport.security.Security`` (who may
    connect: only holders of the job key); ``max_message`` the largest frame to accept. A transport
    without I/O threads, or whose peers are all in one process, ignores what does not apply.
    """

    def __init__(self, identity: bytes) -> None:
        self.identity = identity

    @abc.abstractmethod
    def bind(self, port: int = 0, local_name: str | None = None, host: str | None = None) -> int:
        """Start receiving on TCP ``port`` (0: a free one) of address ``host`` (None: every
        interface); return the port.

        ``local_name`` also opens a same-host endpoint (``same_host_endpoint(local_name)``).

        Raises:
            TransportError: the port is taken or cannot be bound (the message names it).
        """

    @abc.abstractmethod
    def connect(self, peer: bytes, endpoint: str, watch: bool = False) -> None:
        """Open a connection to ``peer`` at ``endpoint`` (``tcp://host:port`` or a same-host endpoint).

        ``watch``: keep what the peer answers to this node's security handshake (``refused``).
        """

    def refused(self, peer: bytes) -> str | None:
        """Why ``peer`` (connected with ``watch=True``) refused this node's handshake, or None."""
        return None

    def watch_liveness(self, peer: bytes) -> None:
        """Watch the connection to ``peer`` (already connected) for its end: ``gone`` reports it. A
        transport that cannot see a connection end reports nothing (heartbeats still find the peer)."""

    def gone(self, grace: float) -> list[bytes]:
        """The watched peers whose connection ended ``grace`` seconds ago or more and has not come
        back (a process that died closes its sockets; its port then refuses). Each is reported once."""
        return []

    def down(self) -> set[bytes]:
        """The watched peers whose connection is closed now (not yet reported ``gone``)."""
        return set()

    def dropped(self, peer: bytes) -> bool:
        """Whether the watched connection to ``peer`` ended since the last call (even if it came back
        since: a peer started again at the same address). Keeps watching."""
        return False

    def disconnect(self, peer: bytes) -> None:
        """Drop the connection to ``peer`` and what is queued for it (a peer that is lost)."""

    @abc.abstractmethod
    def send(self, peer: bytes, frames: Sequence[Any], track: bool = False, block: bool = True) -> Any:
        """Queue ``frames`` for ``peer`` and return at once; buffers are not copied.

        The caller must keep buffer frames alive and unchanged until the returned tracker (when
        ``track``) is done. With ``block=False`` a full queue raises ``WouldBlock``.

        Raises:
            TransportError: ``peer`` is unknown or the send failed.
            ClosedError: the transport was closed.
        """

    def write_through(self, peer: bytes, frames: list) -> Any:
        """Write ``frames`` for ``peer`` from the calling thread before returning, when this transport
        can at once and without a copy (a data lane that is idle): a tracker, and the buffers may change
        as soon as this returns (what the socket did not take at once was copied; the tracker is done
        once that too was written). None: nothing was written (``send`` a copy). A transport without
        such a way writes nothing."""
        return None

    @abc.abstractmethod
    def poll(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a message; True when one can be received."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Make a ``poll`` in progress return now, or the next one when none is (thread-safe).

        The woken ``poll`` returns False unless a message is also ready. A node uses this to hand
        its receiving role from one thread to another without waiting for a poll timeout.
        """

    @abc.abstractmethod
    def recv(self) -> tuple[bytes, list[Any]]:
        """Receive one message without waiting: ``(sender identity, frames)``.

        Frames expose ``.buffer`` (a memoryview) and ``.bytes``.
        """

    @abc.abstractmethod
    def close(self, linger: float = 0.0) -> None:
        """Close every socket; messages still queued get ``linger`` seconds to leave. Idempotent."""

    @staticmethod
    @abc.abstractmethod
    def same_host_endpoint(local_name: str) -> str:
        """The endpoint a peer on this host connects to for the node bound with ``local_name``."""


_TRANSPORTS: dict[str, str | Callable[..., Transport]] = {
    "zmq": "psnode.transport.zeromq:ZmqTransport",
    "inproc": "psnode.transport.inproc:InProcTransport",
}


def register_transport(name: str, factory: str | Callable[..., Transport]) -> None:
    """Register a transport class (or ``"module:Class"``) under ``name``."""
    _TRANSPORTS[name] = factory


def transport_names() -> list[str]:
    """Every registered transport name, sorted."""
    return sorted(_TRANSPORTS)


def create_transport(name: str, identity: bytes, **kwargs: Any) -> Transport:
    """Build the transport registered under ``name``.

    Raises:
        PSNodeError: no transport has that name; the message lists the known ones.
    """
    factory = _TRANSPORTS.get(name)
    if factory is None:
        raise PSNodeError(f"unknown transport {name!r}; known transports: {', '.join(transport_names())}")
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        _TRANSPORTS[name] = factory
    return factory(identity, **kwargs)


def node_transport(env: Any, identity: bytes) -> Transport:
    """The transport a node of ``env`` (a ``NodeEnv``) uses: the one ``PSLAUNCH_TRANSPORT`` names,
    secured by the job key and bounded by the job's largest message."""
    return create_transport(env.transport, identity, io_sched=env.io_sched, security=env.security(),
                            max_message=env.max_message)
