"""Level 2: the bridge from Level 1's combined values to the distributed KVStore.

Only the Level-1 result of a round crosses the network: one push per key and round per process,
whatever the number of devices. The servers apply the model's updater to what they receive
(``ServerUpdater``) and the bridge pulls the weights back without waiting; when the store answers,
the round is published to the devices' pull threads.

One thread (``shared-model-level2``) makes every call into the store, so the store is used from a
single thread as it expects, and rounds leave highest priority first. The store's answers arrive on
its own network thread, which only publishes.

GPU path: a round's result is copied once, on the bridge thread's own stream, into a pinned host
buffer kept per key (the store may reuse nothing of ours after push returns, so one buffer per key
suffices), and pulled into pinned host buffers kept per key and version, from which each device's
pull thread uploads at full bus speed. On the CPU the Level-1 buffer is pushed as it is.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Hashable

import numpy as np

from .. import arrays
from .errors import PullTimeoutError, SharedModelError, StateError
from .level1 import KeyState
from .queues import PriorityWorkQueue, QueueClosed, WorkerThread
from .updater import ServerUpdater

__all__ = ["Level2Bridge"]

# Key set-up and barriers jump the queue: they gate everything else.
_URGENT = 1 << 30


class Level2Bridge:
    """Moves Level-1 results to a distributed KVStore and publishes the servers' answers.

    Args:
        store: a KVStore whose ``push`` returns a handle without waiting for the server and whose
            ``pull(..., wait=False)`` returns a handle at once (``kvcore.create('dist_async')``).
        updater: shipped to the servers with ``store.set_updater``.
        publish: ``publish(ks, round, version, sources)``: hands a round to the pull threads.
        fail: ``fail(ks, exc, what)``: stops a key whose traffic failed.
        timeout: seconds the blocking calls (``init_key``, ``fetch``, ``barrier``) wait at most.
        owns_store: close the store in ``close``.
    """

    def __init__(
        self,
        store: Any,
        updater: ServerUpdater,
        publish: Callable[[KeyState, int, int, list[Any]], None],
        fail: Callable[[KeyState, BaseException, str], None],
        timeout: float,
        owns_store: bool = False,
    ) -> None:
        self._store = store
        self._publish = publish
        self._fail = fail
        self._timeout = timeout
        self._owns_store = owns_store
        self._send: dict[Hashable, np.ndarray] = {}
        self._recv: dict[Hashable, list[np.ndarray | None]] = {}
        self._inflight = 0
        self._idle = threading.Condition()
        store.set_updater(updater)  # the dist store ships it to the servers (collective)
        self._worker = WorkerThread("shared-model-level2", PriorityWorkQueue(), self._task_failed)
        self._worker.start()

    @property
    def store(self) -> Any:
        """The distributed KVStore the model's keys live in (``kvcore.elastic`` checkpoints it)."""
        return self._store

    @property
    def rank(self) -> int:
        """This worker's rank in the distributed store."""
        return int(self._store.rank)

    @property
    def num_workers(self) -> int:
        """Number of workers sharing the distributed store."""
        return int(self._store.num_workers)

    # ---- calls from the model ------------------------------------------------------------------
    def init_key(self, ks: KeyState) -> None:
        """Create ``ks.key`` in the store (zeros; the servers' ``init_model`` may change them) and
        ask for its starting weights, published as round 0. Blocks until the store took the key."""

        def create() -> None:
            self._store.init(ks.key, np.zeros(ks.shape, ks.dtype))
            self._pull_round(ks, 0, 0, _URGENT)

        self._call(create, f"initialising key {ks.key!r} in the distributed store")

    def submit(self, ks: KeyState, round_no: int, version: int, sources: list[Any], priority: int) -> None:
        """Send round ``round_no`` of ``ks`` (its Level-1 result ``sources[0]``) to the servers."""
        with self._idle:
            self._inflight += 1
        task = _Task(lambda: self._send_round(ks, round_no, version, sources[0], priority), ks, round_no)
        try:
            self._worker.queue.put(task, priority)
        except QueueClosed:
            self._settle()

    def fetch(self, ks: KeyState) -> np.ndarray:
        """The servers' current weights of ``ks`` (a blocking pull, for ``get_weight``)."""
        out = np.empty(ks.shape, ks.dtype)

        def pull() -> Any:
            return self._store.pull(ks.key, out=out, wait=False)

        handle = self._call(pull, f"pulling key {ks.key!r} from the distributed store")
        self._wait_handle(handle, f"pulling key {ks.key!r} from the distributed store")
        return out

    def barrier(self) -> None:
        """Wait until every round this process sent was answered, then for every worker."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._inflight == 0, self._timeout):
                raise PullTimeoutError(
                    f"barrier: {self._inflight} round(s) sent to the distributed store were not answered "
                    f"within {self._timeout:g} s"
                )
        self._call(self._store.barrier, "the distributed store's barrier")

    def close(self, timeout: float) -> None:
        """Stop the bridge thread; close the store when the bridge created it."""
        self._worker.queue.close()
        self._worker.join(timeout)
        if self._owns_store:
            closer = getattr(self._store, "close", None)
            if callable(closer):
                closer()

    # ---- the bridge thread ---------------------------------------------------------------------
    def _send_round(self, ks: KeyState, round_no: int, version: int, result: Any, priority: int) -> None:
        device = arrays.device_of(result)
        if device.is_gpu:
            send = self._send.get(ks.key)
            if send is None:
                send = self._send[ks.key] = arrays.pinned_empty(ks.shape, ks.dtype)
            # on the bridge's own stream: the GPU's default stream holds the training kernels, and
            # the result is complete already (the push thread waited for the sum)
            with arrays.device_context(device), arrays.stream_context(self._worker.stream_for(device)):
                arrays.copy_into(send, result)
        else:
            send = result
        handle = self._store.push(ks.key, send, priority=priority)
        # Pull only once the servers took the push (as mshadow-ps made its pull depend on the
        # push), so the weights that come back include this process's round.
        handle.add_done_callback(lambda h: self._pushed(ks, round_no, version, priority, h))

    def _pushed(self, ks: KeyState, round_no: int, version: int, priority: int, handle: Any) -> None:
        # runs on the store's network thread: hand the pull back to the bridge thread
        error = _handle_error(handle)
        if error is not None:
            self._fail(ks, error, f"pushing round {round_no} to the distributed store")
            self._settle()
            return
        task = _Task(lambda: self._pull_round(ks, round_no, version, priority), ks, round_no)
        try:
            self._worker.queue.put(task, priority)
        except QueueClosed:
            self._settle()

    def _pull_round(self, ks: KeyState, round_no: int, version: int, priority: int) -> None:
        recv = self._recv_buffer(ks, version)
        handle = self._store.pull(ks.key, out=recv, priority=priority, wait=False)
        handle.add_done_callback(lambda h: self._answered(ks, round_no, version, recv, h))

    def _recv_buffer(self, ks: KeyState, version: int) -> np.ndarray:
        buffers = self._recv.setdefault(ks.key, [None, None])
        if buffers[version] is None:
            buffers[version] = arrays.pinned_empty(ks.shape, ks.dtype)
        return buffers[version]

    def _answered(self, ks: KeyState, round_no: int, version: int, recv: np.ndarray, handle: Any) -> None:
        # runs on the store's network thread
        try:
            error = _handle_error(handle)
            if error is not None:
                self._fail(ks, error, f"the distributed store's answer to round {round_no}")
            else:
                self._publish(ks, round_no, version, [recv] * ks.ndev)
        finally:
            if round_no > 0:
                self._settle()

    def _task_failed(self, task: Any, exc: BaseException) -> None:
        if isinstance(task, _Task) and task.ks is not None:
            self._fail(task.ks, exc, f"sending round {task.round_no} to the distributed store")
            self._settle()
        elif isinstance(task, _Call):
            task.future.set_exception(exc)

    def _settle(self) -> None:
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on the bridge thread, ahead of queued rounds; wait for it (with the timeout)."""
        call = _Call(fn)
        try:
            self._worker.queue.put(call, _URGENT)
        except QueueClosed as exc:
            raise StateError(f"{what}: the shared model is closed") from exc
        try:
            return call.future.result(self._timeout)
        except concurrent.futures.TimeoutError as exc:
            raise PullTimeoutError(f"{what} did not finish within {self._timeout:g} s") from exc
        except SharedModelError:
            raise
        except Exception as exc:
            raise SharedModelError(f"{what} failed: {type(exc).__name__}: {exc}") from exc

    def _wait_handle(self, handle: Any, what: str) -> None:
        try:
            handle.wait(self._timeout)
        except TimeoutError as exc:
            raise PullTimeoutError(f"{what} did not finish within {self._timeout:g} s") from exc


class _Task:
    def __init__(self, fn: Callable[[], None], ks: KeyState | None, round_no: int) -> None:
        self.fn, self.ks, self.round_no = fn, ks, round_no

    def __call__(self) -> None:
        self.fn()


class _Call:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    def __call__(self) -> None:
        self.future.set_result(self.fn())


def _handle_error(handle: Any) -> BaseException | None:
    try:
        return handle.exception(timeout=0)
    except concurrent.futures.CancelledError as exc:
        return exc
