"""The array backend: numpy on the CPU, CuPy on GPUs.

This is the only module of the project that imports ``cupy``, and it does so lazily, the first time
a GPU question is asked; ``kvcore.arrays`` re-exports it for training code. CuPy is used only when
it imports *and* ``cupy.is_available()`` says a driver and a device are usable: a CuPy wheel on a
machine without a GPU must not crash anything, so every failure there means "no GPU" and numpy
serves.

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
    "current_device",
    "new_stream",
    "stream_context",
    "record_event",
    "wait_event",
    "synchronize_stream",
    "pinned_empty",
    "peer_copy",
    "nccl_available",
    "NcclGroup",
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
    """A context manager that makes ``device`` current in this thread.

    For a GPU it makes the CUDA device current; for the CPU it changes nothing on the hardware.
    Either way ``current_device()`` answers ``device`` inside it, so code that runs on behalf of a
    device (a shared-model callback, say) can ask where it is.
    """
    return _DeviceScope(device)


_thread_state = threading.local()


def current_device() -> Device:
    """The device made current by the innermost ``device_context`` of this thread (CPU outside any)."""
    stack = getattr(_thread_state, "devices", None)
    return stack[-1] if stack else Device("cpu", 0)


class _DeviceScope:
    def __init__(self, device: Device) -> None:
        self.device = device
        self._cuda_device: Any = None

    def __enter__(self) -> None:
        if self.device.is_gpu:
            self._cuda_device = _require_gpu(self.device).cuda.Device(self.device.index)
            self._cuda_device.__enter__()
        stack = getattr(_thread_state, "devices", None)
        if stack is None:
            stack = _thread_state.devices = []
        stack.append(self.device)
        return None

    def __exit__(self, *exc: object) -> None:
        _thread_state.devices.pop()
        if self._cuda_device is not None:
            self._cuda_device.__exit__(*exc)
            self._cuda_device = None


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
        if dst.flags.c_contiguous and src.flags.c_contiguous and dst.dtype == src.dtype:
            src.get(out=dst)  # straight into dst: no temporary host array (dst may be pinned)
        else:
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


# ---- streams, events, pinned host memory and NCCL (used by kvcore.shared_model) ----------------
# These helpers keep every CUDA detail in this module. On the CPU they are no-ops or plain numpy,
# so callers need no "if gpu" branches of their own.


def new_stream(device: Device) -> Any:
    """A new non-blocking CUDA stream on ``device`` (None for the CPU).

    Communication threads use their own stream so that their copies do not queue behind the
    compute kernels of the default stream.
    """
    if not device.is_gpu:
        return None
    cp = _require_gpu(device)
    with cp.cuda.Device(device.index):
        return cp.cuda.Stream(non_blocking=True)


def stream_context(stream: Any):
    """Make ``stream`` (from ``new_stream``) current in this thread; a no-op for None."""
    return _NullContext() if stream is None else stream


def record_event(array: Any) -> Any:
    """Record an event on the current stream of the device that holds ``array`` (None on the CPU).

    Another thread passes it to ``wait_event`` so that its stream waits for the work queued so far
    (the kernels that produced ``array``) without blocking the host.
    """
    cp = cupy_module()
    if cp is None or not isinstance(array, cp.ndarray):
        return None
    with cp.cuda.Device(array.device.id):
        event = cp.cuda.Event(disable_timing=True)
        event.record()
        return event


def wait_event(event: Any) -> None:
    """Make the current stream wait for ``event`` (from ``record_event``); a no-op for None."""
    if event is not None:
        cupy_module().cuda.get_current_stream().wait_event(event)


def synchronize_stream(device: Device) -> None:
    """Block until the current stream of this thread on ``device`` has finished its work."""
    if device.is_gpu:
        cp = _require_gpu(device)
        with cp.cuda.Device(device.index):
            cp.cuda.get_current_stream().synchronize()


def pinned_empty(shape: Any, dtype: Any = np.float32) -> np.ndarray:
    """A host array in page-locked (pinned) memory when CuPy is usable, else a plain numpy array.

    Pinned memory lets host<->GPU copies run at full bus speed; it is scarce, so callers allocate
    it once and reuse it.
    """
    dtype = np.dtype(dtype)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    count = int(np.prod(shape, dtype=np.int64))
    cp = cupy_module()
    if cp is None or count == 0:
        return np.empty(shape, dtype=dtype)
    memory = cp.cuda.alloc_pinned_memory(count * dtype.itemsize)
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


def peer_copy(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst``, both contiguous GPU arrays of one size, possibly on two GPUs.

    Queued on the current stream as a raw device-to-device (peer) copy, which needs no kernel on
    either device; call ``synchronize_stream`` before relying on ``dst``. Anything else (host
    arrays, other dtypes or layouts) goes through ``copy_into``, which completes before it returns.
    """
    cp = cupy_module()
    if (
        cp is None
        or not isinstance(dst, cp.ndarray)
        or not isinstance(src, cp.ndarray)
        or dst.nbytes != src.nbytes
        or dst.dtype != src.dtype
        or not (dst.flags.c_contiguous and src.flags.c_contiguous)
    ):
        copy_into(dst, src)
        return
    # cudaMemcpy with unified addressing moves the bytes between any two GPUs; the copy is queued on
    # the caller's current stream so that it orders with the caller's other work.
    dst.data.copy_from_device_async(src.data, src.nbytes, cp.cuda.get_current_stream())


_NCCL_TYPES = {
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "int64": "NCCL_INT64",
}


def _nccl_module() -> ModuleType | None:
    if cupy_module() is None:
        return None
    try:
        from cupy.cuda import nccl
    except Exception:  # CuPy built without NCCL, or libnccl missing
        return None
    return nccl if getattr(nccl, "available", True) else None


def nccl_available() -> bool:
    """True when CuPy's NCCL binding is usable (it needs a GPU and libnccl)."""
    return _nccl_module() is not None


class NcclGroup:
    """One NCCL communicator per GPU of this process, for in-process all-reduce.

    ``allreduce_sum(buffers)`` takes one contiguous array per GPU, in the order of the GPU indices
    given here, and leaves the element-wise sum in every one of them. Each GPU works on a stream of
    its own; the call returns once every GPU has the result.

    Not thread-safe: one thread at a time may run a collective on a group.
    """

    def __init__(self, device_indices: list[int]) -> None:
        nccl = _nccl_module()
        if nccl is None:
            raise RuntimeError("NCCL is not usable here (no GPU, or CuPy was built without NCCL)")
        cp = cupy_module()
        self._nccl = nccl
        self.device_indices = list(device_indices)
        self._comms = nccl.NcclCommunicator.initAll(self.device_indices)
        self._streams = []
        for index in self.device_indices:
            with cp.cuda.Device(index):
                self._streams.append(cp.cuda.Stream(non_blocking=True))

    def allreduce_sum(self, buffers: list[Any]) -> None:
        """Sum ``buffers`` (one per GPU, same shape and dtype) in place on every GPU."""
        cp = cupy_module()
        nccl = self._nccl
        if len(buffers) != len(self._comms):
            raise ValueError(f"NCCL group has {len(self._comms)} GPUs, got {len(buffers)} buffers")
        name = _NCCL_TYPES.get(np.dtype(buffers[0].dtype).name)
        if name is None:
            raise TypeError(f"NCCL cannot reduce dtype {buffers[0].dtype}; use one of {sorted(_NCCL_TYPES)}")
        datatype = getattr(nccl, name)
        nccl.groupStart()
        try:
            for comm, stream, buf, index in zip(self._comms, self._streams, buffers, self.device_indices):
                with cp.cuda.Device(index):
                    comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, datatype, nccl.NCCL_SUM, stream.ptr)
        finally:
            nccl.groupEnd()
        for stream, index in zip(self._streams, self.device_indices):
            with cp.cuda.Device(index):
                stream.synchronize()

    def close(self) -> None:
        """Release the communicators."""
        for comm in self._comms:
            try:
                comm.destroy()
            except Exception:  # already gone; nothing left to free
                pass
        self._comms = []
