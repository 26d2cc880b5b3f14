"""The handle kvcore gives for work the worker node does: completed by the node, its error kvcore's.

The stores and the collectives hand one to the runtime with each request and give it to the caller.
"""

from __future__ import annotations

from typing import Any

from psnode import errors as ps_errors
from psnode.node.futures import is_done
from psnode.worker.node import WorkerNode

from .dist_errors import translate
from .errors import KVTimeoutError
from .handles import LazyHandle

__all__ = ["NodeHandle"]


class NodeHandle(LazyHandle):
    """A ``Handle`` the worker node completes: its error becomes kvcore's as it is set
    (``dist_errors.translate``), and ``wait`` receives the reply on the waiting thread
    (``WorkerNode.wait_for``).

    Skipping the hand-off from the network thread to the waiter saves a thread wake-up per wait,
    which is most of a small key's round trip.
    """

    def __init__(self, description: str, worker: WorkerNode) -> None:
        super().__init__(description)
        self._worker = worker

    def set_exception(self, exception: BaseException | None) -> None:
        LazyHandle.set_exception(self, translate(exception))

    def wait(self, timeout: float | None = None) -> Any:
        if not is_done(self):
            try:
                done = self._worker.wait_for(self, timeout)
            except ps_errors.PSNodeError as exc:
                if not self.done():
                    raise translate(exc) from exc
                done = True
            if not done:
                raise KVTimeoutError(f"{self.description} did not complete within {timeout} s")
        return LazyHandle.wait(self)  # done: the result without a lock
