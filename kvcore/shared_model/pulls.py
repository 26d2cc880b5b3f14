"""The pull side of the shared model: publishing results, pull requests, callbacks and waits.

``PullSide`` is a part of ``SharedModel`` (api.py) kept in a module of its own; it relies on the
model's state (``_cond`` guards every ``KeyState``) and its helpers (``_require_ready``, ``_wid``,
``_key_for``, ``_worker``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable

from .. import arrays
from .checks import check_array
from .errors import (
    ConfigError,
    DuplicatePullError,
    PullFailedError,
    PullTimeoutError,
    StateError,
)
from .level1 import KeyState, PullRequest
from .queues import QueueClosed, WorkerThread

__all__ = ["PullSide"]

# pull_wait wakes this often to check that the work it waits for can still happen
_LIVENESS_SLICE = 0.2


class PullTask:
    """A pull thread's work item: copy a published result into one request's array."""

    def __init__(self, ks: KeyState, request: PullRequest, worker: WorkerThread):
        self.ks, self.request, self.worker = ks, request, worker
        self.run: Callable[["PullTask"], None] | None = None

    def __call__(self) -> None:
        self.run(self)


class PullSide:
    """Results and pulls: ``pull_req``, ``pull_wait`` and the pull threads' work."""

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
        task = PullTask(ks, request, worker)
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
        both are done. Keep ``data`` alive and untouched until then. The copy waits for the work
        this thread queued on ``data``'s GPU stream before the call (a fill, kernels still reading
        the old values), without blocking here.

        Raises:
            KeyNotInitialisedError, KeyShapeError, UnknownDeviceError, StateError;
            DuplicatePullError when this device's previous pull of the key has not finished;
            PullFailedError when the key failed, or an earlier pull failed and was never waited for.
        """
        self._require_ready("pull_req")
        wid = self._wid(dev)
        ks = self._key_for(key, wid, "pull_req")
        check_array(data, ks.buffers.result_shape, ks.dtype, key, dev, "pull_req", self._devices[wid])
        if callback is not None and not callable(callback):
            raise ConfigError(f"pull_req(key={key!r}, dev={dev}): callback must be callable, got {callback!r}")
        # the pull thread's copy waits for the work queued on data so far (its allocation or fill,
        # kernels still reading it), which runs on this thread's stream, not the pull thread's
        event = arrays.record_event(data)
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
            request = PullRequest(data, wid, ks.pushed[wid], int(priority), callback, event)
            ks.requests[wid] = request
            if ks.published_ok and ks.published_round >= request.need_round:
                self._schedule_pull(ks, request, ks.published_version)

    def _run_pull(self, task: PullTask) -> None:
        ks, request = task.ks, task.request
        device = self._devices[request.wid]
        try:
            if request.done.is_set():  # failed while queued
                return
            source = ks.sources[request.version][request.wid]
            with arrays.device_context(device), arrays.stream_context(task.worker.stream_for(device)):
                arrays.wait_event(request.event)
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
