"""Errors raised by the shared-model API.

The tree (every class is also a ``kvcore.KVStoreError``)::

    SharedModelError
    ├── ConfigError              bad set_param name or value, set_param after init, 'dist' without
    │                            an updater, push_op 'gather' where only 'sum' can work
    ├── StateError               a call made in the wrong state: push before init, init twice, a
    │                            call on a closed model
    ├── UnknownDeviceError       a device id that was not given to init()
    ├── KeyNotInitialisedError   push / pull of a key this device never ran init_key for (also a KeyError)
    ├── KeyShapeError            data whose shape or dtype differs from the key's, or that lives on
    │                            another GPU than its device (also a ValueError)
    ├── DuplicatePullError       pull_req while this device's previous pull of the key is still running
    ├── PullFailedError          the work behind a pull failed (a copy, the updater, a callback, Level 2)
    ├── PullTimeoutError         pull_wait ran past its timeout; the message says what it waits for
    └── WeightMismatchError      check_weight found an array that differs from the model's weights

Every message names the key and the device id.
"""

from __future__ import annotations

from ..errors import KVStoreError, UninitializedKeyError
from ..errors import KVTimeoutError

__all__ = [
    "SharedModelError",
    "ConfigError",
    "StateError",
    "UnknownDeviceError",
    "KeyNotInitialisedError",
    "KeyShapeError",
    "DuplicatePullError",
    "PullFailedError",
    "PullTimeoutError",
    "WeightMismatchError",
]


class SharedModelError(KVStoreError):
    """Base of every error the shared-model API raises on purpose."""


class ConfigError(SharedModelError, ValueError):
    """A parameter name or value is not accepted, or parameters contradict each other."""


class StateError(SharedModelError, RuntimeError):
    """A call came in a state that does not allow it (before init, after close, ...)."""


class UnknownDeviceError(SharedModelError, ValueError):
    """A device id that is not among the ids given to ``init``."""


class KeyNotInitialisedError(SharedModelError, UninitializedKeyError):
    """A key used on a device before ``init_key(shape, key, dev)`` ran for that device."""


class KeyShapeError(SharedModelError, ValueError):
    """An array whose shape or dtype does not match the key's, or a CuPy array on another GPU than its device."""


class DuplicatePullError(SharedModelError):
    """``pull_req`` of a key on a device whose previous pull of that key has not finished."""


class PullFailedError(SharedModelError):
    """The work that a pull depends on failed; the cause is chained."""


class PullTimeoutError(SharedModelError, KVTimeoutError):
    """``pull_wait`` gave up after its timeout; the pull itself may still complete later."""


class WeightMismatchError(SharedModelError, AssertionError):
    """``check_weight`` found a device's array different from the model's weights."""
