"""The numpy/CuPy array backend, as kvcore's users know it: ``kvcore.arrays``.

It lives in ``psnode.devices`` (and the NCCL group in ``psnode.nccl_group``), at the bottom of the
house, because the runtime's servers keep shards on GPUs through it too; kvcore re-exports it
unchanged. ``psnode.devices`` is the only module of the project that imports ``cupy``.
"""

from psnode.devices import (
    Device,
    cpu,
    gpu,
    num_gpus,
    gpu_available,
    gpu_status,
    GpuUnavailableWarning,
    cupy_module,
    is_array,
    array_module,
    device_of,
    to_device,
    copy_into,
    asnumpy,
    zeros,
    empty,
    device_context,
    current_device,
    new_stream,
    stream_context,
    record_event,
    wait_event,
    synchronize_stream,
    pinned_empty,
    peer_copy,
)
from psnode.nccl_group import NcclGroup, nccl_available, nccl_supports

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
