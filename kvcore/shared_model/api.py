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
import time
from typing import Any, Callable, Hashable, Iterable

import numpy as np

from .. import arrays
from ..errors import KeyTypeError
from .config import SharedModelConfig
from .errors import (
    ConfigError,
    DuplicatePullError,
    KeyNotInitialisedError,
    KeyShapeError,
    PullFailedError,
    PullTimeoutError,
    SharedModelError,
    StateError,
    UnknownDeviceError,
    WeightMismatchError,
)
from .level1 import KeyState, Level1Buffers, PullRequest
from .queues import PriorityWorkQueue, QueueClosed, WorkerThread
from .updater import ModelUpdater, ServerUpdater

__all__ = ["SharedModel", "create_shared_model", "MODEL_KINDS"]

MODEL_KINDS = ("local", "dist")

# pull_wait wakes this often to check that the work it waits for can still happen
_LIVENESS_SLICE = 0.2


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


class _PullTask:
    def __init__(self, ks: KeyState, request: PullRequest, worker: WorkerThread):
        self.ks, self.request, self.worker = ks, request, worker
        self.run: Callable[["_PullTask"], None] | None = None

    def __call__(self) -> None:
        self.run(self)


class SharedModel:
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
        ids = self._check_ids(devices)
        self._check_updater_config()
        use_gpu = self._resolve_device_kind(ids)
        self._devices = [arrays.gpu(i) if use_gpu else arrays.Device("cpu", i) for i in ids]
        self._ids = ids
        self._index = {devid: wid for wid, devid in enumerate(ids)}
        self._nccl = self._make_nccl(use_gpu, ids)
        self._push_workers = self._start_workers("push", self.config.push_thread)
        self._pull_workers = self._start_workers("pull", self.config.pull_thread)
        self._state = "ready"
        if self.kind == "dist":
            try:
                self._bridge = self._make_bridge()
            except BaseException:
                self.close()
                raise

    def _check_ids(self, devices: Iterable[int]) -> list[int]:
        ids = list(devices) if not isinstance(devices, int) else [devices]
        if not ids:
            raise ConfigError("init() needs at least one device id, got an empty list")
        for devid in ids:
            if isinstance(devid, bool) or not isinstance(devid, (int, np.integer)) or devid < 0:
                raise ConfigError(f"device ids are ints >= 0, got {devid!r} in {ids!r}")
        ids = [int(d) for d in ids]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"device ids must be distinct, got {ids}")
        return ids

    def _check_updater_config(self) -> None:
        on_server = self.update_on_server
        if self.kind == "dist":
            if on_server == 0:
                raise ConfigError(
                    "a 'dist' model updates on the servers: update_on_server=0 is not supported; "
                    "leave it at 1 and give a ModelUpdater"
                )
            if self._updater is None:
                raise ConfigError(
                    "a 'dist' model needs a ModelUpdater: pass create_shared_model('dist', updater=...) "
                    "or call set_updater() before init; the servers apply it to every merged push"
                )
            gathered = [k for k, op in self.config.push_ops.items() if op == "gather"]
            if gathered:
                raise ConfigError(f"push_op 'gather' is only supported by a 'local' model; keys {gathered} ask for it")
        elif on_server == 1 and self._updater is None:
            raise ConfigError("update_on_server=1 needs a ModelUpdater: pass updater= or call set_updater() before init")
        elif on_server == 0 and self._updater is not None:
            raise ConfigError(
                "a ModelUpdater was given but update_on_server=0 (pulls return the summed pushes and "
                "the updater would never run); set update_on_server=1 or drop the updater"
            )

    def _resolve_device_kind(self, ids: list[int]) -> bool:
        mode = self.config.device
        if mode == "cpu":
            return False
        if mode == "auto" and not arrays.gpu_available():
            return False
        count = arrays.num_gpus()
        if count == 0:
            raise ConfigError("set_param('device', 'gpu') was given, but no usable GPU was found (CuPy sees none)")
        too_big = [d for d in ids if d >= count]
        if too_big:
            raise UnknownDeviceError(f"device id(s) {too_big} name GPUs that do not exist: this machine has {count} GPU(s)")
        return True

    def _make_nccl(self, use_gpu: bool, ids: list[int]) -> Any:
        mode = self.config.nccl
        if not use_gpu or len(ids) < 2 or mode == "off":
            return None
        if not arrays.nccl_available():
            if mode == "on":
                raise ConfigError("set_param('nccl', 'on') was given, but CuPy's NCCL binding is not usable here")
            return None
        return arrays.NcclGroup(ids)

    def _start_workers(self, role: str, mode: str) -> list[WorkerThread]:
        names = [f"shared-model-{role}-dev{d}" for d in self._ids] if mode == "ndev" else [f"shared-model-{role}"]
        workers = [WorkerThread(name, PriorityWorkQueue(), self._task_failed) for name in names]
        for worker in workers:
            worker.start()
        return workers

    def _make_bridge(self) -> Any:
        from ..errors import UnknownStoreError
        from ..registry import create
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
        shape = _as_shape(shape, key)
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
            ks = KeyState(key, shape, dtype, Level1Buffers(self._devices, shape, dtype, op, self._nccl))
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
        _check_array(data, ks.shape, ks.dtype, key, dev, "push")
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
            with arrays.device_context(ks.buffers.root):
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

    # ---- results and pulls --------------------------------------------------------------------
    def _publish(self, ks: KeyState, round_no: int, version: int, sources: list[Any]) -> None:
        """Round ``round_no`` of ``ks`` is readable in ``sources``: serve the pulls that wait for it."""
        with self._cond:
            ks.sources[version] = sources
            ks.version_state[version] = "published"
            if round_no > ks.published_round:
                ks.published_round, ks.published_version, ks.published_ok = round_no, version, True
            for request in ks.requests:
                if request is not None and request.version is None and not request.done.is_set():
                    if request.need_round <= round_no:
                        self._schedule_pull(ks, request, version)
            self._release_deferred(ks)
            self._cond.notify_all()

    def _schedule_pull(self, ks: KeyState, request: PullRequest, version: int) -> None:
        # caller holds self._cond
        request.version = version
        ks.readers[version] += 1
        worker = self._worker(self._pull_workers, request.wid)
        task = _PullTask(ks, request, worker)
        task.run = self._run_pull
        try:
            worker.queue.put(task, request.priority)
        except QueueClosed:
            ks.readers[version] -= 1

    def _release_deferred(self, ks: KeyState) -> None:
        # caller holds self._cond
        waiting, ks.deferred = ks.deferred, []
        for task in waiting:
            try:
                task.worker.queue.put(task, task.priority)
            except QueueClosed:  # closing: the push is dropped with everything else queued
                return

    def pull_req(
        self,
        data: Any,
        key: Hashable,
        dev: int,
        priority: int = 0,
        callback: Callable[[], Any] | None = None,
    ) -> None:
        """Ask for ``key``'s result to be written into ``data``; returns at once.

        The pull completes with the round that holds this device's latest push of the key (or,
        when it pushed nothing yet, the newest result there is). The pull thread of ``dev`` writes
        the result into ``data``, then runs ``callback()`` with ``dev`` made current
        (``kvcore.arrays.current_device()``; the CUDA device for a GPU). ``pull_wait`` blocks until
        both are done. Keep ``data`` alive and untouched until then.

        Raises:
            KeyNotInitialisedError, KeyShapeError, UnknownDeviceError, StateError;
            DuplicatePullError when this device's previous pull of the key has not finished;
            PullFailedError when the key failed, or an earlier pull failed and was never waited for.
        """
        self._require_ready("pull_req")
        wid = self._wid(dev)
        ks = self._key_for(key, wid, "pull_req")
        _check_array(data, ks.buffers.result_shape, ks.dtype, key, dev, "pull_req")
        if callback is not None and not callable(callback):
            raise ConfigError(f"pull_req(key={key!r}, dev={dev}): callback must be callable, got {callback!r}")
        with self._cond:
            previous = ks.requests[wid]
            if previous is not None and not previous.done.is_set():
                raise DuplicatePullError(
                    f"pull_req of key {key!r} on device {dev} while its previous pull of that key is still "
                    f"running; call pull_wait({key!r}, {dev}) first"
                )
            if previous is not None and previous.error is not None and not previous.reported:
                previous.reported = True
                raise PullFailedError(
                    f"an earlier pull of key {key!r} on device {dev} failed and was never waited for: {previous.error}"
                ) from previous.error
            if ks.error is not None:
                raise PullFailedError(f"pull_req of key {key!r} on device {dev}: the key failed earlier: {ks.error}") from ks.error
            request = PullRequest(data, wid, ks.pushed[wid], int(priority), callback)
            ks.requests[wid] = request
            if ks.published_ok and ks.published_round >= request.need_round:
                self._schedule_pull(ks, request, ks.published_version)

    def _run_pull(self, task: _PullTask) -> None:
        ks, request = task.ks, task.request
        device = self._devices[request.wid]
        try:
            if request.done.is_set():  # failed while queued
                return
            source = ks.sources[request.version][request.wid]
            with arrays.device_context(device), arrays.stream_context(task.worker.stream_for(device)):
                arrays.peer_copy(request.data, source)
                arrays.synchronize_stream(device)
        except BaseException as exc:
            self._finish_pull(ks, request, exc, "copying the result into the pulled array")
            return
        finally:
            with self._cond:
                ks.readers[request.version] -= 1
                if ks.readers[request.version] == 0:
                    self._release_deferred(ks)
        error = None
        if request.callback is not None:
            try:
                with arrays.device_context(device), arrays.stream_context(task.worker.stream_for(device)):
                    request.callback()
                    arrays.synchronize_stream(device)
            except BaseException as exc:
                error = exc
        self._finish_pull(ks, request, error, "the pull's callback")

    def _finish_pull(self, ks: KeyState, request: PullRequest, exc: BaseException | None, what: str) -> None:
        with self._cond:
            if request.done.is_set():
                return
            if exc is not None:
                error = PullFailedError(
                    f"pull of key {ks.key!r} on device {self._ids[request.wid]}: {what} raised {type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
                request.error = error
            request.done.set()
            self._cond.notify_all()

    def pull_wait(self, key: Hashable, dev: int, timeout: float | None = None) -> None:
        """Block until device ``dev``'s pull of ``key`` is done; return at once when none is outstanding.

        Gives up after ``timeout`` seconds (default: ``set_param('timeout', ...)``, 120 s) with an
        error that says what the pull still waits for: devices that have not pushed, the
        distributed store, or a busy pull thread. The pull itself goes on.

        Raises:
            PullTimeoutError; PullFailedError when the pull, its callback or the key failed;
            StateError when the model is closed meanwhile; KeyNotInitialisedError, UnknownDeviceError.
        """
        self._require_ready("pull_wait")
        wid = self._wid(dev)
        ks = self._key_for(key, wid, "pull_wait")
        limit = self.config.timeout if timeout is None else float(timeout)
        with self._cond:
            request = ks.requests[wid]
        if request is None:
            return
        deadline = time.monotonic() + limit
        while not request.done.wait(max(0.0, min(_LIVENESS_SLICE, deadline - time.monotonic()))):
            if self._state != "ready":
                raise StateError(f"pull_wait(key={key!r}, dev={dev}): the model was closed while waiting")
            dead = [w.name for w in self._push_workers + self._pull_workers if not w.is_alive()]
            if dead:
                raise PullFailedError(f"pull_wait(key={key!r}, dev={dev}): worker thread(s) {dead} stopped")
            if time.monotonic() >= deadline:
                raise PullTimeoutError(
                    f"pull_wait(key={key!r}, dev={dev}) timed out after {limit:g} s: {self._diagnose(ks, request)}"
                )
        with self._cond:
            if request.error is not None and not request.reported:
                request.reported = True
                raise request.error

    def _diagnose(self, ks: KeyState, request: PullRequest) -> str:
        with self._cond:
            if request.version is not None:
                return (
                    f"the result is ready, but the copy is still queued on device {self._ids[request.wid]}'s pull "
                    "thread (a callback that blocks holds that thread up)"
                )
            missing = [self._ids[w] for w in ks.missing_devices(request.need_round)]
            if request.need_round == 0 and ks.published_round < 0:
                return (
                    f"nothing was pushed to key {ks.key!r} yet, and with update_on_server=0 a pull returns "
                    "the combined pushes of a round: push first"
                )
            if missing:
                return (
                    f"device(s) {missing} have not pushed key {ks.key!r} for round {request.need_round} yet; "
                    "Level 1 completes a pull only when every device has pushed the key"
                )
            if self.kind == "dist":
                return (
                    f"round {request.need_round} of key {ks.key!r} was combined on this process and sent to the "
                    "distributed store (Level 2), whose answer has not come back"
                )
            return f"round {request.need_round} of key {ks.key!r} is still being copied in on the devices' push threads"

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
        _check_array(data, ks.buffers.result_shape, ks.dtype, key, dev, "check_weight")
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
        elif isinstance(task, _PullTask):
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


def _as_shape(shape: Any, key: Hashable) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError as exc:
        raise KeyShapeError(f"init_key of key {key!r}: shape must be a tuple of ints, got {shape!r}") from exc
    if any(d < 0 for d in dims):
        raise KeyShapeError(f"init_key of key {key!r}: shape {dims} has a negative dimension")
    return dims


def _check_array(data: Any, shape: tuple[int, ...], dtype: np.dtype, key: Hashable, dev: int, op: str) -> None:
    if not arrays.is_array(data):
        raise KeyShapeError(f"{op} of key {key!r} on device {dev}: expected a numpy or CuPy array, got {type(data).__name__}")
    if tuple(data.shape) != shape:
        raise KeyShapeError(f"{op} of key {key!r} on device {dev}: the key has shape {shape}, the array has shape {tuple(data.shape)}")
    if np.dtype(data.dtype) != dtype:
        raise KeyShapeError(f"{op} of key {key!r} on device {dev}: the key has dtype {dtype}, the array has dtype {np.dtype(data.dtype)}")
