"""A finishing worker's flush: its peers say they read what its last collectives sent them.

What a worker's last collectives sent may still wait in its queues behind a peer that reads slowly
(4 workers on 2 cores: hundreds of small messages); closing the connections would drop it, and
that peer's collectives would fail. So before it closes, a finishing worker sends ``FLUSH`` to every
worker it sent collective messages to and that has not finished; each answers ``FLUSHED`` as soon as
its receiving thread reads the question, which comes after everything sent before it
(``Engine.flush``, ``WorkerNode._flush_collectives``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import numpy as np

from psnode.errors import TransportError, WouldBlock
from psnode.node.futures import set_result

from . import wire
from .wire import Desc, Kind

__all__ = ["Flush", "NOTHING"]


NOTHING = Desc(np.uint8, (0,))  # the description a FLUSH or FLUSHED message carries


class Flush:
    """A finishing worker's question to its peers (``Engine.flush``): done once each of ``waiting``
    said ``FLUSHED`` or finished the job, or this worker failed. Thread-safe."""

    def __init__(self, engine: Any, waiting: set[int]) -> None:
        self.engine = engine
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._waiting = set(waiting)
        self._unasked = set(waiting)
        if not waiting:
            set_result(self.future)

    def retry(self) -> None:
        """Send ``FLUSH`` to the peers not asked yet (a full queue refused it last time)."""
        with self._lock:
            unasked = sorted(self._unasked)
        for rank in unasked:
            try:
                self.engine.send(rank, wire.pack(0, 0, Kind.FLUSH, NOTHING), False, block=False)
            except WouldBlock:
                continue
            except TransportError:  # gone: the scheduler says so, or the wait ends
                pass
            with self._lock:
                self._unasked.discard(rank)

    def answered(self, rank: int) -> None:
        """``rank`` read everything (``FLUSHED``) or finished the job."""
        with self._lock:
            self._waiting.discard(rank)
            self._unasked.discard(rank)
            done = not self._waiting
        if done:
            set_result(self.future)

    def end(self) -> None:
        """Stop waiting (this worker failed)."""
        set_result(self.future)
