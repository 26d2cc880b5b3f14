"""kvcore: what training code imports.

``kvcore.create(name)`` returns a KVStore with MXNet's semantics (``local``, ``device``; the
distributed stores ``dist_*`` keep values on servers, ``allreduce`` sums among the workers of a job
without servers). ``kvcore.collectives`` holds the workers' collectives (allreduce, allgather,
broadcast, barrier, broadcast_parameters), imported on first use. ``kvcore.optim`` holds the optimizers,
``kvcore.arrays`` the numpy/CuPy array backend and device helpers, ``kvcore.compression`` MXNet's
2bit/1bit gradient compression (``kv.set_gradient_compression``). ``kvcore.shared_model`` holds the
mshadow-ps style asynchronous shared model (``create_shared_model``), ``kvcore.elastic`` the
checkpoints a training script resumes from (``State``).
"""

from . import arrays, compression, elastic, optim
from .arrays import Device, cpu, gpu, num_gpus
from .dataparallel import SplitSampler, split_and_load
from .errors import (
    CheckpointError,
    CompressionError,
    DistributedError,
    DistTimeoutError,
    DTypeMismatchError,
    DuplicateKeyError,
    EnvContractError,
    KeyTypeError,
    KVStoreError,
    KVTimeoutError,
    NodeDiedError,
    OptimizerError,
    ServerError,
    OutShapeError,
    ShapeMismatchError,
    UninitializedKeyError,
    UnknownStoreError,
    ValueCountError,
    WorkerMismatchError,
)
from .handles import Handle, wait_all
from .registry import create, register_store, store_names
from .sparse import RowSparseArray
from .store_base import KVStoreBase
from .trainer import Parameter, Trainer
from . import shared_model
from .shared_model import ModelUpdater, SharedModel, create_shared_model

__all__ = [
    "arrays",
    "compression",
    "elastic",
    "optim",
    "Device",
    "cpu",
    "gpu",
    "num_gpus",
    "create",
    "register_store",
    "store_names",
    "KVStoreBase",
    "Handle",
    "KVTimeoutError",
    "wait_all",
    "RowSparseArray",
    "KVStoreError",
    "UnknownStoreError",
    "WorkerMismatchError",
    "KeyTypeError",
    "DuplicateKeyError",
    "UninitializedKeyError",
    "ShapeMismatchError",
    "OutShapeError",
    "DTypeMismatchError",
    "ValueCountError",
    "OptimizerError",
    "CheckpointError",
    "CompressionError",
    "DistributedError",
    "EnvContractError",
    "NodeDiedError",
    "ServerError",
    "DistTimeoutError",
    "split_and_load",
    "SplitSampler",
    "Trainer",
    "Parameter",
    "shared_model",
    "SharedModel",
    "create_shared_model",
    "ModelUpdater",
]



def __getattr__(name: str):
    # ``kvcore.collectives`` joins a job when used: import it (and the runtime) only when asked for
    if name == "collectives":
        import importlib

        return importlib.import_module(".collectives", __name__)
    raise AttributeError(f"module 'kvcore' has no attribute {name!r}")


from ._role import run_role_if_asked as _run_role_if_asked, take_job_key as _take_job_key  # noqa: E402

_take_job_key()  # PSLAUNCH_JOB_KEY leaves the environment before user code runs (docs/env.md)
_run_role_if_asked()  # DMLC_ROLE=scheduler|server: run that node and exit (MXNet's rule)
