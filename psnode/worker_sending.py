"""How a worker's messages leave: in priority order, at once when nothing waits before them.

Messages wait in a heap ordered by priority (higher first), then call order, and leave as soon as
the connection takes them; a full connection (``WouldBlock``) keeps the rest queued in that order
and the network thread retries. A message with nothing queued before it is sent straight from the
calling thread.

A small push to one server may be held back (*corked*) while the network thread is parked, so that
a pull of the caller right after it travels in the same message and is answered by one reply.
A held push leaves before anything sent after it, when its caller waits, or after the network
thread's hand-back delay at the latest (see ``worker_receiving``).

``SendQueue`` is mixed into ``WorkerNode`` and uses its state (see ``WorkerNode.__init__``).
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from .errors import PSNodeError
from .protocol import FLAG_PULL, Cmd, unpack_entries
from .transport import WouldBlock

__all__ = ["SendQueue"]


class _Unsent:
    done = False  # a send buffer queued but not yet handed to ZeroMQ is never reused


_UNSENT = _Unsent()


class SendQueue:
    """The send side of a ``WorkerNode`` (see the module docstring)."""

    def _hold(self, server: int, message: list, priority: int, req: int) -> bool:
        """Hold a small push back for the caller's next pull to ride along; True when held.

        Only while the network thread is parked: a caller is then likely to pull next, and the
        push and the pull travel as one message with one reply (see pull and _run).
        """
        if not self._parked or self._cork is not None or self._queue:
            return False
        with self._park_lock:
            if self._parked and self._cork is None:
                self._cork = (-priority, next(self._seq), server, message, req)
                return True
        return False

    def _send(self, server: int, message: list, priority: int, req: int) -> None:
        """Send one message now when nothing waits before it, else queue it (any thread)."""
        if self._cork is None and not self._queue and self._send_lock.acquire(blocking=False):
            try:
                if not self._queue:
                    try:
                        self.transport.send(self.servers[server].uid.encode(), message, block=False)
                        return
                    except WouldBlock:
                        pass
                    except PSNodeError as exc:
                        self._complete(req, exc)
                        return
                heapq.heappush(self._queue, (-priority, next(self._seq), server, message, req))
            finally:
                self._send_lock.release()
            self._pump()
            return
        self._enqueue(server, message, priority, req)
        self._pump()

    def _enqueue(self, server: int, frames: list, priority: int, req: int) -> None:
        if self._cork is not None:  # a held push leaves before anything that follows it
            cork = self._take_cork()
            if cork is not None:
                heapq.heappush(self._queue, cork)
        heapq.heappush(self._queue, (-priority, next(self._seq), server, frames, req))

    def _take_cork(self) -> tuple | None:
        with self._park_lock:
            cork, self._cork = self._cork, None
        return cork

    def _uncork(self) -> None:
        """Send the held push (if any) now."""
        cork = self._take_cork()
        if cork is not None:
            heapq.heappush(self._queue, cork)
            self._pump()

    def _pump(self) -> None:
        """Send queued messages in priority order while the connections take them (any thread)."""
        while self._queue:
            if not self._send_lock.acquire(blocking=False):
                return  # the holder re-checks the queue after releasing, so nothing is stranded
            try:
                if self._send_queued():
                    return  # a connection is full: the network thread retries shortly
            finally:
                self._send_lock.release()

    def _send_queued(self) -> bool:
        """Send what the connections take; True when one was full. Call with the send lock held."""
        queue = self._queue
        while queue:
            item = heapq.heappop(queue)  # atomic: other threads only ever push
            _, _, server, frames, req = item
            peer = self.servers[server].uid.encode()
            try:
                tracker = self.transport.send(peer, frames, track=len(frames) > 3 and frames[0][3] == Cmd.PUSH and not frames[0][4] & FLAG_PULL, block=False)
            except WouldBlock:
                heapq.heappush(queue, item)  # same sort key: it keeps its place
                return True
            except PSNodeError as exc:
                self._complete(req, exc)
                continue
            if tracker is not None:
                self._remember_tracker(server, frames, tracker)
        return False

    def _remember_tracker(self, server: int, frames: list, tracker: Any) -> None:
        for key_id, _, frame, _, _, _ in unpack_entries(frames[1]):
            if frame:
                entry = self._buffers.get((key_id, server))
                if entry is not None and entry[0] is frames[2 + frame]:
                    self._buffers[(key_id, server)] = (entry[0], tracker)

    def _send_copy(self, slot: tuple[int, int], flat: np.ndarray) -> np.ndarray:
        """A copy of ``flat`` in a buffer kept per (key id, server), reused once ZeroMQ has sent it."""
        entry = self._buffers.get(slot)
        if entry is not None and entry[0].nbytes == flat.nbytes and entry[1].done:
            buffer = entry[0]
        else:
            buffer = np.empty_like(flat)
        np.copyto(buffer, flat)
        self._buffers[slot] = (buffer, _UNSENT)
        return buffer
