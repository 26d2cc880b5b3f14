"""The pslaunch runtime over ZeroMQ, a package per part: ``transport`` (how bytes travel), ``node``
(what every node shares: the wire format, the connection, the control plane), ``scheduler``,
``server``, ``worker``, ``collectives`` (between workers, without servers), ``checkpoint`` (the
files), ``compression`` and ``devices`` (numpy/CuPy).

``python -m psnode scheduler|server`` runs a bundled node from the environment contract
(docs/env.md, read by ``psnode.env``). Workers are started by ``kvcore`` (``WorkerNode``). The
numpy/CuPy array backend both use is ``psnode.devices``. Errors are in ``psnode.errors``;
``testkit`` starts whole jobs on 127.0.0.1 for tests, and the ``inproc`` transport runs
nodes inside one process. docs/runtime.md draws the parts.
"""

from psnode.env import NodeEnv, read_env
from psnode.errors import (
    ClosedError,
    EnvError,
    NodeTimeoutError,
    PeerDiedError,
    PeerError,
    ProtocolError,
    PSNodeError,
    RegistrationTimeoutError,
    RemoteError,
    RequestRefused,
    TransportError,
    WouldBlock,
)
from psnode.main import claim_process, claimed_role, run_node
from psnode.transport.base import Transport, create_transport, register_transport, transport_names

__all__ = [
    "NodeEnv",
    "read_env",
    "run_node",
    "claimed_role",
    "claim_process",
    "Transport",
    "create_transport",
    "register_transport",
    "transport_names",
    "PSNodeError",
    "EnvError",
    "ClosedError",
    "PeerError",
    "PeerDiedError",
    "RemoteError",
    "ProtocolError",
    "RequestRefused",
    "NodeTimeoutError",
    "RegistrationTimeoutError",
    "TransportError",
    "WouldBlock",
]
