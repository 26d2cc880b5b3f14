"""Priority work queues and the threads that drain them.

Each device gets a push thread and a pull thread (or one of each for all devices, when asked), so
that copies and aggregation run while the training thread computes. Work waiting in a queue runs
highest priority first; equal priorities run in the order they were queued. A running task is never
interrupted: priority only decides which waiting task goes next.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Any, Callable

from .. import arrays

__all__ = ["PriorityWorkQueue", "WorkerThread", "QueueClosed"]


class QueueClosed(Exception):
    """``put`` on a queue that was closed."""


class PriorityWorkQueue:
    """A thread-safe queue that hands out the highest-priority item first (FIFO among equals).

    ``get`` blocks until an item is there or the queue is closed; after ``close`` the items still
    waiting are dropped and ``get`` returns None.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Any]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: Any, priority: int = 0) -> None:
        """Queue ``item``; a bigger ``priority`` is served earlier.

        Raises:
            QueueClosed: the queue was closed.
        """
        with self._cond:
            if self._closed:
                raise QueueClosed("the work queue is closed")
            # heapq pops the smallest tuple: negate the priority, break ties by arrival order
            heapq.heappush(self._heap, (-int(priority), next(self._order), item))
            self._cond.notify()

    def get(self, timeout: float | None = None) -> Any:
        """The next item, or None when the queue is closed or ``timeout`` passed with nothing queued."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._heap or self._closed, timeout):
                return None
            if self._closed:
                return None
            return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)

    def close(self) -> list[Any]:
        """Stop handing out items; return the ones that were still waiting."""
        with self._cond:
            self._closed = True
            left = [entry[2] for entry in sorted(self._heap)]
            self._heap.clear()
            self._cond.notify_all()
            return left


class WorkerThread:
    """A daemon thread that runs the callables of one queue on behalf of some devices.

    Each item is a callable taking no arguments. The thread keeps a CUDA stream of its own for each
    GPU it serves (see ``stream_for``), so its copies overlap the default stream's kernels. An item
    that raises does not stop the thread: ``on_error(item, exc)`` is told instead.
    """

    def __init__(
        self,
        name: str,
        queue: PriorityWorkQueue,
        on_error: Callable[[Any, BaseException], None],
    ) -> None:
        self.queue = queue
        self._on_error = on_error
        self._streams: dict[arrays.Device, Any] = {}
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    @property
    def name(self) -> str:
        """The thread's name (shows in tracebacks and debuggers)."""
        return self._thread.name

    def start(self) -> None:
        """Start draining the queue."""
        self._thread.start()

    def is_alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    def is_current(self) -> bool:
        """True when called from this worker's own thread."""
        return threading.current_thread() is self._thread

    def stream_for(self, device: arrays.Device) -> Any:
        """This thread's CUDA stream on ``device`` (None on the CPU); call only from the thread itself."""
        if not device.is_gpu:
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = arrays.new_stream(device)
        return stream

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            try:
                item()
            except BaseException as exc:  # a task's failure belongs to its key, not to the thread
                self._on_error(item, exc)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; True when it has."""
        if self._thread.ident is not None and not self.is_current():
            self._thread.join(timeout)
        return not self._thread.is_alive()
