"""The array backend: numpy on the CPU, CuPy on GPUs.

This is the only module of the project that imports ``cupy``, and it does so lazily, the first time
a GPU question is asked; ``kvcore.arrays`` re-exports it for training code. CuPy is used only when
it imports, sees a GPU *and* runs a tiny kernel on every GPU with the right answer (an elementwise
add and a reduction, which need the driver and NVRTC). Anything less means numpy, and
``gpu_status()`` says why in one line; when CuPy is installed but fails, that line is also given
once as a ``GpuUnavailableWarning``.

Devices follow MXNet's spelling: ``cpu()``, ``gpu(i)``, ``num_gpus()``. Arrays are plain
``numpy.ndarray`` or ``cupy.ndarray``; ``device_of`` tells where one lives, ``to_device`` places a
copy on a device, ``copy_into`` copies between devices into an existing array.

Streams: CuPy queues kernels and copies on the current stream of the current device, per thread.
Helpers that move data between threads (``record_event`` / ``wait_event``) order work across
streams; ``copy_into`` always completes before it returns.
"""

from __future__ import annotations

import threading
import warnings
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
    "gpu_status",
    "GpuUnavailableWarning",
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
    "nccl_module",
]

_probe_lock = threading.Lock()
_probed = False
_cupy: ModuleType | None = None
_gpu_count = 0
_status = "not probed yet"

# The probe's kernels: 2 * (0 + 1 + ... + 1023) is exact in float32.
_PROBE_SIZE = 1024
_PROBE_SUM = float(_PROBE_SIZE * (_PROBE_SIZE - 1))


class GpuUnavailableWarning(RuntimeWarning):
    """CuPy is installed but cannot run here, so numpy serves; the message says why."""


def cupy_module() -> ModuleType | None:
    """Return the ``cupy`` module when it is installed and usable, else ``None``.

    The probe runs once per process; its answer is cached. Any exception while importing CuPy,
    counting devices or running the probe's kernels counts as "not usable" (``gpu_status()``
    says which).
    """
    global _probed, _cupy, _gpu_count, _status
    if _probed:
        return _cupy
    with _probe_lock:
        if not _probed:
            _cupy, _gpu_count, _status, installed = _probe_cupy()
            _probed = True
            if _cupy is None and installed:
                warnings.warn(f"the GPU is not used: {_status}", GpuUnavailableWarning, stacklevel=3)
    return _cupy


def gpu_status() -> str:
    """One line on the probe's answer: which CuPy and how many GPUs, or why numpy serves."""
    cupy_module()
    return _status


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def _probe_cupy() -> tuple[ModuleType | None, int, str, bool]:
    """(cupy or None, GPU count, one line saying what was found, whether CuPy is installed)."""
    try:
        import cupy  # the project's single cupy import
    except ImportError as exc:
        if getattr(exc, "name", None) == "cupy":
            return None, 0, "CuPy is not installed (pip install 'pslaunch[gpu]')", False
        return None, 0, f"CuPy is installed but does not import: {_one_line(exc)}", True
    except Exception as exc:  # a CUDA library that fails to load while importing
        return None, 0, f"CuPy is installed but does not import: {_one_line(exc)}", True
    version = f"CuPy {getattr(cupy, '__version__', '?')}"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, or a driver older than CuPy's CUDA
        return None, 0, f"{version} finds no usable CUDA driver: {_one_line(exc)}", True
    if count < 1:
        return None, 0, f"{version} sees no GPU", True
    for index in range(count):
        try:
            with cupy.cuda.Device(index):
                values = cupy.arange(_PROBE_SIZE, dtype=cupy.float32)
                total = float((values + values).sum())  # NVRTC compiles both kernels on first use
        except Exception as exc:  # NVRTC or another CUDA library missing, a broken device
            return None, 0, f"{version} cannot run a kernel on GPU {index}: {_one_line(exc)}", True
        if total != _PROBE_SUM:
            return None, 0, f"{version} computed {total!r} instead of {_PROBE_SUM!r} on GPU {index}", True
    return cupy, count, f"{version} runs kernels on {count} GPU(s)", True


def gpu_available() -> bool:
    """True when CuPy is installed and at least one GPU runs kernels correctly."""
    return cupy_module() is not None


def num_gpus() -> int:
    """Number of usable GPUs (0 without a working CuPy)."""
    return _gpu_count if cupy_module() is not None else 0


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
    """Return ``array`` on ``device``; the same object when it already lives there and ``copy`` is False.

    The copy is ordered after the work this thread queued on ``array``'s GPU so far. From the host
    or onto the host it is queued on this thread's current stream (host results are complete);
    between two GPUs it has completed when the call returns (CuPy's own cross-device copy does not
    wait for the source GPU's streams).
    """
    if device_of(array) == device and not copy:
        return array
    if not device.is_gpu:
        cp = cupy_module()
        if cp is not None and isinstance(array, cp.ndarray):
            return asnumpy(array)
        return np.array(array, copy=True)
    cp = _require_gpu(device)
    source = device_of(array)
    with cp.cuda.Device(device.index):
        if source.is_gpu and source != device:
            placed = cp.empty(array.shape, array.dtype)
            _from_peer(cp, array, placed, cp.cuda.get_current_stream())
            return placed
        return cp.array(array, copy=True)


def asnumpy(array: Any) -> np.ndarray:
    """A numpy view or copy of ``array`` (copied to the host when it lives on a GPU, after the work
    this thread queued on that GPU's current stream)."""
    cp = cupy_module()
    if cp is not None and isinstance(array, cp.ndarray):
        with cp.cuda.Device(array.device.id):  # CuPy's get() takes the current device's stream
            return cp.asnumpy(array)
    return np.asarray(array)


def copy_into(dst: Any, src: Any) -> None:
    """Copy ``src`` into the existing array ``dst`` in place, across devices when needed.

    Shapes must match exactly; the dtype of ``dst`` is kept (values are cast). Either array may be
    non-contiguous and on any device. Blocking: the copy has completed when the call returns, so
    ``src`` may be reused and ``dst`` read from any stream or thread at once. A copy that involves
    a GPU runs on this thread's current stream of that GPU, after the work already queued there;
    between two GPUs, on ``dst``'s, after the work queued on both GPUs' current streams.

    Raises:
        ValueError: the shapes differ (the message names both).
    """
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"cannot copy an array of shape {tuple(src.shape)} into one of shape {tuple(dst.shape)}")
    dst_dev, src_dev = device_of(dst), device_of(src)
    if not dst_dev.is_gpu and not src_dev.is_gpu:
        np.copyto(dst, src, casting="unsafe")
        return
    cp = cupy_module()
    if not dst_dev.is_gpu:  # GPU -> host
        with cp.cuda.Device(src_dev.index):
            stream = cp.cuda.get_current_stream()
            if dst.flags.c_contiguous and src.flags.c_contiguous and dst.dtype == src.dtype:
                src.get(stream=stream, out=dst)  # straight into dst (it may be pinned); blocking
            else:
                np.copyto(dst, src.get(stream=stream), casting="unsafe")
        return
    with cp.cuda.Device(dst_dev.index):
        stream = cp.cuda.get_current_stream()
        if not src_dev.is_gpu:  # host -> GPU: ndarray.set needs a contiguous destination
            host = np.ascontiguousarray(src, dtype=dst.dtype)
            staged = None if dst.flags.c_contiguous else cp.empty(dst.shape, dst.dtype)
            (dst if staged is None else staged).set(host, stream=stream)
        elif src_dev != dst_dev:  # GPU -> another GPU
            direct = dst.flags.c_contiguous and dst.dtype == src.dtype
            staged = _from_peer(cp, src, dst if direct else None, stream)
        else:
            staged = src
        if staged is not None:
            dst[...] = staged  # a kernel on this stream: any layout, casts the dtype
        # set() from pinned memory and peer copies are asynchronous: finish before returning
        stream.synchronize()


def _from_peer(cp: ModuleType, src: Any, out: Any, stream: Any) -> Any:
    """Copy GPU array ``src`` onto the current GPU, into ``out`` (contiguous, same dtype) when given.

    Returns the staged copy to assign from, or None when ``out`` received the bytes. The copy is a
    raw device-to-device transfer queued on ``stream`` after the work queued on ``src``'s GPU so far,
    so it needs neither a kernel reading peer memory nor peer access between the GPUs.
    """
    with cp.cuda.Device(src.device.id):
        source = cp.ascontiguousarray(src)
        ready = cp.cuda.Event(disable_timing=True)
        ready.record()
    target = out if out is not None else cp.empty(src.shape, src.dtype)
    stream.wait_event(ready)
    target.data.copy_from_device_async(source.data, source.nbytes, stream)
    # ``source`` may be a temporary whose memory the pool hands out again once this returns
    stream.synchronize()
    return None if out is not None else target


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


# ---- streams, events and pinned host memory (used by kvcore.shared_model) ----------------------
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

    Pinned memory lets host<->GPU copies run at full bus speed. It comes from CuPy's pinned memory
    pool, which takes a block back when the array is garbage-collected and hands it out again for
    the next request of that size, so asking for one per transfer costs no new page-locking.
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


def nccl_module() -> ModuleType | None:
    """CuPy's NCCL binding (``cupy.cuda.nccl``) when it and a GPU are usable, else None.

    ``psnode.devices.nccl`` builds on it; the import lives here, with the project's only other
    ``cupy`` import.
    """
    if cupy_module() is None:
        return None
    try:
        from cupy.cuda import nccl
    except Exception:  # CuPy built without NCCL
        return None
    # False when libnccl (the nvidia-nccl-cu12 wheel, or a system copy) could not be loaded
    return nccl if getattr(nccl, "available", True) else None
