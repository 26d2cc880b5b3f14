"""Collectives between the workers of a job: what the ``allreduce`` store, the Trainer and the
PyTorch adapter use, and what training code may call itself.

    from kvcore import collectives as C

    C.allreduce(grad)                        # summed over every worker, in place; returns grad
    C.allreduce([g1, g2, g3])                # several arrays: small ones travel fused
    C.allreduce(grad, average=True)          # the mean instead of the sum (floats)
    handle = C.allreduce(grad, wait=False)   # a Handle; grad must stay untouched until it is done
    rows = C.allgather(x)                    # shape (num_workers,) + x.shape
    C.broadcast(w, root=0)                   # worker 0's w into every worker's w, in place
    C.broadcast_parameters(model)            # a torch module, a dict of arrays, Trainer parameters
    C.barrier()

The first call joins the job the environment describes (``kvcore.runtime``: one worker node per
process, shared with the stores), in a job with or without servers
(``pslaunch -n N -s 0`` starts one without).

**Order.** Every worker must run the same collectives. Without ``key`` they are matched by call
order (as torch.distributed does); with ``key`` (a str, int or tuple) by key and by how many
collectives of that key each worker ran before, so workers may run keyed collectives in different
orders (asynchronous pushes with priorities do) and still meet. Collectives of one key run one at
a time on each worker, in call order.

**Arrays.** numpy or CuPy (summed with NCCL between GPUs, through the host without it);
C-contiguous writable arrays are summed in place without copies, others through a copy.

**Shared arrays.** ``C.shared_empty(shape, dtype)`` gives a numpy array that lives in shared
memory. Between the workers of one host an allreduce of such an array is summed where it lies:
the other workers read it and write nothing into it, so the copies into and out of the job's own
regions are gone (for 2 workers about 60 % of the memory traffic is left). Anywhere else it is an
ordinary array. Allocate it once and reuse it: its memory stays with the process until it ends
(arrays are cut from shared regions of 64 MiB, so that a model of many tensors does not take a
file descriptor per array).
An allreduce of a shared array completes once the other workers of its host have read it.

**Errors** (``kvcore.errors``): a worker that died or was stopped makes every other worker's
collective fail with ``NodeDiedError`` naming it, within the heartbeat timeout; workers that pass
one collective different shapes or dtypes all raise ``WorkerMismatchError`` naming both.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import runtime
from .worker_collectives import Collectives

__all__ = ["Collectives", "group", "allreduce", "allgather", "broadcast", "barrier", "broadcast_parameters",
           "rank", "num_workers", "local_rank", "shared_empty"]


def group() -> Collectives:
    """This process's collectives (joining the job on first use).

    Raises:
        DistributedError: the environment describes no job, or registration failed.
    """
    return runtime.collectives()


def allreduce(value: Any, out: Any = None, key: Any = None, average: bool = False, wait: bool = True) -> Any:
    """``group().allreduce(...)``: see ``Collectives.allreduce``."""
    return group().allreduce(value, out, key, average, wait)


def allgather(value: Any, key: Any = None) -> Any:
    """``group().allgather(...)``: see ``Collectives.allgather``."""
    return group().allgather(value, key)


def broadcast(value: Any, root: int = 0, key: Any = None, wait: bool = True) -> Any:
    """``group().broadcast(...)``: see ``Collectives.broadcast``."""
    return group().broadcast(value, root, key, wait)


def barrier() -> None:
    """``group().barrier()``."""
    group().barrier()


def broadcast_parameters(params: Any, root: int = 0) -> None:
    """``group().broadcast_parameters(...)``: see ``Collectives.broadcast_parameters``."""
    group().broadcast_parameters(params, root)


def rank() -> int:
    """This worker's rank."""
    return group().rank


def num_workers() -> int:
    """Workers in the job."""
    return group().num_workers


def local_rank() -> int:
    """This worker's index among the workers on its host."""
    return group().local_rank


def shared_empty(shape: Any, dtype: Any = np.float32) -> np.ndarray:
    """``group().shared_empty(...)``: see ``Collectives.shared_empty``."""
    return group().shared_empty(shape, dtype)
