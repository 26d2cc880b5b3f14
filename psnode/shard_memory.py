"""Where a server keeps its shards: host memory (numpy) or a GPU (CuPy through ``psnode.devices``).

Both kinds offer the same few operations the round machine needs (place, load, add, a host view),
so ``ServerStore`` never asks which one it has. ``shard_memory(spec)`` picks one from
``PSLAUNCH_SERVER_DEVICE``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import numpy as np

from . import devices

__all__ = ["HostMemory", "GpuMemory", "shard_memory"]


class HostMemory:
    """Shards in host memory (numpy)."""

    name = "cpu"

    @staticmethod
    def place(array: np.ndarray) -> Any:
        return np.array(array, copy=True)

    @staticmethod
    def empty_like(array: Any) -> Any:
        return np.empty_like(array)

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

    def context(self):
        return contextlib.nullcontext()


class GpuMemory:
    """Shards on a GPU through ``psnode.devices`` (CuPy)."""

    def __init__(self, device: devices.Device) -> None:
        self.device = device
        self.name = str(device)

    def place(self, array: np.ndarray) -> Any:
        return devices.to_device(array, self.device, copy=True)

    def empty_like(self, array: Any) -> Any:
        return devices.empty(array.shape, array.dtype, self.device)

    def load(self, dst: Any, src: np.ndarray) -> None:
        devices.copy_into(dst, src.reshape(dst.shape))

    def add(self, dst: Any, src: np.ndarray) -> None:
        with devices.device_context(self.device):
            dst += devices.to_device(src.reshape(dst.shape), self.device)

    def add2(self, dst: Any, a: np.ndarray, b: np.ndarray) -> None:
        self.load(dst, a)
        self.add(dst, b)

    def host(self, array: Any) -> np.ndarray:
        return devices.asnumpy(array)

    def context(self):
        return devices.device_context(self.device)


def shard_memory(spec: str) -> Any:
    """Where a server keeps its shards, from ``PSLAUNCH_SERVER_DEVICE``: host numpy for ``cpu``, else a GPU.

    A GPU that cannot be used falls back to the host with a warning.
    """
    if spec == "cpu":
        return HostMemory()
    device = devices.Device.parse(spec)
    if not devices.gpu_available() or device.index >= devices.num_gpus():
        warnings.warn(f"PSLAUNCH_SERVER_DEVICE={spec}: no usable GPU {device.index}; the server keeps its shards on the CPU")
        return HostMemory()
    return GpuMemory(device)
