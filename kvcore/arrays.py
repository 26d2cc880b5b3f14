"""The numpy/CuPy array backend, as kvcore's users know it: ``kvcore.arrays``.

It lives in ``psnode.devices`` (and the NCCL group in ``psnode.devices.nccl``), at the bottom of the
house, because the runtime's servers keep shards on GPUs through it too; kvcore re-exports it
unchanged. ``psnode.devices`` is the only module of the project that imports ``cupy``.
"""

from psnode.devices import (
    Device,
    GpuUnavailableWarning,
    array_module,
    asnumpy,
    copy_into,
    cpu,
    cupy_module,
    current_device,
    device_context,
    device_of,
    empty,
    gpu,
    gpu_available,
    gpu_status,
    is_array,
    new_stream,
    num_gpus,
    peer_copy,
    pinned_empty,
    record_event,
    stream_context,
    synchronize_stream,
    to_device,
    wait_event,
    zeros,
)
from psnode.devices.nccl import NcclGroup, nccl_available, nccl_supports

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
    "nccl_available",
    "nccl_supports",
    "NcclGroup",
]
