"""All-reduce with NCCL (through CuPy's binding): across this process's GPUs, or across processes.

``NcclGroup(gpus)`` holds one communicator per GPU; ``allreduce_sum(buffers)`` leaves the sum of
one buffer per GPU in every one of them. ``NcclGroup.joined(gpu, unique_id, nranks, rank)`` holds
this process's one communicator of a group of ``nranks`` processes (the workers of an allreduce
job, ``psnode.collectives.nccl``), which agreed on ``unique_id`` beforehand. NCCL forbids two threads from running operations on one
communicator at once, and every GPU of a group must see the group's collectives in the same order:
two threads interleaving their launches can leave each GPU waiting in a different collective, a
deadlock of the kernels that no timeout ends. So a group runs one collective at a time, under its
own lock, and callers from any thread may share it.

``nccl_supports(dtype)`` tells which dtypes NCCL reduces; callers sum the others without NCCL.
CuPy finds libnccl in the ``nvidia-nccl-cu12`` wheel that the ``gpu`` extra installs.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from psnode import devices

__all__ = ["NcclGroup", "nccl_available", "nccl_supports"]

# numpy dtype name -> the binding's ncclDataType_t name (NCCL has no bool, int16, uint16 or complex)
_NCCL_TYPES = {
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
}


def nccl_available() -> bool:
    """True when CuPy's NCCL binding is usable (it needs a working GPU and libnccl)."""
    return devices.nccl_module() is not None


def nccl_supports(dtype: Any) -> bool:
    """True when NCCL can all-reduce arrays of ``dtype``."""
    return np.dtype(dtype).name in _NCCL_TYPES


class NcclGroup:
    """One NCCL communicator per GPU of this process, for in-process all-reduce.

    Thread-safe: collectives on one group run one at a time (see the module docstring).

    Raises:
        RuntimeError: NCCL is not usable here, or it could not create the communicators (the
            message names the GPUs and NCCL's error).
    """

    def __init__(self, device_indices: list[int], _join: tuple[Any, int, int] | None = None) -> None:
        nccl = devices.nccl_module()
        if nccl is None:
            raise RuntimeError(
                f"NCCL is not usable here: {devices.gpu_status()}; or libnccl is missing "
                "(pip install 'pslaunch[gpu]' installs nvidia-nccl-cu12)"
            )
        cp = devices.cupy_module()
        self._nccl = nccl
        self.device_indices = [int(i) for i in device_indices]
        try:
            if _join is None:
                self._comms = nccl.NcclCommunicator.initAll(self.device_indices)
            else:  # blocks until every process of the group joined
                unique_id, nranks, rank = _join
                with cp.cuda.Device(self.device_indices[0]):
                    self._comms = [nccl.NcclCommunicator(nranks, unique_id, rank)]
        except Exception as exc:
            raise RuntimeError(
                f"NCCL could not create communicators for GPUs {self.device_indices}: {type(exc).__name__}: {exc}"
            ) from exc
        self._streams = []
        for index in self.device_indices:
            with cp.cuda.Device(index):
                self._streams.append(cp.cuda.Stream(non_blocking=True))
        self._lock = threading.Lock()
        self.allreduces = 0
        """How many all-reduces the group ran (callers report whether NCCL was used)."""

    @classmethod
    def joined(cls, device_index: int, unique_id: Any, nranks: int, rank: int) -> "NcclGroup":
        """This process's communicator on GPU ``device_index`` of a group of ``nranks`` processes that
        agreed on ``unique_id`` (``nccl.get_unique_id()`` of one of them); blocks until all joined.

        Raises:
            RuntimeError: as the constructor.
        """
        return cls([device_index], (unique_id, nranks, rank))

    def abort(self) -> None:
        """Abort the communicators: a collective that waits for a process that will never join ends
        (NCCL's ``ncclCommAbort``); the group is closed."""
        for comm in self._comms:
            try:
                comm.abort()
            except Exception:  # already gone
                pass
        self._comms = []

    def allreduce_sum(self, buffers: list[Any]) -> None:
        """Sum ``buffers`` (one per GPU, in the group's GPU order) in place on every GPU.

        Each buffer must be a contiguous CuPy array on its GPU; all of one shape and dtype; and it
        must hold its values already (the work that wrote it has finished, as after
        ``devices.synchronize_stream``): each GPU reduces on a stream of the group's own, which
        waits for no other stream, so that a GPU's default stream full of training kernels cannot
        hold the sum up. Blocks until every GPU holds the sum.

        Raises:
            ValueError: a wrong number of buffers, a buffer on the wrong GPU, non-contiguous, or
                of another shape. TypeError: a dtype NCCL cannot reduce (see ``nccl_supports``).
            RuntimeError: the group was closed; NCCL's own errors.
        """
        self._check(buffers)
        cp = devices.cupy_module()
        nccl = self._nccl
        datatype = getattr(nccl, _NCCL_TYPES[np.dtype(buffers[0].dtype).name])
        with self._lock:
            if not self._comms:
                raise RuntimeError(f"the NCCL group of GPUs {self.device_indices} was closed")
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
            self.allreduces += 1

    def _check(self, buffers: list[Any]) -> None:
        if len(buffers) != len(self.device_indices):
            raise ValueError(f"the NCCL group has {len(self.device_indices)} GPUs, got {len(buffers)} buffers")
        first = buffers[0]
        if not nccl_supports(first.dtype):
            raise TypeError(f"NCCL cannot reduce dtype {first.dtype}; it reduces {', '.join(_NCCL_TYPES)}")
        for i, (buf, index) in enumerate(zip(buffers, self.device_indices)):
            where = devices.device_of(buf)
            if where != devices.gpu(index):
                raise ValueError(f"buffer {i} of the NCCL all-reduce lives on {where}, not on gpu({index})")
            if not buf.flags.c_contiguous:
                raise ValueError(f"buffer {i} of the NCCL all-reduce is not contiguous")
            if buf.shape != first.shape or buf.dtype != first.dtype:
                raise ValueError(
                    f"buffer {i} of the NCCL all-reduce has shape {buf.shape} and dtype {buf.dtype}; "
                    f"buffer 0 has shape {first.shape} and dtype {first.dtype}"
                )

    def close(self) -> None:
        """Release the communicators; waits for a collective that is running. Idempotent."""
        with self._lock:
            for comm in self._comms:
                try:
                    comm.destroy()
                except Exception:  # already gone; nothing left to free
                    pass
            self._comms = []
