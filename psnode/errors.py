"""Errors raised by the psnode runtime.

The tree::

    PSNodeError
    ├── EnvError                   a DMLC_* / PS_* / PSLAUNCH_* variable is missing or malformed (also ValueError)
    ├── ClosedError                the node was closed by this process; no more calls are possible
    ├── PeerError                  broken by a peer
    │   ├── PeerDiedError          a node stopped (no heartbeat, or it left); names role, rank and host
    │   ├── RemoteError            a server could not carry out a request (its message is included)
    │   ├── ProtocolError          a peer sent something this node cannot understand
    │   └── RefusedError           the scheduler refused this node: another job's port, another key
    │   └── MismatchError          workers passed one collective different shapes or dtypes (names both)
    ├── RequestRefused             a server refuses one request (raised on the server; the worker that
    │                              asked gets its message back as a RemoteError)
    ├── NodeTimeoutError           a wait ran past its limit (also TimeoutError)
    │   └── RegistrationTimeoutError   not every node registered in time; names what is missing
    └── TransportError             the operating system or ZeroMQ refused a bind, connect or send
        └── WouldBlock             a non-blocking send found the peer's queue full; nothing was sent

*Closed by you*, *broken by the peer* and *timed out* stay distinct so callers can tell "I stopped it"
from "it failed" from "it is slow". Errors from ZeroMQ and the OS are translated where they enter
(``raise TransportError(...) from exc``), so no ``zmq.ZMQError`` escapes psnode.
"""

from __future__ import annotations

__all__ = [
    "PSNodeError",
    "EnvError",
    "ClosedError",
    "PeerError",
    "PeerDiedError",
    "RemoteError",
    "ProtocolError",
    "RefusedError",
    "MismatchError",
    "RequestRefused",
    "NodeTimeoutError",
    "RegistrationTimeoutError",
    "TransportError",
    "WouldBlock",
]


class PSNodeError(Exception):
    """Base of every error psnode raises on purpose."""


class EnvError(PSNodeError, ValueError):
    """An environment variable of the contract (docs/env.md) is missing or malformed."""


class ClosedError(PSNodeError):
    """The node was closed by this process; the call cannot be carried out."""


class PeerError(PSNodeError):
    """A peer broke the job: it died, refused a request, or sent garbage."""


class PeerDiedError(PeerError):
    """A node of the job stopped; ``role``, ``rank`` and ``host`` say which one."""

    def __init__(self, message: str, role: str = "", rank: int = -1, host: str = "") -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.host = host


class RemoteError(PeerError):
    """A server could not carry out a request; the message is the server's."""


class ProtocolError(PeerError):
    """A message did not follow the wire format."""


class RefusedError(PeerError):
    """The scheduler refused this node's connection or registration (the message says why: the port
    belongs to another job, the job keys differ, the job is full)."""
class MismatchError(PeerError):
    """Workers passed one collective (same key and version) values of different shapes or dtypes.

    Every worker of the collective raises it, with a message that names the key and both values.
    """


class RequestRefused(PSNodeError):
    """A server refuses one request (an unknown key, a wrong size, a failed updater ...).

    Raised inside the server while it serves the request; the server answers the request with the
    message (the worker raises ``RemoteError``) and goes on serving.
    """


class NodeTimeoutError(PSNodeError, TimeoutError):
    """A wait ran past its limit."""


class RegistrationTimeoutError(NodeTimeoutError):
    """Not every node registered with the scheduler in time; the message names the missing ones."""


class TransportError(PSNodeError):
    """ZeroMQ or the operating system refused an operation (bind, connect, send)."""


class WouldBlock(TransportError):
    """``send(..., block=False)`` found the peer's queue full; nothing was sent (retry later)."""
