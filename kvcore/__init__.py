"""kvcore: what training code imports.

What a training script uses is imported from here (``__all__`` lists it):

- ``kvcore.create(name)``: a KVStore with MXNet's semantics (``local``, ``device``; the distributed
  stores ``dist_sync``, ``dist_async``, ``dist_device_sync`` keep values on servers, ``allreduce``
  sums among the workers of a job without servers); ``register_store`` adds one.
- ``Trainer`` and ``Parameter``: one optimizer step of data-parallel training through a store.
- the errors (``KVStoreError`` and the tree under it), ``Handle`` and ``wait_all``, ``RowSparseArray``,
  the devices (``cpu``, ``gpu``, ``num_gpus``) and the data helpers (``split_and_load``, ``SplitSampler``);
- ``create_shared_model`` and ``SharedModel``: mshadow-ps's asynchronous shared model.

and these modules: ``kvcore.collectives`` (allreduce, allgather, broadcast, barrier,
broadcast_parameters; imported on first use, it joins the job), ``kvcore.optim`` (the optimizers),
``kvcore.arrays`` (the numpy/CuPy array backend), ``kvcore.compression`` (2bit/1bit gradient
compression), ``kvcore.elastic`` (``State``: the checkpoints a script resumes from),
``kvcore.shared_model`` and ``kvcore.errors``. ``PUBLIC_MODULES`` names these and the modules of the names
above.

Everything else is kvcore's own and may change (``INTERNAL_MODULES``): the stores' implementations
(``kvcore.stores``: one module per store, key normalisation, placement of keys on servers), the link
to this process's worker node (``runtime``, ``worker_collectives``, ``node_handle``, ``dist_errors``),
the Trainer's parts (``parameters``, ``torch_adapter``, ``trainer_handoff``), a worker's own steps
out of the job (``leaving``: an elastic job's SIGTERM; ``preempting``: a preempted job's checkpoint)
and MXNet's start-as-any-role rule (``_role``).
"""

from . import arrays, compression, elastic, optim, shared_model
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
    OutShapeError,
    ReadOnlyOutError,
    ServerError,
    ShapeMismatchError,
    UninitializedKeyError,
    UnknownStoreError,
    ValueCountError,
    WorkerMismatchError,
)
from .handles import Handle, wait_all
from .shared_model import ModelUpdater, SharedModel, create_shared_model
from .sparse import RowSparseArray
from .stores.base import KVStoreBase
from .stores.registry import create, register_store, store_names
from .trainer import Parameter, Trainer

#: The modules training code imports (``import kvcore.collectives as C``, ``kvcore.elastic.State``).
PUBLIC_MODULES = ("arrays", "collectives", "compression", "dataparallel", "elastic", "errors", "handles", "optim",
                  "shared_model", "sparse", "trainer")
#: kvcore's own modules: what they hold is reached through the names above; they may change.
INTERNAL_MODULES = ("_role", "dist_errors", "node_handle", "parameters", "runtime", "torch_adapter", "trainer_handoff",
                    "worker_collectives", "stores", "leaving", "preempting")

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
    "ReadOnlyOutError",
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
