"""The mshadow-ps style shared model: asynchronous push / pull_req / pull_wait per device.

``create_shared_model('local')`` aggregates the devices of this process (Level 1, strict BSP);
``create_shared_model('dist', updater=...)`` also sends each key's Level-1 result through the
distributed KVStore's parameter servers, which apply the ``ModelUpdater`` (Level 2, asynchronous).

Modules: ``api`` (the model), ``pulls`` (its pull side), ``level1`` (in-process aggregation),
``level2`` (the bridge to the distributed store), ``updater`` (``ModelUpdater`` and its server
adapter), ``queues`` (priority work queues and their threads), ``config`` (``set_param``),
``checks`` (argument checks), ``errors`` (the exception tree).
"""

from .api import MODEL_KINDS, SharedModel, create_shared_model
from .config import PARAM_NAMES, SharedModelConfig
from .errors import (
    ConfigError,
    DuplicatePullError,
    KeyNotInitialisedError,
    KeyShapeError,
    PullFailedError,
    PullTimeoutError,
    SharedModelError,
    StateError,
    UnknownDeviceError,
    WeightMismatchError,
)
from .updater import ModelUpdater, ServerUpdater, SumUpdater

__all__ = [
    "MODEL_KINDS",
    "SharedModel",
    "create_shared_model",
    "PARAM_NAMES",
    "SharedModelConfig",
    "ModelUpdater",
    "ServerUpdater",
    "SumUpdater",
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
