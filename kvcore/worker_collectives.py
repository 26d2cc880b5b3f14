"""The collectives of one worker node: what ``kvcore.collectives`` calls on this process's worker.

``Collectives(worker)`` wraps a worker's collective engine (``psnode.collectives``) with kvcore's
arrays, fusion of small arrays and errors. Training code uses the module functions of
``kvcore.collectives``; ``kvcore.runtime`` keeps one ``Collectives`` per worker.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Sequence

import numpy as np

from psnode.collectives.fusion import DEFAULT_LIMIT, FusionBuffer, plan
from psnode.collectives.tags import Label
from psnode.errors import PSNodeError
from psnode.node.futures import all_of, chain

from . import arrays
from .dist_errors import runtime_errors, translate
from .handles import Handle
from .node_handle import NodeHandle

__all__ = ["Collectives"]

_PLANS_KEPT = 64  # fusion plans remembered (layouts that come back every step); the oldest go when more come




class _Said:
    """``allreduce of key 'c'``: a collective in the words of the call that made it (the engine's key
    is this module's tuple), written only when an error or a stall warning needs it."""

    __slots__ = ("what", "key", "group", "groups")

    def __init__(self, what: str, key: Any = None, group: int = 0, groups: int = 1) -> None:
        self.what, self.key, self.group, self.groups = what, key, group, groups

    def __str__(self) -> str:
        text = f"{self.what} without a key" if self.key is None else str(Label(self.what, self.key))
        return text + (f" (fused group {self.group + 1} of {self.groups})" if self.groups > 1 else "")

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


class Collectives:
    """The collectives of one worker node (``group()`` gives this process's). Not thread-safe:
    call from one thread (the order of calls is what matches them across workers)."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._engine = worker.collectives
        self._fused: dict[tuple, FusionBuffer] = {}
        self._plans: dict[tuple, list[list[int]]] = {}  # (sizes, dtypes, limit) -> the fused groups

    # ---- facts -----------------------------------------------------------------------------------
    @property
    def worker(self) -> Any:
        """The worker node these collectives run on (``psnode.worker.node.WorkerNode``)."""
        return self._worker

    @property
    def rank(self) -> int:
        """This worker's rank, 0 .. num_workers-1."""
        return self._worker.rank

    @property
    def num_workers(self) -> int:
        """Workers in the job."""
        return self._worker.num_workers

    @property
    def local_rank(self) -> int:
        """This worker's index among the workers on its host (``PSLAUNCH_LOCAL_RANK``)."""
        return self._worker.env.local_rank

    # ---- the collectives ---------------------------------------------------------------------------
    def shared_empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """A new array of ``shape`` and ``dtype`` (uninitialised) in shared memory: see the module docstring.

        Raises:
            TypeError: ``dtype`` is not a dtype; ValueError: a negative dimension; OSError: this host
            gives no shared memory (``memfd_create`` refused).
        """
        dtype = np.dtype(dtype)
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"shared_empty of shape {shape}: a negative dimension")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        region, offset = self._engine.shared.shared_array(nbytes)
        return region.array[offset:offset + nbytes].view(dtype).reshape(shape)

    def allreduce(self, value: Any, out: Any = None, key: Any = None, average: bool = False, wait: bool = True,
                  fusion_bytes: int = DEFAULT_LIMIT) -> Any:
        """Sum ``value`` (an array, or a list of arrays) over every worker.

        The sum goes into ``out`` (an array, or a list like ``value``), or into ``value`` itself
        when ``out`` is None. Arrays of a list smaller than ``fusion_bytes`` travel together in one
        buffer (grouped the same way on every worker). With ``average`` the result is divided by
        the number of workers (float arrays only).

        Returns the result (``out``, or ``value``) with ``wait=True``; with ``wait=False`` a
        ``Handle`` whose result that is, and the arrays must stay alive and untouched until it is
        done.

        Raises:
            TypeError: a dtype collectives do not sum, or ``average`` of an integer array.
            ValueError: ``out`` unlike ``value``.
            NodeDiedError, WorkerMismatchError, DistributedError: see the module docstring.
        """
        if not average and type(value) is not list and type(value) is not tuple and type(out) is not list:
            # one array: straight to the engine, one handle (the latency-bound case)
            handle = NodeHandle("allreduce", self._worker)
            try:
                self._engine.allreduce(("allreduce", 0, 1) if key is None else ("allreduce", key, 0, 1), value,
                                       None if out is value else out, label=_Said("allreduce", key), future=handle)
            except PSNodeError as exc:
                raise translate(exc) from exc
            if not wait:
                return chain(handle, NodeHandle("allreduce", self._worker), result=value if out is None else out)
            handle.wait()
            return value if out is None else out
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        outs = values if out is None else (list(out) if isinstance(out, (list, tuple)) else [out])
        if len(outs) != len(values):
            raise ValueError(f"allreduce of {len(values)} arrays was given {len(outs)} outs")
        if average:
            for v in values:
                if not np.issubdtype(np.dtype(v.dtype), np.floating):
                    raise TypeError(f"allreduce(average=True) needs float arrays, got {np.dtype(v.dtype)}")
        futures = self.allreduce_arrays(values, outs, ("allreduce",) if key is None else ("allreduce", key), fusion_bytes)
        result = out if out is not None else value
        handle = self.handle_of(futures, "allreduce", result,
                                then=(lambda: [_scale(o, 1.0 / self.num_workers) for o in outs]) if average else None)
        return handle.wait() if wait else handle

    def allreduce_arrays(self, values: Sequence[Any], outs: Sequence[Any], key: tuple,
                         fusion_bytes: int = DEFAULT_LIMIT) -> list[concurrent.futures.Future]:
        """Start summing ``values[i]`` into ``outs[i]`` (fused as ``allreduce`` says); the futures at once.

        ``key`` (a tuple) names this set of arrays on every worker; each fused group adds its index
        and the number of groups, so the groups of one call run at once, and calls with the same
        key and layout are matched by call order.
        """
        layout = (tuple([v.nbytes for v in values]), tuple([v.dtype for v in values]), fusion_bytes)
        groups = self._plans.get(layout)
        if groups is None:  # the same keys or parameters come back every step: plan them once
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.clear()
            groups = self._plans[layout] = plan(layout[0], layout[1], fusion_bytes)
        futures = []
        engine = self._engine
        for g, members in enumerate(groups):
            gkey = key + (g, len(groups))
            if len(members) == 1:
                i = members[0]
                future = NodeHandle("allreduce", self._worker)
                with runtime_errors():
                    said = _Said("allreduce", key[1] if len(key) > 1 else None, g, len(groups))
                    engine.allreduce(gkey, values[i], None if outs[i] is values[i] else outs[i], label=said,
                                     future=future)
                futures.append(future)
                continue
            futures.append(self._fused_allreduce(gkey, [values[i] for i in members], [outs[i] for i in members]))
        return futures

    def _fused_allreduce(self, key: Any, values: list[Any], outs: list[Any]) -> concurrent.futures.Future:
        """Pack ``values`` into the group's buffer, sum it, and copy the sums out into ``outs``."""
        dtype = np.dtype(values[0].dtype)
        sizes = tuple([v.size for v in values])
        slot = (key, dtype.str, sizes)
        fused = self._fused.get(slot)
        if fused is None:
            fused = self._fused[slot] = FusionBuffer(dtype, sizes)
        fused.pack(values)
        inner = NodeHandle("allreduce", self._worker)
        with runtime_errors():
            self._engine.allreduce(key, fused.buffer, future=inner)
        return chain(inner, NodeHandle("allreduce", self._worker), lambda: fused.unpack(outs))

    def start_allgather(self, value: np.ndarray, out: np.ndarray, key: tuple, said: Any) -> NodeHandle:
        """Start gathering every worker's host ``value`` into ``out[rank]`` (shape ``(num_workers,) +
        value.shape``); the future at once. ``key`` names the call on every worker, as ``allreduce_arrays``'s;
        ``said``: the key an error or stall line names (None: none)."""
        future = NodeHandle("allgather", self._worker)
        with runtime_errors():
            self._engine.allgather(key, value, out, label=_Said("allgather", said), future=future)
        return future

    def allgather(self, value: Any, key: Any = None) -> Any:
        """Every worker's ``value`` (same shape and dtype everywhere), stacked: shape
        ``(num_workers,) + value.shape``, on ``value``'s device. Blocks."""
        host = np.ascontiguousarray(arrays.asnumpy(value))
        out = np.empty((self.num_workers,) + host.shape, host.dtype)
        self.start_allgather(host, out, ("allgather",) if key is None else ("allgather", key), key).wait()
        return out if type(value) is np.ndarray else arrays.to_device(out, arrays.device_of(value))

    def broadcast(self, value: Any, root: int = 0, key: Any = None, wait: bool = True) -> Any:
        """Copy worker ``root``'s ``value`` into every worker's ``value`` (in place); returns ``value``
        (or a ``Handle`` with ``wait=False``)."""
        future = self._broadcast_one(value, root, ("broadcast",) if key is None else ("broadcast", key))
        return future.wait() if wait else future

    def _broadcast_one(self, value: Any, root: int, key: Any) -> Handle:
        direct = type(value) is np.ndarray and value.flags.c_contiguous and value.flags.writeable
        host = value if direct else np.ascontiguousarray(arrays.asnumpy(value))
        inner = NodeHandle("broadcast", self._worker)
        with runtime_errors():
            self._engine.broadcast(key, host, root, future=inner)
        if direct:
            return self.handle_of([inner], "broadcast", value)
        return self.handle_of([inner], "broadcast", value, then=lambda: arrays.copy_into(value, host))

    def handle_of(self, futures: Sequence[concurrent.futures.Future], what: str, result: Any = None,
                  then: Any = None) -> Handle:
        """One handle for several collectives in flight (``allreduce_arrays``'s futures): done once
        every one is, with the first error (as kvcore's), or else after ``then()`` with ``result``."""
        return all_of(futures, NodeHandle(what, self._worker), then, result)

    def barrier(self) -> None:
        """Block until every worker reached the barrier (liveness-checked: a dead worker fails it)."""
        with runtime_errors():
            self._worker.barrier()

    def broadcast_parameters(self, params: Any, root: int = 0) -> None:
        """Copy worker ``root``'s parameters into every worker's, in place (every replica of each).

        ``params``: a ``torch.nn.Module``, ``named_parameters()``, a mapping ``name -> array | list
        of replicas | Parameter``, a sequence of those, or ``Trainer.params``. Small parameters
        travel fused. Blocks.
        """
        lists = _parameter_lists(params)
        firsts = [replicas[0] for replicas in lists]
        hosts = [a if type(a) is np.ndarray and a.flags.c_contiguous and a.flags.writeable
                 else np.ascontiguousarray(arrays.asnumpy(a)) for a in firsts]
        self.broadcast_arrays(hosts, root, ("parameters", root))
        for replicas, host in zip(lists, hosts):
            for replica in replicas:
                if replica is not host:
                    arrays.copy_into(replica, host.reshape(replica.shape))

    def broadcast_arrays(self, values: Sequence[np.ndarray], root: int, key: tuple) -> None:
        """Copy worker ``root``'s ``values`` (C-contiguous host arrays) into every worker's, in place;
        small ones fused. ``key`` names the set on every worker. Blocks."""
        groups = plan([int(v.nbytes) for v in values], [v.dtype for v in values], DEFAULT_LIMIT)
        handles = []
        fused_groups = []
        for g, members in enumerate(groups):
            gkey = key + (g, len(groups))
            if len(members) == 1:
                handles.append(self._broadcast_one(values[members[0]], root, gkey))
                continue
            fused = FusionBuffer(values[members[0]].dtype, [values[i].size for i in members])
            fused.pack([values[i] for i in members])
            handles.append(self._broadcast_one(fused.buffer, root, gkey))
            fused_groups.append((fused, members))
        for handle in handles:
            handle.wait()
        for fused, members in fused_groups:
            for j, i in enumerate(members):
                np.copyto(values[i], fused.part(j).reshape(values[i].shape))


def _scale(array: Any, factor: float) -> None:
    with arrays.device_context(arrays.device_of(array)):
        array *= array.dtype.type(factor)


def _parameter_lists(params: Any) -> list[list[Any]]:
    """Every parameter's replicas, in the order given (the same on every worker)."""
    from .parameters import Parameter, normalise_params

    if isinstance(params, (list, tuple)) and params and all(isinstance(p, Parameter) for p in params):
        return [p.list_data() for p in params]
    return [p.list_data() for p in normalise_params(params)]
