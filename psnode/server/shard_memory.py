"""Where a server keeps its shards: host memory (numpy) or a GPU (CuPy through ``psnode.devices``).

Both kinds offer the same few operations the round machine needs (place, load, add, a host view,
chosen rows), so ``ServerStore`` never asks which one it has. ``shard_memory(spec)`` picks one from
``PSLAUNCH_SERVER_DEVICE``. Every operation has completed when it returns.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import numpy as np

from psnode import devices

__all__ = ["HostMemory", "GpuMemory", "shard_memory"]


class HostMemory:
    """Shards in host memory (numpy); with ``shared`` (``psnode.server.shared_values``), big values in
    regions the server's workers on this host copy out themselves."""

    name = "cpu"

    def __init__(self, shared: Any = None) -> None:
        self.shared = shared

    def place(self, array: np.ndarray) -> Any:
        out = self.shared.empty(array.nbytes, array.dtype, placed=True) if self.shared is not None else None
        if out is None:
            return np.array(array, copy=True)
        out = out.reshape(array.shape)
        np.copyto(out, array)
        return out

    def empty_like(self, array: Any) -> Any:
        out = self.shared.empty(array.nbytes, array.dtype) if self.shared is not None else None
        return np.empty_like(array) if out is None else out.reshape(array.shape)

    def copy(self, array: Any) -> Any:
        out = self.empty_like(array)
        np.copyto(out, array)
        return out

    @staticmethod
    def load(dst: Any, src: np.ndarray) -> None:
        np.copyto(dst, src)  # both flat

    @staticmethod
    def add(dst: Any, src: np.ndarray) -> None:
        np.add(dst, src, out=dst)

    @staticmethod
    def add2(dst: Any, a: np.ndarray, b: np.ndarray) -> None:
        np.add(a, b, out=dst)

    @staticmethod
    def host(array: Any) -> np.ndarray:
        return array

    @staticmethod
    def rows(array: Any, row_size: int, rows: np.ndarray) -> np.ndarray:
        return array.reshape(-1, row_size)[rows]

    def context(self):
        return contextlib.nullcontext()


class GpuMemory:
    """Shards on a GPU through ``psnode.devices`` (CuPy).

    Pushes arrive in host frames: each is uploaded into a GPU buffer kept per shard size (the server
    is single-threaded and every upload completes before the next), so a push allocates nothing.
    Replies leave from a pinned host copy (full bus speed for the download), drawn from CuPy's
    pinned pool per reply: ZeroMQ may still be sending one reply's copy while the next is made,
    and the pool takes a copy back only once nothing refers to it. Row pulls download only the
    rows asked for.
    """

    def __init__(self, device: devices.Device) -> None:
        self.device = device
        self.name = str(device)
        self._uploads: dict[tuple[tuple[int, ...], np.dtype], Any] = {}

    def place(self, array: np.ndarray) -> Any:
        placed = devices.empty(array.shape, array.dtype, self.device)
        devices.copy_into(placed, array)
        return placed

    def empty_like(self, array: Any) -> Any:
        return devices.empty(array.shape, array.dtype, self.device)

    @staticmethod
    def copy(array: Any) -> Any:
        return array.copy()

    def load(self, dst: Any, src: np.ndarray) -> None:
        devices.copy_into(dst, src.reshape(dst.shape))

    def add(self, dst: Any, src: np.ndarray) -> None:
        key = (tuple(dst.shape), np.dtype(dst.dtype))
        upload = self._uploads.get(key)
        if upload is None:
            upload = self._uploads[key] = devices.empty(dst.shape, dst.dtype, self.device)
        devices.copy_into(upload, src.reshape(dst.shape))
        with devices.device_context(self.device):
            dst += upload
            devices.synchronize_stream(self.device)

    def add2(self, dst: Any, a: np.ndarray, b: np.ndarray) -> None:
        self.load(dst, a)
        self.add(dst, b)

    def host(self, array: Any) -> np.ndarray:
        out = devices.pinned_empty(array.shape, array.dtype)
        devices.copy_into(out, array)
        return out

    def rows(self, array: Any, row_size: int, rows: np.ndarray) -> np.ndarray:
        with devices.device_context(self.device):
            picked = array.reshape(-1, row_size)[devices.to_device(rows, self.device)]
            out = devices.pinned_empty(picked.shape, picked.dtype)
            devices.copy_into(out, picked)
        return out

    def context(self):
        return devices.device_context(self.device)


def shard_memory(spec: str, shared: Any = None) -> Any:
    """Where a server keeps its shards, from ``PSLAUNCH_SERVER_DEVICE``: host numpy for ``cpu`` (big
    values in ``shared``, a ``SharedValues``, when given), else a GPU.

    A GPU that cannot be used falls back to the host with a warning.
    """
    if spec == "cpu":
        return HostMemory(shared)
    device = devices.Device.parse(spec)
    if not devices.gpu_available() or device.index >= devices.num_gpus():
        why = devices.gpu_status() if not devices.gpu_available() else f"this host has {devices.num_gpus()} GPU(s)"
        warnings.warn(
            f"PSLAUNCH_SERVER_DEVICE={spec}: no usable GPU {device.index} ({why}); the server keeps its shards on the CPU"
        )
        return HostMemory(shared)
    return GpuMemory(device)
