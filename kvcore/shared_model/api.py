"""The shared model: mshadow-ps's ``ISharedModel`` for Python, over numpy or CuPy arrays.

A training process drives one model from one thread per device (or one thread for all). Each step,
each device pushes a layer's gradient as soon as backprop produced it and asks for the result with
``pull_req``; it waits with ``pull_wait`` only before it needs that layer again. Per-device push and
pull threads do the copies and the aggregation meanwhile, highest priority first.

Two levels: Level 1 (``level1``) combines the pushes of every device of the process (strict BSP: a
pull of a key completes only when every device pushed it); Level 2 (``level2``, the 'dist' model)
sends only that combined value to the parameter servers and pulls the servers' answer back
asynchronously.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Iterable

import numpy as np

from .. import arrays
from ..errors import KeyTypeError
from .checks import as_shape, check_array, check_ids, check_updater_config, resolve_device_kind
from .config import SharedModelConfig
from .errors import (
    ConfigError,
    KeyNotInitialisedError,
    KeyShapeError,
    PullFailedError,
    SharedModelError,
    StateError,
    UnknownDeviceError,
    WeightMismatchError,
)
from .level1 import KeyState, Level1Buffers, nccl_group
from .pulls import PullSide, PullTask
from .queues import PriorityWorkQueue, QueueClosed, WorkerThread
from .updater import ModelUpdater, ServerUpdater

__all__ = ["SharedModel", "create_shared_model", "MODEL_KINDS"]

MODEL_KINDS = ("local", "dist")


def create_shared_model(kind: str = "local", updater: ModelUpdater | None = None, **params: Any) -> "SharedModel":
    """Create a shared model: ``'local'`` (the devices of this process) or ``'dist'`` (also across
    processes, through the parameter servers).

    ``updater`` is the ``ModelUpdater`` that applies merged gradients (required for 'dist');
    ``params`` are passed to ``set_param`` one by one (``push_op`` may be given as a dict).

    Raises:
        ConfigError: an unknown kind (the message lists the known ones) or parameter.
    """
    if kind not in MODEL_KINDS:
        raise ConfigError(f"unknown shared model kind {kind!r}; known kinds: {', '.join(MODEL_KINDS)}")
    model = SharedModel(kind, updater=updater)
    for name, value in params.items():
        if name == "push_op" and isinstance(value, dict):
            for key, op in value.items():
                model.set_param(f"push_op[{key}]", op)
        else:
            model.set_param(name, value)
    return model


class _PushTask:
    def __init__(self, ks: KeyState, wid: int, data: Any, round_no: int, priority: int, event: Any, worker: WorkerThread):
        self.ks, self.wid, self.data, self.round_no = ks, wid, data, round_no
        self.priority, self.event, self.worker = priority, event, worker
        self.run: Callable[["_PushTask"], None] | None = None

    def __call__(self) -> None:
        self.run(self)


class SharedModel(PullSide):
    """A model shared by the devices of a process ('local') and by processes ('dist').

    Life cycle: ``set_param`` ... -> ``init(devices)`` -> ``init_key`` per key and device ->
    ``push`` / ``pull_req`` / ``pull_wait`` ... -> ``close()`` (or use it as a context manager).

    Thread-safety: every method may be called from any thread; the usual pattern is one training
    thread per device, each passing its own device id.

    Buffers: an array given to ``push`` must stay unchanged until the device's next ``pull_wait``
    on that key returned (it is copied by the push thread later); an array given to ``pull_req``
    must stay alive and untouched until ``pull_wait`` returned.
    """

    def __init__(self, kind: str = "local", updater: ModelUpdater | None = None, store: Any = None) -> None:
        if kind not in MODEL_KINDS:
            raise ConfigError(f"unknown shared model kind {kind!r}; known kinds: {', '.join(MODEL_KINDS)}")
        self.kind = kind
        self.config = SharedModelConfig()
        self._updater = updater
        self._store = store  # a dist KVStore handed in; else 'dist' creates one at init
        self._cond = threading.Condition()
        self._update_lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._state = "new"
        self._ids: list[int] = []
        self._index: dict[int, int] = {}
        self._devices: list[arrays.Device] = []
        self._keys: dict[Hashable, KeyState] = {}
        self._push_workers: list[WorkerThread] = []
        self._pull_workers: list[WorkerThread] = []
        self._weights: dict[Hashable, Any] = {}
        self._results: dict[Hashable, list[Any]] = {}
        self._nccl: Any = None
        self._bridge: Any = None

    # ---- configuration ----------------------------------------------------------------------
    def set_param(self, name: str, value: Any) -> None:
        """Set a parameter (see ``config.SharedModelConfig``); only before ``init``.

        Raises:
            ConfigError: unknown name or value. StateError: called after ``init``.
        """
        if self._state != "new":
            raise StateError(f"set_param({name!r}, {value!r}) after init(); set parameters before init")
        self.config.apply(name, value)

    def set_updater(self, updater: ModelUpdater) -> None:
        """Use ``updater`` for ``update_on_server=1`` (in the process, or shipped to the servers)."""
        if self._state != "new":
            raise StateError("set_updater after init(); give the updater before init")
        if not isinstance(updater, ModelUpdater):
            raise ConfigError(f"the updater must be a kvcore.ModelUpdater, got {type(updater).__name__}")
        self._updater = updater

    @property
    def devices(self) -> list[int]:
        """The device ids given to ``init``."""
        return list(self._ids)

    @property
    def update_on_server(self) -> int:
        """1 when pulls return weights an updater produced, 0 when they return the combined pushes."""
        if self.config.update_on_server is not None:
            return self.config.update_on_server
        return 1 if self.kind == "dist" else 0

    @property
    def rank(self) -> int:
        """This process's worker rank (0 for 'local')."""
        return self._bridge.rank if self._bridge is not None else 0

    @property
    def num_workers(self) -> int:
        """Number of worker processes sharing the model (1 for 'local')."""
        return self._bridge.num_workers if self._bridge is not None else 1

    @property
    def dist_store(self) -> Any:
        """The distributed KVStore of a 'dist' model after ``init``; None before, or for 'local'."""
        return self._bridge.store if self._bridge is not None else None

    @property
    def nccl_allreduces(self) -> int:
        """How many Level-1 sums NCCL ran so far (0 when the model does not use NCCL)."""
        return self._nccl.allreduces if self._nccl is not None else 0

    def device(self, devid: int) -> arrays.Device:
        """The kvcore device behind device id ``devid``: ``gpu(devid)``, or CPU slot ``cpu(devid)``."""
        return self._devices[self._wid(devid)]

    # ---- set up -----------------------------------------------------------------------------
    def init(self, devices: Iterable[int] = (0,)) -> None:
        """Start the model for the device ids ``devices`` (the ids later calls pass as ``dev``).

        Ids are GPU numbers when the model runs on GPUs (``set_param('device', ...)``: 'auto'
        picks GPUs when CuPy sees one), else names of CPU slots. Starts the push and pull threads;
        a 'dist' model connects to the distributed store and ships its updater to the servers.

        Raises:
            StateError: init ran already. ConfigError: bad ids, contradicting parameters, 'dist'
                without an updater or without a distributed store.
        """
        if self._state != "new":
            raise StateError(f"init() was already called (devices {self._ids}); call it once")
        ids = check_ids(devices)
        check_updater_config(self.kind, self.update_on_server, self._updater, self.config)
        use_gpu = resolve_device_kind(self.config.device, ids)
        self._devices = [arrays.gpu(i) if use_gpu else arrays.Device("cpu", i) for i in ids]
        self._ids = ids
        self._index = {devid: wid for wid, devid in enumerate(ids)}
        self._nccl = nccl_group(self.config.nccl, use_gpu, ids)
        self._push_workers = self._start_workers("push", self.config.push_thread)
        self._pull_workers = self._start_workers("pull", self.config.pull_thread)
        self._state = "ready"
        if self.kind == "dist":
            try:
                self._bridge = self._make_bridge()
            except BaseException:
                self.close()
                raise

    def _start_workers(self, role: str, mode: str) -> list[WorkerThread]:
        names = [f"shared-model-{role}-dev{d}" for d in self._ids] if mode == "ndev" else [f"shared-model-{role}"]
        workers = [WorkerThread(name, PriorityWorkQueue(), self._task_failed) for name in names]
        for worker in workers:
            worker.start()
        return workers

    def _make_bridge(self) -> Any:
        from ..errors import UnknownStoreError
        from ..stores.registry import create
        from .level2 import Level2Bridge

        store, owned = self._store, False
        if store is None:
            try:
                store = create(self.config.store)
            except UnknownStoreError as exc:
                raise ConfigError(
                    f"a 'dist' model needs the distributed KVStore {self.config.store!r}, which is not "
                    f"available here: {exc}"
                ) from exc
            owned = True
        return Level2Bridge(
            store,
            ServerUpdater(self._updater),
            publish=self._publish,
            fail=self._fail_key,
            timeout=self.config.timeout,
            owns_store=owned,
        )

    def init_key(self, shape: Any, key: Hashable, dev: int, dtype: Any = np.float32) -> None:
        """Declare ``key`` with ``shape`` (and ``dtype``) on device ``dev``; needed before using it there.

        The first device to declare a key creates it (with 'dist', in the distributed store, and
        pulls its starting weights); every other device must give the same shape and dtype. Safe
        to call again with the same values. With 'dist', creating a key is collective: every
        process must declare its keys in the same order.

        Raises:
            StateError, UnknownDeviceError, KeyTypeError; KeyShapeError when the shape or dtype
            differs from the key's (the message names both).
        """
        self._require_ready("init_key")
        wid = self._wid(dev)
        if isinstance(key, bool) or not isinstance(key, (int, np.integer, str)):
            raise KeyTypeError(f"shared-model keys are ints or strs, got {key!r} of type {type(key).__name__}")
        key = int(key) if isinstance(key, np.integer) else key
        shape = as_shape(shape, key)
        dtype = np.dtype(dtype)
        # One key is created at a time, and a device that declares a key being created waits until
        # it exists: for 'dist' this makes every process create keys in the store in the order its
        # devices first declare them, which the store's collective init needs.
        with self._init_lock:
            self._init_key(shape, key, wid, dev, dtype)

    def _init_key(self, shape: tuple[int, ...], key: Hashable, wid: int, dev: int, dtype: np.dtype) -> None:
        with self._cond:
            ks = self._keys.get(key)
            if ks is not None:
                if ks.shape != shape or ks.dtype != dtype:
                    raise KeyShapeError(
                        f"key {key!r} was initialised with shape {ks.shape} and dtype {ks.dtype}; device {dev} "
                        f"asked for shape {shape} and dtype {dtype}"
                    )
                ks.registered.add(wid)
                return
            op = self.config.push_op(key)
            if op == "gather" and self.update_on_server:
                raise ConfigError(f"key {key!r}: push_op 'gather' needs update_on_server=0 (an updater sums gradients)")
        # No other device can use the key meanwhile: init_key runs under _init_lock, and the key is
        # registered only once its buffers exist.
        buffers = Level1Buffers(self._devices, shape, dtype, op, self._nccl)
        buffers.allocate()
        with self._cond:
            ks = KeyState(key, shape, dtype, buffers)
            self._keys[key] = ks
            if self.update_on_server:
                # round 0 is the starting weights; version 0 holds it until round 2 needs it back
                ks.claim(0, 0)
                ks.version_state[0] = "reducing"
            ks.registered.add(wid)
        try:
            if self.update_on_server and self.kind == "local":
                self._init_local_weights(ks)
            elif self.kind == "dist":
                self._bridge.init_key(ks)
        except BaseException:
            with self._cond:
                self._keys.pop(key, None)
            raise

    def _init_local_weights(self, ks: KeyState) -> None:
        root = self._devices[0]
        weight = arrays.zeros(ks.shape, ks.dtype, root)
        with self._update_lock, arrays.device_context(root):
            self._updater._bind(ks.key, weight)
            self._updater.init_model(ks.key, weight)
        self._weights[ks.key] = weight
        self._results[ks.key] = [arrays.empty(ks.shape, ks.dtype, root) for _ in range(2)]
        with arrays.device_context(root):
            arrays.copy_into(self._results[ks.key][0], weight)
            arrays.synchronize_stream(root)
        self._publish(ks, 0, 0, [self._results[ks.key][0]] * ks.ndev)

    # ---- push -------------------------------------------------------------------------------
    def push(self, data: Any, key: Hashable, dev: int, priority: int = 0) -> None:
        """Push ``data`` (device ``dev``'s value of ``key``); returns at once.

        The push thread of ``dev`` copies ``data`` later (highest priority first); once every
        device pushed the key, Level 1 combines the pushes (sum or gather), and with 'dist' Level 2
        sends the result to the servers. Keep ``data`` unchanged until the next ``pull_wait`` of
        this key on this device returned.

        Raises:
            KeyNotInitialisedError, KeyShapeError, UnknownDeviceError, StateError;
            PullFailedError when the key failed earlier.
        """
        self._require_ready("push")
        wid = self._wid(dev)
        ks = self._key_for(key, wid, "push")
        check_array(data, ks.shape, ks.dtype, key, dev, "push", self._devices[wid])
        event = arrays.record_event(data)  # the push thread's stream waits for the kernels that made data
        worker = self._worker(self._push_workers, wid)
        with self._cond:
            if ks.error is not None:
                raise PullFailedError(f"push of key {key!r} on device {dev}: the key failed earlier: {ks.error}") from ks.error
            ks.pushed[wid] += 1
            task = _PushTask(ks, wid, data, ks.pushed[wid], int(priority), event, worker)
            task.run = self._run_push
        self._enqueue(worker, task, int(priority))

    def _run_push(self, task: _PushTask) -> None:
        ks, wid = task.ks, task.wid
        version = task.round_no % 2
        with self._cond:
            if ks.error is not None or self._state != "ready":
                return
            if not ks.can_claim(version, task.round_no):
                # the buffer is still read by round n-2: park the task, it is re-queued when freed
                ks.deferred.append(task)
                return
            ks.claim(version, task.round_no)
            slot = ks.buffers.slot(version, wid)
        device = self._devices[wid]
        with arrays.device_context(device), arrays.stream_context(task.worker.stream_for(device)):
            arrays.wait_event(task.event)
            arrays.peer_copy(slot, task.data)
            arrays.synchronize_stream(device)
        with self._cond:
            ks.arrived[version] += 1
            last = ks.arrived[version] == ks.ndev
            if last:
                ks.version_state[version] = "reducing"
        if last:
            # The sum and the update run on this thread's own stream of the first device, not behind
            # the training kernels queued on that device's default stream.
            root = ks.buffers.root
            with arrays.device_context(root), arrays.stream_context(task.worker.stream_for(root)):
                sources = ks.buffers.reduce(version)
                self._round_complete(ks, task.round_no, version, sources, task.priority)

    def _round_complete(self, ks: KeyState, round_no: int, version: int, sources: list[Any], priority: int) -> None:
        if self.kind == "dist":
            self._bridge.submit(ks, round_no, version, sources, priority)
        elif self.update_on_server:
            self._apply_local_update(ks, round_no, version, sources[0])
        else:
            self._publish(ks, round_no, version, sources)

    def _apply_local_update(self, ks: KeyState, round_no: int, version: int, grad: Any) -> None:
        root = self._devices[0]
        weight = self._weights[ks.key]
        result = self._results[ks.key][version]
        with self._update_lock, arrays.device_context(root):
            if arrays.device_of(grad) != root:
                grad = arrays.to_device(grad, root)
            self._updater._bind(ks.key, weight)
            self._updater.update(ks.key, grad)
            arrays.copy_into(result, weight)
            arrays.synchronize_stream(root)
        self._publish(ks, round_no, version, [result] * ks.ndev)

    # ---- debugging and shutdown -------------------------------------------------------------
    def check_weight(self, data: Any, key: Hashable, dev: int, rtol: float = 0.0, atol: float = 0.0) -> None:
        """Check that ``data`` on device ``dev`` equals the model's current value of ``key``.

        The model's value is the weights (in the process, or pulled from the servers for 'dist')
        with ``update_on_server=1``, else the newest combined result. For debugging: it blocks.

        Raises:
            WeightMismatchError: the arrays differ (the message gives the largest difference and
                where); SharedModelError when there is nothing to compare with yet.
        """
        self._require_ready("check_weight")
        wid = self._wid(dev)
        ks = self._key_for(key, wid, "check_weight")
        check_array(data, ks.buffers.result_shape, ks.dtype, key, dev, "check_weight", self._devices[wid])
        reference = self._current_value(ks, wid, "check_weight")
        mine = arrays.asnumpy(data)
        if not np.allclose(mine, reference, rtol=rtol, atol=atol, equal_nan=True):
            diff = np.abs(mine.astype(np.float64) - reference.astype(np.float64))
            where = np.unravel_index(int(np.nanargmax(diff)), diff.shape) if diff.size else ()
            raise WeightMismatchError(
                f"check_weight(key={key!r}, dev={dev}): the array differs from the model's value; largest "
                f"difference {float(np.nanmax(diff)):g} at index {tuple(int(i) for i in where)} "
                f"({mine[where].item()!r} here, {reference[where].item()!r} in the model)"
            )

    def get_weight(self, key: Hashable, dev: int) -> np.ndarray:
        """A host copy of the model's current value of ``key``, as ``check_weight`` compares with.

        For 'dist' this pulls from the servers now (blocking, with the timeout), so after
        ``barrier()`` it sees every worker's pushes; pull_req instead returns the result of the
        round that holds this device's latest push. For inspection and tests.
        """
        self._require_ready("get_weight")
        wid = self._wid(dev)
        return self._current_value(self._key_for(key, wid, "get_weight"), wid, "get_weight")

    def _current_value(self, ks: KeyState, wid: int, op: str) -> np.ndarray:
        if self.kind == "dist":
            return self._bridge.fetch(ks)
        if self.update_on_server:
            with self._update_lock:
                return arrays.asnumpy(self._weights[ks.key]).copy()
        with self._cond:
            if not ks.published_ok:
                raise SharedModelError(f"{op}(key={ks.key!r}, dev={self._ids[wid]}): no complete round to compare with yet")
            return arrays.asnumpy(ks.sources[ks.published_version][wid]).copy()

    def barrier(self) -> None:
        """'dist': wait until this process's Level-2 traffic is answered, then for every worker.

        A no-op for 'local'.
        """
        self._require_ready("barrier")
        if self._bridge is not None:
            self._bridge.barrier()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads and release the buffers; pulls still outstanding fail. Idempotent."""
        with self._cond:
            if self._state == "closed":
                return
            self._state = "closed"
            for ks in self._keys.values():
                for request in ks.requests:
                    if request is not None and not request.done.is_set():
                        request.error = StateError(f"pull of key {ks.key!r} on device {self._ids[request.wid]}: model closed")
                        request.done.set()
            self._cond.notify_all()
        for worker in self._push_workers + self._pull_workers:
            worker.queue.close()
        for worker in self._push_workers + self._pull_workers:
            worker.join(timeout)
        if self._bridge is not None:
            self._bridge.close(timeout)
        if self._nccl is not None:
            self._nccl.close()

    def __enter__(self) -> "SharedModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers ----------------------------------------------------------------------------
    def _require_ready(self, op: str) -> None:
        if self._state == "new":
            raise StateError(f"{op} before init(devices); call init first")
        if self._state == "closed":
            raise StateError(f"{op} on a closed shared model")

    def _wid(self, dev: int) -> int:
        wid = self._index.get(dev) if isinstance(dev, (int, np.integer)) and not isinstance(dev, bool) else None
        if wid is None:
            raise UnknownDeviceError(f"device id {dev!r} was not given to init(); the model's devices are {self._ids}")
        return wid

    def _key_for(self, key: Hashable, wid: int, op: str) -> KeyState:
        with self._cond:
            ks = self._keys.get(key)
            if ks is None or wid not in ks.registered:
                dev = self._ids[wid]
                raise KeyNotInitialisedError(
                    f"{op} of key {key!r} on device {dev}, which has not run init_key(shape, {key!r}, {dev}) yet"
                )
            return ks

    def _worker(self, workers: list[WorkerThread], wid: int) -> WorkerThread:
        return workers[wid] if len(workers) > 1 else workers[0]

    def _enqueue(self, worker: WorkerThread, task: Any, priority: int) -> None:
        try:
            worker.queue.put(task, priority)
        except QueueClosed as exc:
            raise StateError("the shared model is closed") from exc

    def _task_failed(self, task: Any, exc: BaseException) -> None:
        if isinstance(task, _PushTask):
            self._fail_key(task.ks, exc, f"copying device {self._ids[task.wid]}'s push of round {task.round_no}")
        elif isinstance(task, PullTask):
            self._finish_pull(task.ks, task.request, exc, "the pull")

    def _fail_key(self, ks: KeyState, exc: BaseException, what: str) -> None:
        """Stop ``ks``: every outstanding pull of it fails with an error that names the cause."""
        with self._cond:
            if ks.error is None:
                error = PullFailedError(f"key {ks.key!r}: {what} failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                ks.error = error
            for request in ks.requests:
                if request is not None and not request.done.is_set():
                    request.error = ks.error
                    request.done.set()
            ks.deferred = []
            self._cond.notify_all()
