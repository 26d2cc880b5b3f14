"""The ``allreduce`` store: KVStore semantics with no servers, the workers summing among themselves.

``kvcore.create('allreduce')`` in a worker of a job (``pslaunch -n N -s 0``, or a job with servers)
joins it and keeps every key's value on every worker. The same training script runs on either
design: what a ``dist_sync`` store does on its servers, this one does on every worker alike.

- ``init`` broadcasts worker 0's values (the others' are ignored); every worker must pass the same
  shapes and dtypes (``WorkerMismatchError`` otherwise, on every worker).
- ``push`` sums the pushed value over every worker (a list of values for a key is summed on this
  worker first) and returns a ``Handle`` at once; the caller may change its arrays as soon as push
  returns (they are copied into the key's sum buffer). The sum then replaces the stored value, or,
  with an optimizer (``set_optimizer``) or updater, is given to it on this worker: every worker runs
  the same optimizer on the same sums, so every worker holds the same weights. The updater runs on
  the caller's thread when the key is next pulled or pushed.
- ``pull`` copies the stored value (after this worker's pushes of the key are summed).
- ``pushpull(key, value, out=None)`` is an allreduce: the sum lands in ``out``, or in ``value``
  itself when ``out`` is None, without a sum buffer (with an optimizer: push, then pull).
- ``broadcast(key, value, out)``: ``init`` then ``pull``. ``barrier``, ``rank``, ``num_workers``,
  ``local_rank`` as the other stores.
- A push of several small keys travels fused (``fusion_bytes``, 1 MiB by default; 0 sends each key
  alone), grouped the same way on every worker that pushes the same keys.

Every worker must push the same keys as often (in any order: collectives are tagged by key and
version); a worker that stops pushing leaves the others waiting until it dies or leaves the job,
which then fails them naming it.
"""

from __future__ import annotations

import threading
from typing import Any, Hashable

import numpy as np

from psnode.worker.node import WorkerNode

from .. import arrays, runtime
from ..dist_errors import runtime_errors
from ..handles import Handle, completed
from ..worker_collectives import Collectives
from .base import KVStoreBase

SHARED_MIN = 1 << 20  # a key's buffers of this many bytes or more live in shared memory (``_buffer``)

__all__ = ["AllreduceKVStore", "create"]


class AllreduceKVStore(KVStoreBase):
    """A KVStore whose workers sum among themselves (see the module docstring)."""

    def __init__(self, store_type: str = "allreduce", worker: WorkerNode | None = None) -> None:
        super().__init__(store_type)
        self._coll: Collectives = runtime.collectives(worker)
        self._worker = self._coll.worker
        self._stored: dict[Hashable, np.ndarray] = {}
        self._sums: dict[Hashable, np.ndarray] = {}  # key -> the buffer its pushes are summed in
        self._pending: dict[Hashable, _Push] = {}  # key -> its push in flight
        self._lock = threading.Lock()
        self.fusion_bytes = 1 << 20
        """Keys of one push smaller than this travel together (0: every key alone)."""
        self._trace_calls(self._worker.timeline)  # PSLAUNCH_TIMELINE

    # ---- job facts ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank, 0 .. num_workers-1."""
        return self._coll.rank

    @property
    def num_workers(self) -> int:
        """Number of workers in the job."""
        return self._coll.num_workers

    @property
    def num_servers(self) -> int:
        """Servers this store uses: none."""
        return 0

    @property
    def local_rank(self) -> int:
        """This worker's index among the workers on its host."""
        return self._coll.local_rank

    @property
    def collectives(self) -> Collectives:
        """The collectives of this store's workers (``kvcore.collectives``)."""
        return self._coll

    def barrier(self) -> None:
        """Block until every worker reached the barrier."""
        self._coll.barrier()

    def close(self) -> None:
        """Finish this worker's part of the job (also done at exit)."""
        while self._pending:
            self._settle(next(iter(self._pending)))
        with runtime_errors():
            self._worker.close()

    # ---- hooks ------------------------------------------------------------------------------------
    def _init_keys(self, pairs: list[tuple[Hashable, Any]]) -> None:
        values = []
        for _, value in pairs:
            host = arrays.asnumpy(value)
            copy = self._buffer(host.shape, host.dtype)
            np.copyto(copy, host)
            values.append(copy)
        keys = [k for k, _ in pairs]
        # worker 0's values win: one broadcast of the keys' values (fused), checked for shape and dtype
        self._coll.broadcast_arrays(values, 0, ("kv-init", tuple(keys)))
        for key, value in zip(keys, values):
            self._stored[key] = value

    def _push_groups(self, groups: list[tuple[Hashable, list[Any]]], priority: int, copy: bool = True) -> Handle:
        if self._compression is not None:
            return self._push_compressed(groups)
        keys, sources, sums = [], [], []
        for key, values in groups:
            total = self._sum_buffer(key)
            if len(values) == 1 and type(values[0]) is np.ndarray:
                source = values[0]  # copied into the sum (or the fused buffer) before push returns
            else:
                source = _local_sum(values, total)
            keys.append(key)
            sources.append(source)
            sums.append(total)
        return self._launch(keys, sources, sums, apply=True)

    def _sum_buffer(self, key: Hashable) -> np.ndarray:
        """The buffer ``key``'s next push is summed in, once its push in flight is applied."""
        if key in self._pending:
            self._settle(key)
        total = self._sums.get(key)
        if total is None:
            info = self._meta[key]
            total = self._sums[key] = self._buffer(info.shape, info.dtype)
        return total

    def _push_compressed(self, groups: list[tuple[Hashable, list[Any]]]) -> Handle:
        """Encode each key's value (this worker's values summed first) with its residual, gather every
        worker's encodings in one allgather, and decode them into the key's sum buffer in rank order:
        every worker then holds the same sum. Each worker receives the others' encodings (W - 1 of
        them): what a ring would move at full width, 2 (W - 1) / W of the value, costs more than that
        from 2 / (encoded fraction) workers on (4 for fp16, 64 for 1bit_scaled, 100 for topk at 1%)."""
        keys, encoded = [], []
        all_sums, compression = self._sums, self._compression
        for key, values in groups:
            total = self._sum_buffer(key)
            value = arrays.asnumpy(values[0]) if len(values) == 1 else _local_sum(values, total)
            keys.append(key)
            encoded.append(compression.quantize((key, 0), value.reshape(-1)))
        sizes = [int(data.nbytes) for data in encoded]
        mine = np.concatenate(encoded) if len(encoded) > 1 else encoded[0]
        gathered = np.empty((self.num_workers, mine.size), np.uint8)
        tag = ("kv-encoded", tuple(keys))
        future = self._coll.start_allgather(mine, gathered, tag, tag)

        def decode() -> None:
            for rank in range(self.num_workers):
                offset = 0
                for key, size in zip(keys, sizes):
                    compression.dequantize(gathered[rank, offset:offset + size], all_sums[key], accumulate=rank > 0)
                    offset += size

        return self._hold(keys, self._coll.handle_of([future], "push", then=decode), apply=True)

    def _buffer(self, shape: tuple, dtype: Any) -> np.ndarray:
        """A new buffer for a key's stored value or sum: big ones in shared memory, where the
        same-host allreduce sums them without copying them into and out of its own regions (the
        stored value and the sum trade places after each push, so both are made alike)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if nbytes >= SHARED_MIN:
            try:
                return self._coll.shared_empty(shape, dtype)
            except OSError:  # no memfd here (a sandbox that forbids it): private memory works everywhere
                pass
        return np.empty(shape, dtype)

    def _launch(self, keys: list[Hashable], values: list[np.ndarray], outs: list[Any], apply: bool) -> Handle:
        """Sum ``values`` into ``outs`` over every worker; each key's pending push until done."""
        futures = self._coll.allreduce_arrays(values, outs, ("kv", tuple(keys)), self.fusion_bytes)
        return self._hold(keys, self._coll.handle_of(futures, "push"), apply)

    def _hold(self, keys: list[Hashable], handle: Handle, apply: bool) -> Handle:
        """``handle`` is the push in flight of ``keys`` until ``_settle`` (which applies their sums when
        ``apply``); returns it."""
        push = _Push(handle, keys if apply else [])
        pending = self._pending
        for key in keys:
            pending[key] = push
        return handle

    def _settle(self, key: Hashable) -> None:
        """Wait for ``key``'s push in flight and apply it, with the other keys it carried (the
        updater, or the sum becomes the stored value), on this thread."""
        push = self._pending.get(key)
        if push is None:
            return
        try:
            push.handle.wait()
        finally:
            pending = self._pending
            for k in push.keys or [key]:
                if pending.get(k) is push:
                    del pending[k]
        stored, sums, updater = self._stored, self._sums, self._updater
        for k in push.keys:
            if updater is None:  # the sum buffer becomes the stored value; the old one sums the next push
                stored[k], sums[k] = sums[k], stored[k]
            else:
                updater(k, sums[k], stored[k])
        push.keys = []

    def _pull_groups(self, groups: list[tuple[Hashable, list[Any]]], priority: int) -> Handle:
        pending, all_stored = self._pending, self._stored
        for key, outs in groups:
            if key in pending:
                self._settle(key)
            stored = all_stored[key]
            for out in outs:
                if type(out) is np.ndarray:
                    np.copyto(out, stored)
                else:
                    arrays.copy_into(out, stored)
        return completed(description="pull")

    def _pull_rows(self, requests: list[tuple[Hashable, np.ndarray]], priority: int) -> list[Any]:
        result = []
        for key, rows in requests:
            self._settle(key)
            result.append(self._stored[key][rows].copy())
        return result

    # ---- pushpull and broadcast -------------------------------------------------------------------------
    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0, wait: bool = True) -> Handle:
        """Sum ``value`` over every worker into ``out`` (``value`` itself when None): an allreduce.

        Without an optimizer this is one allreduce straight into ``out`` (the stored value becomes
        the sum too); with one, ``push`` then ``pull``.
        """
        if self._updater is not None or self._compression is not None:
            return super().pushpull(key, value, out, priority, wait)
        groups = _groups(self, key, value)
        out_groups = groups if out is None else _groups(self, key, out, "out")
        keys, values, outs = [], [], []
        for (k, vs), (_, os_) in zip(groups, out_groups):
            meta = self._require(k, "pushpull")
            for v in vs:
                self._check_value(k, meta, v)
            for o in os_:
                self._check_out(k, meta, o)
            self._settle(k)
            direct = len(vs) == 1 and len(os_) == 1 and type(os_[0]) is np.ndarray and os_[0].flags.c_contiguous
            if direct:
                source = vs[0] if type(vs[0]) is np.ndarray else arrays.asnumpy(vs[0])
                values.append(source)
                outs.append(os_[0])
            else:  # several values or outs, or device arrays: through the key's sum buffer
                total = _local_sum(vs, self._sum_buffer(k))
                values.append(total)
                outs.append(total)
            keys.append(k)
        handle = self._launch(keys, values, outs, apply=False)
        copies = [(k, o, os_) for k, o, (_, os_) in zip(keys, outs, out_groups)]

        def finish() -> None:
            for k, o, os_ in copies:
                np.copyto(self._stored[k], o)
                for target in os_:
                    if target is not o:
                        arrays.copy_into(target, o)

        done = self._hold(keys, self._coll.handle_of([handle], "pushpull", then=finish), apply=False)
        if wait:
            done.wait()
        return done

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Initialise ``key`` with worker 0's ``value`` and pull it into ``out`` (MXNet 2's broadcast)."""
        self.init(key, value)
        self.pull(key, out=out, priority=priority)


def _local_sum(values: list[Any], total: np.ndarray) -> np.ndarray:
    """This worker's values of a key summed into ``total``, on the host."""
    np.copyto(total, arrays.asnumpy(values[0]))
    for value in values[1:]:
        total += arrays.asnumpy(value)
    return total


class _Push:
    """A push in flight: its handle, and the keys whose sums it applies once done (none: pushpull,
    which writes the stored values itself)."""

    __slots__ = ("handle", "keys")

    def __init__(self, handle: Handle, keys: list[Hashable]) -> None:
        self.handle = handle
        self.keys = keys


def _groups(store: KVStoreBase, key: Any, value: Any, what: str = "value") -> list[tuple[Hashable, list[Any]]]:
    from .keys import group as group_keys

    groups = group_keys(key, value, what, store._kinds)
    return [(k, [store._dense_value(k, v) for v in vs]) for k, vs in groups]


def create(name: str) -> AllreduceKVStore:
    """The factory the registry calls for ``allreduce``."""
    return AllreduceKVStore(name)
