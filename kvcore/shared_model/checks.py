"""Argument checks of the shared model: device ids, parameter combinations, shapes and arrays.

Each raises an error of ``errors`` whose message names the values involved.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable

import numpy as np

from .. import arrays
from .config import SharedModelConfig
from .errors import ConfigError, KeyShapeError, UnknownDeviceError

__all__ = ["check_ids", "check_updater_config", "resolve_device_kind", "as_shape", "check_array"]


def check_ids(devices: Iterable[int]) -> list[int]:
    """The device ids given to ``init`` as a list of distinct ints >= 0."""
    ids = list(devices) if not isinstance(devices, int) else [devices]
    if not ids:
        raise ConfigError("init() needs at least one device id, got an empty list")
    for devid in ids:
        if isinstance(devid, bool) or not isinstance(devid, (int, np.integer)) or devid < 0:
            raise ConfigError(f"device ids are ints >= 0, got {devid!r} in {ids!r}")
    ids = [int(d) for d in ids]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"device ids must be distinct, got {ids}")
    return ids


def check_updater_config(kind: str, on_server: int, updater: Any, config: SharedModelConfig) -> None:
    """Refuse combinations of model kind, ``update_on_server``, updater and push ops that cannot work."""
    if kind == "dist":
        if on_server == 0:
            raise ConfigError(
                "a 'dist' model updates on the servers: update_on_server=0 is not supported; "
                "leave it at 1 and give a ModelUpdater"
            )
        if updater is None:
            raise ConfigError(
                "a 'dist' model needs a ModelUpdater: pass create_shared_model('dist', updater=...) "
                "or call set_updater() before init; the servers apply it to every merged push"
            )
        gathered = [k for k, op in config.push_ops.items() if op == "gather"]
        if gathered:
            raise ConfigError(f"push_op 'gather' is only supported by a 'local' model; keys {gathered} ask for it")
    elif on_server == 1 and updater is None:
        raise ConfigError("update_on_server=1 needs a ModelUpdater: pass updater= or call set_updater() before init")
    elif on_server == 0 and updater is not None:
        raise ConfigError(
            "a ModelUpdater was given but update_on_server=0 (pulls return the summed pushes and "
            "the updater would never run); set update_on_server=1 or drop the updater"
        )


def resolve_device_kind(mode: str, ids: list[int]) -> bool:
    """True when the model runs on GPUs (``mode`` is the ``device`` parameter)."""
    if mode == "cpu":
        return False
    if mode == "auto" and not arrays.gpu_available():
        return False
    count = arrays.num_gpus()
    if count == 0:
        raise ConfigError("set_param('device', 'gpu') was given, but no usable GPU was found (CuPy sees none)")
    too_big = [d for d in ids if d >= count]
    if too_big:
        raise UnknownDeviceError(f"device id(s) {too_big} name GPUs that do not exist: this machine has {count} GPU(s)")
    return True


def as_shape(shape: Any, key: Hashable) -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints) as a tuple of non-negative ints."""
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError as exc:
        raise KeyShapeError(f"init_key of key {key!r}: shape must be a tuple of ints, got {shape!r}") from exc
    if any(d < 0 for d in dims):
        raise KeyShapeError(f"init_key of key {key!r}: shape {dims} has a negative dimension")
    return dims


def check_array(
    data: Any, shape: tuple[int, ...], dtype: np.dtype, key: Hashable, dev: int, op: str, device: Any = None
) -> None:
    """Refuse anything but a numpy or CuPy array of exactly ``shape`` and ``dtype``.

    With ``device`` a GPU (the model's device behind ``dev``), a CuPy array must live on that GPU:
    the device's threads order their copies with the work of its own streams only.
    """
    if not arrays.is_array(data):
        raise KeyShapeError(f"{op} of key {key!r} on device {dev}: expected a numpy or CuPy array, got {type(data).__name__}")
    if tuple(data.shape) != shape:
        raise KeyShapeError(f"{op} of key {key!r} on device {dev}: the key has shape {shape}, the array has shape {tuple(data.shape)}")
    if np.dtype(data.dtype) != dtype:
        raise KeyShapeError(f"{op} of key {key!r} on device {dev}: the key has dtype {dtype}, the array has dtype {np.dtype(data.dtype)}")
    if device is not None and device.is_gpu:
        where = arrays.device_of(data)
        if where.is_gpu and where != device:
            raise KeyShapeError(
                f"{op} of key {key!r} on device {dev}: the array lives on {where}, not on {device}; give each "
                "device its own arrays (kvcore.arrays.to_device copies one there)"
            )
