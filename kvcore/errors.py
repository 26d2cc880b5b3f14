"""Errors raised by kvcore.

The tree::

    KVStoreError
    ├── UnknownStoreError          create() got a name no store is registered under
    ├── KeyTypeError               a store mixes int and str keys, or a key is neither
    ├── DuplicateKeyError          init() of a key that is already initialised
    ├── UninitializedKeyError      push/pull of a key that was never initialised (also a KeyError)
    ├── ShapeMismatchError         a value's shape differs from the key's shape
    │   └── OutShapeError          pull into an ``out`` of the wrong shape
    ├── ReadOnlyOutError           pull into an ``out`` that cannot be written (also a ValueError)
    ├── DTypeMismatchError         a value's dtype differs from the key's dtype
    ├── ValueCountError            lists of keys and values (or outs) of different lengths
    ├── OptimizerError             missing or unusable optimizer / updater
    ├── KVTimeoutError             a wait on a handle ran past its timeout (also TimeoutError)
    ├── CompressionError           bad gradient compression parameters, or a store that cannot compress
    └── DistributedError           the distributed runtime failed (the psnode error is its __cause__)
        ├── EnvContractError       a DMLC_* / PS_* / PSLAUNCH_* variable is missing or malformed (also a
        │                          ValueError); uncaught, it ends the process with its one line
        ├── NodeDiedError          a node of the job died or left: .role, .rank, .host name it
        ├── ServerError            a server refused or failed a request (e.g. the updater raised)
        ├── WorkerMismatchError    workers passed one collective different shapes or dtypes (also a ValueError)
        ├── CheckpointError        a checkpoint could not be committed or restored (kvcore.elastic)
        └── DistTimeoutError       a wait on the runtime timed out (also a KVTimeoutError)

Every message names the key and the values involved. The runtime's own errors (``psnode.errors``)
become these at one edge, ``kvcore.dist_errors``.
"""

from __future__ import annotations

__all__ = [
    "KVStoreError",
    "UnknownStoreError",
    "KeyTypeError",
    "DuplicateKeyError",
    "UninitializedKeyError",
    "ShapeMismatchError",
    "OutShapeError",
    "ReadOnlyOutError",
    "DTypeMismatchError",
    "ValueCountError",
    "OptimizerError",
    "KVTimeoutError",
    "CompressionError",
    "DistributedError",
    "EnvContractError",
    "NodeDiedError",
    "ServerError",
    "WorkerMismatchError",
    "CheckpointError",
    "DistTimeoutError",
]


class KVStoreError(Exception):
    """Base of every error kvcore raises on purpose."""


class UnknownStoreError(KVStoreError, ValueError):
    """``create(name)`` got a name that no store is registered under."""


class KeyTypeError(KVStoreError, TypeError):
    """A key is neither int nor str, or a store was given both kinds."""


class DuplicateKeyError(KVStoreError):
    """``init`` was called for a key that is already initialised."""


class UninitializedKeyError(KVStoreError, KeyError):
    """``push``/``pull`` of a key that was never initialised."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(KVStoreError, ValueError):
    """A pushed value's shape differs from the shape the key was initialised with."""


class OutShapeError(ShapeMismatchError):
    """``pull`` into an ``out`` array whose shape differs from the key's shape."""


class ReadOnlyOutError(KVStoreError, ValueError):
    """``pull`` into an ``out`` array that cannot be written (a read-only numpy array)."""


class DTypeMismatchError(KVStoreError, TypeError):
    """A value's dtype differs from the dtype the key was initialised with."""


class ValueCountError(KVStoreError, ValueError):
    """A list of keys and the list of values or outs given with it have different lengths."""


class OptimizerError(KVStoreError):
    """An optimizer or updater is missing where one is required, or cannot be used."""


class KVTimeoutError(KVStoreError, TimeoutError):
    """A wait on a handle ran past its timeout (the operation goes on)."""


class CompressionError(KVStoreError, ValueError):
    """``set_gradient_compression`` got parameters MXNet would refuse, or a store that cannot compress."""


class DistributedError(KVStoreError):
    """The distributed runtime (psnode) failed; the psnode error is the ``__cause__``."""


class EnvContractError(DistributedError, ValueError):
    """The job's environment (docs/env.md) lacks a variable or holds a malformed one; the message names
    it and its value. Uncaught, it ends the process with that one line (``kvcore.dist_errors``), as
    pslaunch's own errors do: a traceback would bury it."""


class NodeDiedError(DistributedError):
    """A node of the job died or left; ``role``, ``rank`` and ``host`` name it."""

    def __init__(self, message: str, role: str = "", rank: int = -1, host: str = "") -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.host = host


class ServerError(DistributedError):
    """A server refused or failed a request; the message is the server's."""


class WorkerMismatchError(DistributedError, ValueError):
    """Workers passed one collective (an allreduce store's key, a ``kvcore.collectives`` call) values
    of different shapes or dtypes; every worker raises it, and the message names both."""
class CheckpointError(DistributedError):
    """``kvcore.elastic.State.commit`` or ``restore`` failed; the message says which checkpoint and why
    (every worker raises the same one)."""


class DistTimeoutError(DistributedError, KVTimeoutError):
    """A wait on the distributed runtime ran past its limit."""
