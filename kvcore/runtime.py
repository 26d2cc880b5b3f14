"""This process's worker node: the one place kvcore holds the link to the runtime (psnode).

A process joins its job once, as one worker (``psnode.worker.node.WorkerNode``). Every store, the
collectives and the Trainer reach that worker through this module:

- ``worker()``: the worker; on first use it joins the job the environment describes (docs/env.md).
- ``joined()``: the worker if this process (or thread, see ``use``) has one, without joining.
- ``collectives(worker)``: the collectives of a worker (one ``Collectives`` per worker).
- ``use(worker)``: a context in which the calling thread's stores and collectives use ``worker``
  instead: a test hands in the workers of ``testkit.InProcJob``, one per thread, and runs a whole
  job in one process.

Nothing else in kvcore keeps a worker in a global: a store keeps the worker it was made with.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

from psnode import errors as ps_errors
from psnode.env import read_env
from psnode.worker.node import WorkerNode

from .dist_errors import runtime_errors
from .errors import DistributedError
from .worker_collectives import Collectives

__all__ = ["worker", "joined", "num_servers", "collectives", "use"]

_lock = threading.Lock()
_process_worker: WorkerNode | None = None  # joined from the environment, once per process
_bound = threading.local()  # .worker: the worker a thread runs as inside use()
_collectives: "weakref.WeakKeyDictionary[WorkerNode, Collectives]" = weakref.WeakKeyDictionary()
_last: tuple[WorkerNode | None, "Collectives | None"] = (None, None)  # the pair asked for last


def joined() -> WorkerNode | None:
    """The worker the calling thread runs as (``use``), else this process's if it joined; None
    before either."""
    return getattr(_bound, "worker", None) or _process_worker


def worker() -> WorkerNode:
    """The worker the calling thread runs as: the one handed to ``use``, else this process's,
    which registers with the job on first use.

    Raises:
        DistributedError: the environment is incomplete, registration failed, or this process's
            worker already left the job (the message says why).
    """
    global _process_worker
    bound = getattr(_bound, "worker", None)
    if bound is not None:
        return bound
    joined_here = _process_worker  # every collective asks: no lock once joined
    if joined_here is not None and not joined_here.closed:
        return joined_here
    with _lock:
        if _process_worker is not None and _process_worker.closed:
            raise DistributedError(
                f"worker {_process_worker.rank} already left the job (close() was called or it aborted); "
                "a process joins a job once")
        if _process_worker is None:
            with runtime_errors():
                env = read_env(default_role="worker")
                if env.role != "worker":
                    raise ps_errors.EnvError(f"a KVStore is created by workers, but DMLC_ROLE={env.role}")
                _process_worker = WorkerNode(env).start().watch_process()
        return _process_worker


def num_servers() -> int:
    """The job's servers, without joining it: a store that needs servers refuses a job without
    them before it registers, so the other workers need not wait for this one.

    Raises:
        DistributedError: the environment is incomplete (naming the variable).
    """
    current = joined()
    if current is not None:
        return current.num_servers
    with runtime_errors():
        return read_env(default_role="worker").num_servers


def collectives(of: WorkerNode | None = None) -> Collectives:
    """The collectives of worker ``of`` (default: ``worker()``), made once per worker."""
    global _last
    node = of if of is not None else worker()
    last_node, last = _last
    if last_node is node:  # each module-level collective asks: answered without a lock or a lookup
        return last
    with _lock:
        found = _collectives.get(node)
        if found is None:
            found = _collectives[node] = Collectives(node)
        _last = (node, found)
        return found


@contextlib.contextmanager
def use(node: WorkerNode) -> Iterator[WorkerNode]:
    """Run the calling thread's kvcore code as worker ``node`` (a worker a test started): stores
    created and collectives called in the block use it. Restores what was there before on exit."""
    before = getattr(_bound, "worker", None)
    _bound.worker = node
    try:
        yield node
    finally:
        _bound.worker = before
