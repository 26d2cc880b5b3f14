"""The array backend: numpy on the CPU, CuPy on GPUs.

This is the only module of the project that imports ``cupy``, and it does so lazily, the first time
a GPU question is asked. CuPy is used only when it imports *and* ``cupy.is_available()`` says a
driver and a device are usable: a CuPy wheel on a machine without a GPU must not crash anything, so
every failure there means "no GPU" and numpy serves.

Devices follow MXNet's spelling: ``cpu()``, ``gpu(i)``, ``num_gpus()``. Arrays are plain
``numpy.ndarray`` or ``cupy.ndarray``; ``device_of`` tells where one lives, ``to_device`` places a
copy on a device, ``copy_into`` copies between devices into an existing array.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "Device",
    "cpu",
    "gpu",
    "num_gpus",
    "gpu_available",
    "cupy_module",
    "is_array",
    "array_module",
    "device_of",
    "to_device",
    "copy_into",
    "asnumpy",
    "zeros",
    "empty",
    "device_context",
]

_probe_lock = threading.Lock()
_probed = False
_cupy: ModuleType | None = None


def cupy_module() -> ModuleType | None:
    """Return the ``cupy`` module when it is installed and usable, else ``None``.

    The probe runs once; its answer is cached. Any exception while importing or probing CuPy
    (no driver, no device, a broken install) counts as "not usable".
    """
    global _probed, _cupy
    if _probed:
        return _cupy
    with _probe_lock:
        if not _probed:
            _cupy = _probe_cupy()
            _probed = True
    return _cupy


def _probe_cupy() -> ModuleType | None:
    try:
        import cupy  # the project's single cupy import
    except Exception:  # ImportError, or a CUDA library that fails to load
        return None
    try:
        if not cupy.is_available():
            return None
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:
        return None
    return cupy


def gpu_available() -> bool:
    """True when CuPy is installed and at least one GPU is usable."""
    return cupy_module() is not None


def num_gpus() -> int:
    """Number of usable GPUs (0 without a working CuPy)."""
    cp = cupy_module()
    if cp is None:
        return 0
    return int(cp.cuda.runtime.getDeviceCount())


@dataclass(frozen=True)
class Device:
    """Where an array lives: ``Device('cpu', 0)`` or ``Device('gpu', i)``."""

    kind: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "gpu"):
            raise ValueError(f"device kind must be 'cpu' or 'gpu', got {self.kind!r}")
        if self.index < 0:
            raise ValueError(f"device index must be >= 0, got {self.index}")

    @property
    def is_gpu(self) -> bool:
        """True for a GPU device."""
        return self.kind == "gpu"

    def __str__(self) -> str:
        return f"{self.kind}({self.index})"

    @classmethod
    def parse(cls, text: str) -> "Device":
        """Parse ``cpu``, ``gpu``, ``gpu:1`` or ``gpu(1)`` into a Device."""
        spec = text.strip().lower().replace("(", ":").rstrip(")")
        kind, _, index = spec.partition(":")
        try:
            return cls(kind, int(index) if index else 0)
        except ValueError as exc:
            raise ValueError(f"cannot parse device {text!r}: expected cpu, gpu or gpu:N") from exc


def cpu(index: int = 0) -> Device:
    """The host CPU (MXNet's ``mx.cpu()``); the index is accepted for symmetry and ignored."""
    del index  # one host CPU; MXNet accepts cpu(i) and treats every i alike
    return Device("cpu", 0)


def gpu(index: int = 0) -> Device:
    """GPU number ``index`` (MXNet's ``mx.gpu(i)``). Using it without a GPU raises at placement."""
    return Device("gpu", index)


def is_array(value: Any) -> bool:
    """True for a numpy array, or a CuPy array when CuPy is usable."""
    if isinstance(value, np.ndarray):
        return True
    cp = cupy_module()
    return cp is not None and isinstance(value, cp.ndarray)


def array_module(array: Any) -> ModuleType:
    """``numpy`` or ``cupy``: the module whose functions operate on ``array`` where it lives."""
    cp = cupy_module()
    if cp is not None and isinstance(array, cp.ndarray):
        return cp
    return np


def device_of(array: Any) -> Device:
    """The device that holds ``array``."""
    cp = cupy_module()
    if cp is not None and isinstance(array, cp.ndarray):
        return Device("gpu", int(array.device.id))
    return Device("cpu", 0)


def _require_gpu(device: Device) -> ModuleType:
    cp = cupy_module()
    if cp is None:
        raise RuntimeError(
            f"device {device} was asked for, but no usable GPU was found "
            "(CuPy is not installed or cupy.is_available() is False)"
        )
    count = num_gpus()
    if device.index >= count:
        raise RuntimeError(f"device {device} was asked for, but only {count} GPU(s) are present")
    return cp


def device_context(device: Device):
    """A context manager that makes ``device`` current (a no-op for the CPU)."""
    if device.is_gpu:
        return _require_gpu(device).cuda.Device(device.index)
    return _NullContext()


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def to_device(array: Any, device: Device, copy: bool = False) -> Any:
    """Return ``array`` on ``device``; the same object when it already lives there and ``copy`` is False."""
    if device_of(array) == device and not copy:
        return array
    if not device.is_gpu:
        cp = cupy_module()
        if cp is not None and isinstance(array, cp.ndarray):
            return cp.asnumpy(array)
        return np.array(array, copy=True)
    cp = _require_gpu(device)
    with cp.cuda.Device(device.index):
        return cp.array(array, copy=True)


def asnumpy(array: Any) -> np.ndarray:
    """A numpy view or copy of ``array`` (copied to the host when it lives on a GPU)."""
    cp = cupy_module()
    if cp is not None and isinstance(array, cp.ndarray):
        return cp.asnumpy(array)
    return np.asarray(array)


def copy_into(dst: Any, src: Any) -> None:
    """Copy ``src`` into the existing array ``dst`` in place, across devices when needed.

    Shapes must match exactly; the dtype of ``dst`` is kept (values are cast).
    """
    if dst.shape != src.shape:
        raise ValueError(f"cannot copy an array of shape {src.shape} into one of shape {dst.shape}")
    dst_dev, src_dev = device_of(dst), device_of(src)
    if dst_dev == src_dev:
        if dst_dev.is_gpu:
            with array_module(dst).cuda.Device(dst_dev.index):
                dst[...] = src
        else:
            np.copyto(dst, src, casting="unsafe")
        return
    if not dst_dev.is_gpu:  # GPU -> host
        np.copyto(dst, asnumpy(src), casting="unsafe")
        return
    cp = _require_gpu(dst_dev)
    with cp.cuda.Device(dst_dev.index):
        if src_dev.is_gpu:  # peer copy, GPU -> GPU
            dst[...] = cp.asarray(src)
        else:
            dst.set(np.ascontiguousarray(src, dtype=dst.dtype))


def zeros(shape: Any, dtype: Any = np.float32, device: Device | None = None) -> Any:
    """An array of zeros on ``device`` (the CPU by default)."""
    device = device or cpu()
    if device.is_gpu:
        cp = _require_gpu(device)
        with cp.cuda.Device(device.index):
            return cp.zeros(shape, dtype=dtype)
    return np.zeros(shape, dtype=dtype)


def empty(shape: Any, dtype: Any = np.float32, device: Device | None = None) -> Any:
    """An uninitialised array on ``device`` (the CPU by default)."""
    device = device or cpu()
    if device.is_gpu:
        cp = _require_gpu(device)
        with cp.cuda.Device(device.index):
            return cp.empty(shape, dtype=dtype)
    return np.empty(shape, dtype=dtype)
