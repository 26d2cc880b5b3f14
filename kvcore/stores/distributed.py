"""The distributed stores: ``dist_sync``, ``dist_async`` and ``dist_device_sync`` over psnode.

``kvcore.create('dist_sync')`` in a worker process (``DMLC_ROLE`` unset or ``worker``) joins the job
the environment describes (docs/env.md): it registers with the scheduler (blocking, with the
registration timeout) and from then on talks to the servers. One worker node serves every
distributed store of the process (``kvcore.runtime`` holds it; a test hands one in with
``runtime.use``, or to the store itself: ``DistKVStore(name, worker=...)``).

Semantics (MXNet's dist KVStore):

- ``init`` keeps rank 0's value (the others' are ignored). Worker 0 decides where each key goes
  (``kvcore.stores.placement``): its init records the keys with a copy of each value, and they are placed
  together and sent before its next call that reaches the servers (``kvcore.stores.deferred_init``); then
  it tells every worker where they went (``kvcore.stores.placement_book``). Another worker's init returns
  once worker 0 has put its keys on the servers, so every worker may pull them at once. Workers may
  init in any order, grouping and subset of keys: no barrier has to match.
- ``push`` returns a ``Handle`` at once, without waiting for the servers; the caller may change its
  arrays as soon as push returns (small values are packed, big ones copied into a send buffer kept
  per key). A list of values for one key is summed on the worker first: on the host for
  ``dist_sync`` / ``dist_async``, on the values' device for ``dist_device_sync``.
- ``pull(wait=True)`` returns once ``out`` holds the value; ``pull(wait=False)`` returns a Handle
  at once and leaves ``out`` untouched until it is done (``Handle.add_done_callback`` works; the
  callback runs on the network thread). In ``dist_sync`` a pull never misses this worker's own
  earlier pushes of the key.
- ``dist_sync``: the servers sum one push of every worker per round and apply the updater once per
  round (without one the sum replaces the value). ``dist_async``: every push is applied on arrival,
  so an optimizer is required.
- ``set_optimizer(opt)`` / ``set_updater(u)`` pickle the optimizer (wrapped in ``kvcore.optim.Updater``)
  or any picklable ``u(key, merged, stored)`` and ship it from rank 0 to every server; every worker
  must call it (as in MXNet), it returns after a barrier. If ``u`` has ``init_key(key, value)`` the
  servers call it for every key they hold. Keys of ``PSLAUNCH_BIGARRAY_BOUND`` elements or more are
  split across the servers, and the updater then sees flat 1-D shards of them. Optimizer states live
  on the servers.
- ``priority``: higher goes first when sends queue up.
- A worker pslaunch started again alone (``--restart-scope worker``) joins the running job with its
  rank: its ``init`` learns where worker 0 placed the keys (a restarted worker 0 places only keys
  never placed before), ``set_optimizer`` and ``set_gradient_compression`` only set it up locally
  (the servers hold the keys, the optimizer and its state), and it goes on pushing. In ``dist_sync``
  and ``dist_device_sync`` it is a replacement in place: it resumes at its predecessor's last mark
  (``psnode.server.marks``; the scalars of ``kvcore.elastic.State``, which this store sends before
  its next push whenever the script sets them), and redoes the steps since then exactly: the
  servers drop the pushes they took already and answer its pulls with what its predecessor pulled.
- ``set_gradient_compression(params)`` (every worker calls it; rank 0 sends the threshold to every
  server, at full float32 precision; all return after a barrier): from then on each worker
  quantizes a key's value after its local reduce, with a residual per (key, part), and pushes the
  packed words (codec ``2bit`` or ``1bit``, ``psnode.compression.codecs``); the servers dequantize each push and
  sum in arrival order. Pulls and ``init`` are not compressed. Keys initialised while compression is
  on are split over the servers on whole compressed words (see ``kvcore.stores.sharding``).

Errors of the runtime surface as ``DistributedError`` subclasses (``NodeDiedError`` names the dead
node) with the psnode error as ``__cause__``, mapped in one place (``kvcore.dist_errors``).
"""

from __future__ import annotations

import concurrent.futures
import json
import pickle
import threading
from typing import Any, Hashable

import numpy as np

from psnode.compression.codecs import RAW, codec_id
from psnode.compression.schemes import from_half
from psnode.env import NodeEnv
from psnode.node.futures import chain
from psnode.node.protocol import MAX_MARK_SCALARS, Group
from psnode.worker.node import WorkerNode

from .. import arrays, runtime
from ..dist_errors import maps_runtime_errors, runtime_errors
from ..errors import (
    DistributedError,
    DTypeMismatchError,
    OptimizerError,
    ShapeMismatchError,
)
from ..handles import Handle
from ..leaving import LeaveOnSignal
from ..node_handle import NodeHandle
from ..optim.base import Optimizer, Updater
from ..preempting import PreemptOnSignal
from .base import KeyMeta, KVStoreBase
from .key_init import KeyInit
from .key_lists import KeyListPlans
from .placement import KeyRequest
from .sharding import KeyLayout

__all__ = ["DistKVStore", "create"]


class DistKVStore(KVStoreBase):
    """A KVStore whose values live on the job's servers (see the module docstring)."""

    def __init__(self, store_type: str, worker: WorkerNode | None = None) -> None:
        super().__init__(store_type)
        # before registering: the job's other workers need not wait for this one
        servers = worker.num_servers if worker is not None else runtime.num_servers()
        if servers == 0:
            raise DistributedError(
                f"kvcore.create({store_type!r}) keeps the values on servers, but this job has none "
                "(DMLC_NUM_SERVER=0, as pslaunch -s 0 starts it); use kvcore.create('allreduce'), whose "
                "workers sum among themselves, or start the job with servers (pslaunch -s N)")
        self._worker = worker if worker is not None else runtime.worker()
        self._sync = store_type != "dist_async"
        # an elastic job (-n MIN:MAX): SIGTERM makes this worker leave at its next step boundary
        self._leaving = LeaveOnSignal(self._worker, self) if self._sync and self._worker.env.elastic else None
        # a preempted job: worker 0 commits a checkpoint at its next step boundary (kvcore.preempting)
        self._preempting = PreemptOnSignal(self) if self._worker.env.checkpoint_dir else None
        self.script_state: Any = None  # the script's kvcore.elastic.State (a preemption commits it; resets)
        self._boundary_hooks = [hook for hook in (self._leaving, self._preempting) if hook is not None]
        self._pulled = False  # a pull came since the last push: the next push starts a step
        # no push yet: until the first, each read of num_workers takes the members anew (a joiner's
        # store is made before it hears of a worker that joins after it from the same round)
        self._pushed = False
        # replacement in place (PSLAUNCH_RESTART_SCOPE=worker): a synchronous store marks where it is
        self._marks = self._sync and self._worker.env.restart_scope == "worker"
        self._pending_mark: dict[str, Any] | None = None  # scalars to mark before the next push
        self._resumed = None
        if self._marks:
            self._worker.number_barriers()
            with runtime_errors():
                self._resumed = self._worker.resume()  # a replacement: before any push or pull
        self._merge_on_device = store_type == "dist_device_sync"
        self._merge_buffers: dict[Hashable, Any] = {}  # dist_device_sync: key -> its sum's buffer on the GPU
        self._merge_lock = threading.Lock()
        self._layouts: dict[Hashable, KeyLayout] = {}
        self._whole: dict[Hashable, tuple[int, int]] = {}  # key -> (server, key id) for unsplit keys
        self._key_lists = KeyListPlans(self._whole, self._meta)  # lists of them pushed and pulled each step
        self._keys = KeyInit(self._worker, self._sync, self._take_layouts)  # where keys go, and how they get there
        self._has_updater = False
        self._compress_lock = threading.Lock()  # residuals are updated by one pushing thread at a time
        self._pull_codec: int | None = None  # pulls of float32 keys travel encoded (half width), or raw
        self._trace_calls(self._worker.timeline)
        self._restored: dict[Hashable, KeyMeta] = {}  # keys of the checkpoint restored (note_restored)

    # ---- job facts --------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank, 0 .. num_workers-1."""
        return self._worker.rank

    @property
    def num_workers(self) -> int:
        """Number of workers in the job; in an elastic job the members of the round this worker's
        next push goes to, once this step's pulls are in (``kvcore.leaving``: the step boundary), and
        before the first push as it is known now."""
        if self._leaving is None:
            return self._worker.num_workers
        if (self._pulled and not self._worker.requests.pending) or not self._pushed:
            self._leaving.settle()
        return self._leaving.members

    @property
    def elastic(self) -> bool:
        """True in an elastic job (``-n MIN:MAX``): ``num_workers`` may change at a step boundary."""
        return self._leaving is not None

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of the job's workers, as ``num_workers`` counts them: in an elastic job the
        members of this worker's next round (ranks are ids: a rank that left leaves a gap until a
        joiner takes it)."""
        if self._leaving is None:
            return tuple(range(self._worker.num_workers))
        self.num_workers  # noqa: B018 - settles the step boundary when it is due
        return self._leaving.ranks

    @property
    def member_index(self) -> int:
        """This worker's place among ``members`` (0 .. num_workers-1): the part of the data it takes
        (``kvcore.SplitSampler``); its rank where ranks are dense."""
        return self.members.index(self.rank)

    @property
    def num_servers(self) -> int:
        """Number of servers in the job."""
        return self._worker.num_servers

    @property
    def local_rank(self) -> int:
        """This worker's index among the workers on its host (``PSLAUNCH_LOCAL_RANK``)."""
        return self._worker.env.local_rank

    @maps_runtime_errors
    def barrier(self) -> None:
        """Block until every worker reached the barrier.

        Raises:
            NodeDiedError: a node died meanwhile.
        """
        self._settle()
        self._worker.barrier(Group.WORKERS)

    @maps_runtime_errors
    def close(self) -> None:
        """Finish this worker's part of the job (also done at exit): waits for requests in flight. In an
        elastic job a worker that got SIGTERM leaves it instead (the others go on without it)."""
        self._settle()
        if self._leaving is not None and self._leaving.asked:
            self._leaving.leave(exit=False)
            return
        self._worker.close()

    @property
    def leaving(self) -> bool:
        """True once this worker of an elastic job got SIGTERM and made its last push (the step under
        way when the signal came): it leaves the job at its next step boundary (its next push), or at
        ``close()``, and exits 0. A script may read it to end on its own terms."""
        return self._leaving is not None and self._leaving.last is not None

    # ---- what checkpoints use (kvcore.elastic) --------------------------------------------------
    @property
    def job(self) -> NodeEnv:
        """The job as this worker's environment describes it (``psnode.env.NodeEnv``): its id, the
        checkpoint directory, the restart count, the big-array bound."""
        return self._worker.env

    @property
    def rejoined(self) -> bool:
        """True in a worker pslaunch started again alone, which joined the running job."""
        return self._worker.rejoined

    @property
    def joined(self) -> bool:
        """True in a worker that joined the running elastic job (``-n MIN:MAX``) after it began."""
        return self._worker.joined

    def joined_scalars(self) -> dict[str, Any]:
        """A joiner: the ``State`` scalars the members had when its first round began (from the
        members' lowest rank, at its next step boundary; the wait ends if a node fails)."""
        with runtime_errors():
            return self._worker.elastic.scalars(None)

    def resumed_scalars(self) -> dict[str, Any] | None:
        """A replacement in place: the scalars of the mark it resumed from (None: none, or no replacement)."""
        return self._resumed

    def resume_barriers(self) -> None:
        """A replacement in place resumed its scalars: its barriers count on from its predecessor's mark."""
        self._worker.resume_barriers()

    def outcome_known(self) -> bool:
        """True when the workers' next barrier completed already: a replacement in place redoing a
        step its predecessor passed (``State.commit`` does not write that checkpoint again)."""
        return self._marks and self._worker.barrier_done_already(Group.WORKERS)

    def note_scalars(self, scalars: dict[str, Any]) -> None:
        """The script set its resume scalars (``kvcore.elastic.State``): mark this worker's place with
        them before its next push (``psnode.server.marks``), when a replacement in place could use it.

        Raises:
            TypeError: a scalar is not a JSON value; ValueError: they take more than 64 KiB as JSON.
        """
        if not self._marks:
            return
        try:
            text = json.dumps(scalars)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"State's scalars must be JSON values (numbers, strings, booleans, lists, dicts): "
                            f"{scalars!r}: {exc}") from None
        if len(text) > MAX_MARK_SCALARS:
            raise ValueError(f"State's scalars take {len(text)} bytes as JSON, more than a mark holds ({MAX_MARK_SCALARS})")
        self._pending_mark = dict(scalars)

    def _send_mark(self) -> None:
        pending = self._pending_mark
        if pending is not None:
            self._pending_mark = None
            self._worker.mark(pending)

    @maps_runtime_errors
    def wait_pushes(self) -> None:
        """Block until every push of this worker reached its servers."""
        self._settle()
        self._worker.wait_pushes()

    @maps_runtime_errors
    def barrier_with_note(self, note: Any = None) -> list[Any]:
        """A barrier of the workers at which each leaves ``note`` (a JSON value, or None); returns
        every worker's note, by rank: how worker 0 tells the others its outcome."""
        self._settle()
        return self._worker.barrier(Group.WORKERS, note=note)

    @maps_runtime_errors
    def send_checkpoint_requests(self, bodies: dict[int, dict]) -> tuple[concurrent.futures.Future, list]:
        """Send checkpoint request ``bodies[server]`` (``psnode.server.checkpoints``) to each server;
        returns the future, done once every one answered (failed with the first refusal), and the
        list that gathers the ``(server, reply)`` pairs. Wait with ``wait_for``."""
        self._settle()
        return self._worker.checkpoint(bodies)

    def wait_for(self, future: concurrent.futures.Future) -> None:
        """Block until ``future`` (of this store's runtime) is done, without a time limit (liveness is
        checked: a dead peer fails it), and raise its error as kvcore's (a refusal: ``ServerError``)."""
        with runtime_errors():
            self._worker.wait_for(future)
            future.result()

    def key_meta(self, key: Hashable) -> KeyMeta | None:
        """The shape and dtype ``key`` was initialised with in this store; None before its init."""
        return self._meta.get(key)

    def held_keys(self) -> dict[Hashable, KeyMeta]:
        """Every key the servers hold for this store: initialised, or restored from a checkpoint and
        not initialised yet."""
        held = dict(self._restored)
        held.update(self._meta)
        return held

    def note_restored(self, key: Hashable, meta: KeyMeta) -> None:
        """Record that the servers hold ``key`` restored from a checkpoint with ``meta``: its ``init``
        must then match that shape and dtype, and it keeps the checkpoint's value."""
        self._restored[key] = meta

    # ---- optimizer --------------------------------------------------------------------------
    def set_optimizer(self, optimizer: Any) -> None:
        """Ship ``optimizer`` (or a picklable updater ``u(key, merged, stored)``) to the servers.

        Every worker calls it; rank 0 sends, all return after a barrier.

        Raises:
            OptimizerError: not an optimizer or callable, or not picklable.
        """
        updater = Updater(optimizer) if isinstance(optimizer, Optimizer) else optimizer
        self.set_updater(updater)

    def set_updater(self, updater: Any) -> None:
        """Ship a picklable ``updater(key, merged, stored)`` to the servers (see ``set_optimizer``)."""
        if not callable(updater):
            raise OptimizerError(f"the optimizer or updater must be an Optimizer or callable, got {type(updater).__name__}")
        try:
            pickle.dumps(updater, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise OptimizerError(
                f"the updater {updater!r} cannot be pickled, so it cannot run on the servers: {exc}; "
                "use a module-level class or function"
            ) from exc
        self._settle()  # the updater's init_key sees every key initialised before it
        rejoined = self._worker.rejoined  # a restarted worker: the servers hold the updater and its state,
        if self.rank == 0:  # unless worker 0 died before they got it: they keep one they hold (redo)
            self.wait_for(self._worker.set_updater(updater, redo=rejoined))
        if not rejoined or self._marks:  # a replacement in place redoes the barrier (answered at once)
            self._settle()
            with runtime_errors():
                self._worker.setup_barrier("set_optimizer")
        self._updater = updater
        self._has_updater = True

    # ---- gradient compression ------------------------------------------------------------------
    @maps_runtime_errors
    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress every push from now on (see the module docstring and docs/compression.md).

        Every worker calls it with the same parameters (as in MXNet), best before ``init``: keys
        initialised afterwards are split on whole compressed words. Blocking: each worker first
        waits until its earlier pushes reached the servers (they were encoded with the old
        parameters), then rank 0 sends the new ones to every server, and all return after a
        barrier; residuals are kept.

        Raises:
            CompressionError: parameters MXNet would refuse (nothing is sent then).
            ServerError: a server refused the parameters (naming the value).
        """
        self._settle()  # keys initialised before are split for the old parameters' words
        super().set_gradient_compression(compression_params)
        params = self._compression.params
        # the next pulls' width (those in flight asked for theirs and get it)
        self._pull_codec = None if params.pull is None else codec_id(params.pull)
        rejoined = self._worker.rejoined  # a restarted worker: the servers have the parameters
        if rejoined and not self._marks:
            return
        self._worker.wait_pushes()
        # first: no push encoded with the old parameters is still on its way to a server
        self._worker.setup_barrier("set_gradient_compression:drained")
        if self.rank == 0 and not rejoined:
            self.wait_for(self._worker.set_codec(codec_id(params.type), self._compression.scheme.wire_params()))
            if params.pull is not None and params.pull != params.type:
                self.wait_for(self._worker.set_codec(self._pull_codec, {}))
        self._worker.setup_barrier("set_gradient_compression:set")  # (a replacement in place redoes both: at once)

    # ---- the common cases without the general normalisation: one key, or the step's list of keys ----
    @maps_runtime_errors
    def push(self, key: Any, value: Any, priority: int = 0, copy: bool = True) -> Handle:
        """As ``KVStoreBase.push``; one numpy value of an initialised whole key, or a list of such keys seen
        before with a numpy value each (``kvcore.stores.key_lists``), skips the grouping."""
        if self._pending_mark is not None:
            self._send_mark()
        if self._boundary_hooks:
            self._step_boundary()  # an elastic job's leave, a preempted job's checkpoint
        if type(value) is np.ndarray and (self._sync or self._has_updater) and self._compression is None:
            target = self._whole_target(key, value)
            if target is not None:
                handle = NodeHandle("push", self._worker)
                self._worker.push_part(target[0], target[1], value, priority, handle, copy=copy)
                return handle
        elif type(value) in (list, tuple) and (self._sync or self._has_updater) and self._compression is None:
            parts = self._key_lists.parts(key, value)
            if parts is not None:  # the list of keys of the last steps, with host arrays
                self._settle()
                handle = NodeHandle("push", self._worker)
                self._worker.push(parts, priority, copy, handle)
                return handle
        return super().push(key, value, priority, copy)

    @maps_runtime_errors
    def pull(self, key: Any, out: Any = None, priority: int = 0, ignore_sparse: bool = True, wait: bool = True) -> Handle:
        """As ``KVStoreBase.pull``; one numpy out of an initialised whole key, or a list of such keys seen
        before with a numpy out each (``kvcore.stores.key_lists``), skips the grouping."""
        if self._boundary_hooks:
            self._pulled = True
        if type(out) is np.ndarray and out.flags.c_contiguous and out.flags.writeable and self._pull_codec is None:
            target = self._whole_target(key, out)
            if target is not None:
                handle = NodeHandle("pull", self._worker)
                self._worker.pull_part(target[0], target[1], out, priority, handle)
                if wait:
                    handle.wait()
                return handle
        elif type(out) in (list, tuple) and self._pull_codec is None:
            parts = self._key_lists.parts(key, out, writable=True)
            if parts is not None:  # the list of keys of the last steps, with host outs
                self._settle()
                handle = NodeHandle("pull", self._worker)
                self._worker.pull(parts, priority, handle)
                if wait:
                    handle.wait()
                return handle
        return super().pull(key, out, priority, ignore_sparse, wait)

    def _step_boundary(self) -> None:
        """Before a push: one that starts a step (a pull came since the last push, and every request
        is answered) is this worker's step boundary, where its boundary hooks act (``kvcore.leaving``:
        leave an elastic job; ``kvcore.preempting``: commit a preempted job's checkpoint)."""
        if self._pulled and not self._worker.requests.pending:
            for hook in self._boundary_hooks:
                hook.at_boundary()
        elif not self._pushed and self._leaving is not None:  # the first step's members, as the script starts it
            self._leaving.settle()
        self._pulled = False
        self._pushed = True

    def _whole_target(self, key: Any, array: np.ndarray) -> tuple[int, int] | None:
        """``(server, key id)`` when ``key`` is one initialised, unsplit key of ``array``'s shape and
        dtype (the fast path of push and pull), else None."""
        if type(key) is not int and type(key) is not str:
            return None
        target = self._whole.get(key)
        meta = self._meta.get(key)
        if target is None or meta is None or array.shape != meta.shape or array.dtype != meta.dtype:
            return None
        return target

    # ---- hooks ----------------------------------------------------------------------------
    def layout_for(self, key: Hashable, shape: tuple[int, ...], dtype: Any) -> KeyLayout:
        """Where ``key`` lives on the servers: its layout once initialised, else the one its placement
        decision gives (``kvcore.stores.placement``), else the hash rule's."""
        self._settle()
        known = self._layouts.get(key)
        if known is not None:
            return known
        return self._keys.placement.layout(self._request(key, shape, dtype))

    def _request(self, key: Hashable, shape: Any, dtype: Any) -> KeyRequest:
        dtype = np.dtype(dtype)
        # compressed pushes are split on whole words (as MXNet splits them); init itself is not compressed
        word = self._compression.params.split_word if self._compression and dtype == np.float32 else 1
        return KeyRequest(key, tuple(shape), dtype, word)

    def place(self, keys: list[tuple[Hashable, tuple[int, ...], Any]]) -> None:
        """Decide where the keys ``(key, shape, dtype)`` of one call go (worker 0, before it
        restores a checkpoint's keys on the servers; ``kvcore.stores.placement``)."""
        self._settle()
        self._keys.placement.place([self._request(key, shape, dtype) for key, shape, dtype in keys])

    def _init_keys(self, pairs: list[tuple[Hashable, Any]]) -> None:
        for key, value in pairs:  # a restored key keeps the checkpoint's value: it must fit (every rank checks)
            meta = self._restored.get(key)
            if meta is not None and (tuple(value.shape) != meta.shape or np.dtype(value.dtype) != meta.dtype):
                kind = ShapeMismatchError if tuple(value.shape) != meta.shape else DTypeMismatchError
                raise kind(f"key {key!r} is initialised with shape {tuple(value.shape)} and dtype {np.dtype(value.dtype)}, "
                           f"but the checkpoint restored holds shape {meta.shape} and dtype {meta.dtype} for it")
        self._keys.init([self._request(key, value.shape, value.dtype) for key, value in pairs],
                        [value for _, value in pairs])

    def _settle(self) -> None:
        """Worker 0: its init calls recorded so far go to the servers first (``KeyInit.settle``)."""
        self._keys.settle()

    def _take_layouts(self, layouts: list[KeyLayout]) -> None:
        self._key_lists.forget()
        for lay in layouts:
            self._layouts[lay.key] = lay
            if not lay.split:
                self._whole[lay.key] = (lay.parts[0].server, lay.id)

    @maps_runtime_errors
    def _push_groups(self, groups: list[tuple[Hashable, list[Any]]], priority: int, copy: bool = True) -> Handle:
        self._settle()
        if self._pending_mark is not None:
            self._send_mark()
        if not self._sync and not self._has_updater:
            raise OptimizerError(
                f"dist_async applies every push on the servers as it arrives, so it needs an optimizer: "
                f"call kv.set_optimizer(...) before pushing key {groups[0][0]!r}"
            )
        if self._compression is not None:
            return self._push_compressed(groups, priority)
        parts = []
        fresh = True
        whole = self._whole
        for key, values in groups:
            if len(values) == 1 and key in whole and type(values[0]) is np.ndarray:
                parts.append((*whole[key], values[0]))  # one server holds it: no slicing needed
                fresh = False
                continue
            lay = self._layouts[key]
            if len(values) == 1:
                value = values[0]
                if isinstance(value, np.ndarray):
                    fresh = False
                    flat = value.reshape(-1) if value.flags.c_contiguous else np.ascontiguousarray(value).reshape(-1)
                else:
                    flat = arrays.asnumpy(value).reshape(-1)
            else:
                flat = self._merge(key, values).reshape(-1)
            for part in lay.parts:
                parts.append((part.server, part.id, flat[part.start:part.stop]))
        handle = NodeHandle("push", self._worker)
        self._worker.push(parts, priority, copy and not fresh, handle)
        return handle

    @maps_runtime_errors
    def _push_compressed(self, groups: list[tuple[Hashable, list[Any]]], priority: int) -> Handle:
        """Quantize each key's value (after the local reduce) part by part, each part with its own
        residual, and push the packed words in the compression's codec."""
        compression = self._compression
        parts = []
        with self._compress_lock:
            codec = codec_id(compression.params.type)
            for key, values in groups:
                value = values[0] if len(values) == 1 else self._merge(key, values)
                flat = np.ascontiguousarray(arrays.asnumpy(value)).reshape(-1)
                for index, part in enumerate(self._layouts[key].parts):
                    packed = compression.quantize((key, index), flat[part.start:part.stop])
                    parts.append((part.server, part.id, packed))
        handle = NodeHandle("push", self._worker)
        # the packed arrays are new: handed over, not copied
        self._worker.push(parts, priority, False, handle, codec)
        return handle

    def _merge(self, key: Hashable, values: list[Any]) -> np.ndarray:
        """Sum per-device values into a new host array (on the first value's GPU for dist_device_sync).

        dist_device_sync keeps one buffer per key on that GPU, so a step allocates nothing there;
        the copy to the host waits for the sum, so the buffer is free again when this returns.
        """
        home = arrays.device_of(values[0])
        if self._merge_on_device and home.is_gpu:
            with self._merge_lock, arrays.device_context(home):
                total = self._merge_buffers.get(key)
                if total is None or arrays.device_of(total) != home or total.shape != values[0].shape:
                    total = self._merge_buffers[key] = arrays.empty(values[0].shape, values[0].dtype, home)
                total[...] = values[0]
                for value in values[1:]:
                    total += value if arrays.device_of(value) == home else arrays.to_device(value, home)
                return np.ascontiguousarray(arrays.asnumpy(total))
        total = np.array(arrays.asnumpy(values[0]), copy=True)
        for value in values[1:]:
            total += arrays.asnumpy(value)
        return total

    @maps_runtime_errors
    def _pull_groups(self, groups: list[tuple[Hashable, list[Any]]], priority: int) -> Handle:
        self._settle()
        if self._pull_codec is not None:
            return self._pull_encoded(groups, priority)
        parts = []
        copies: list[tuple[np.ndarray, list[Any]]] = []
        whole = self._whole
        for key, outs in groups:
            first = outs[0]
            direct = len(outs) == 1 and type(first) is np.ndarray and first.flags.c_contiguous and first.flags.writeable
            if direct and key in whole:
                parts.append((*whole[key], first))
                continue
            lay = self._layouts[key]
            if direct:
                flat = first.reshape(-1)
            else:
                flat = np.empty(lay.shape, lay.dtype).reshape(-1)
                copies.append((flat, outs))
            for part in lay.parts:
                parts.append((part.server, part.id, flat[part.start:part.stop]))
        handle = NodeHandle("pull", self._worker)
        if not copies:
            self._worker.pull(parts, priority, handle)
            return handle
        return self._pull_then(parts, priority, handle, lambda: _deliver(copies))

    def _pull_encoded(self, groups: list[tuple[Hashable, list[Any]]], priority: int) -> Handle:
        """Pull with float32 values at half width (``'pull'`` of the compression parameters): each
        part's reply lands in a uint16 buffer of its own and is decoded into the outs (other dtypes
        come raw)."""
        width = self._compression.params.pull
        parts, codecs = [], []
        decodes: list[tuple[np.ndarray, np.ndarray]] = []  # (half-width bits, where they decode to)
        copies: list[tuple[np.ndarray, list[Any]]] = []
        for key, outs in groups:
            lay = self._layouts[key]
            first = outs[0]
            if len(outs) == 1 and type(first) is np.ndarray and first.flags.c_contiguous and first.flags.writeable:
                flat = first.reshape(-1)
            else:
                flat = np.empty(lay.shape, lay.dtype).reshape(-1)
                copies.append((flat, outs))
            encoded = lay.dtype == np.float32
            for part in lay.parts:
                target = flat[part.start:part.stop]
                if encoded:
                    bits = np.empty(part.stop - part.start, np.uint16)
                    decodes.append((bits, target))
                    target = bits
                parts.append((part.server, part.id, target))
                codecs.append(self._pull_codec if encoded else RAW)

        def deliver() -> None:
            for bits, target in decodes:
                target[...] = from_half(width, bits)
            _deliver(copies)

        return self._pull_then(parts, priority, NodeHandle("pull", self._worker), deliver, codecs)

    def _pull_then(self, parts: list, priority: int, handle: NodeHandle, deliver: Any, codecs: Any = None) -> Handle:
        """Pull ``parts``; ``deliver()`` runs once they are in, before ``handle`` is done."""
        inner: concurrent.futures.Future = concurrent.futures.Future()
        chain(inner, handle, deliver)  # a GPU copy that fails goes to the waiter
        self._worker.pull(parts, priority, inner, codecs)
        return handle

    @maps_runtime_errors
    def _pull_rows(self, requests: list[tuple[Hashable, np.ndarray]], priority: int) -> list[Any]:
        self._settle()
        parts = []
        results = []
        dense: list[tuple[int, KeyLayout, np.ndarray]] = []
        for key, rows in requests:
            lay = self._layouts[key]
            row_size = lay.row_size
            if lay.split and row_size == 0:  # split by elements: rows do not align, pull the key whole
                flat = np.empty(lay.shape, lay.dtype).reshape(-1)
                for part in lay.parts:
                    parts.append(("dense", part.server, part.id, flat[part.start:part.stop]))
                dense.append((len(results), lay, rows))
                results.append(flat)
                continue
            block = np.empty((len(rows), row_size), lay.dtype)
            for part in lay.parts:
                first, last = (part.start // row_size, part.stop // row_size) if lay.split else (0, lay.shape[0] if lay.shape else 1)
                lo, hi = np.searchsorted(rows, [first, last])
                if hi > lo:
                    parts.append(("rows", part.server, part.id, rows[lo:hi] - first, block[lo:hi]))
            results.append(block.reshape((len(rows),) + lay.shape[1:]))
        row_parts = [p[1:] for p in parts if p[0] == "rows"]
        dense_parts = [p[1:] for p in parts if p[0] == "dense"]
        futures = []
        if row_parts:
            futures.append(self._worker.pull_rows(row_parts, priority))
        if dense_parts:
            futures.append(self._worker.pull(dense_parts, priority))
        for future in futures:
            self.wait_for(future)
        for i, lay, rows in dense:
            results[i] = results[i].reshape(lay.shape)[rows]
        return results



def _deliver(copies: list[tuple[np.ndarray, list[Any]]]) -> None:
    """Copy each pulled flat value into its outs (a list of outs, a GPU or non-contiguous out)."""
    for flat, outs in copies:
        for out in outs:
            arrays.copy_into(out, flat.reshape(out.shape))


def create(name: str) -> DistKVStore:
    """The factory the registry calls for ``dist_sync``, ``dist_async`` and ``dist_device_sync``."""
    return DistKVStore(name)
