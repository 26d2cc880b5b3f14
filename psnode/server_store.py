"""A server's keys: the stored shards, the per-round merge and the updater.

Each key part a server holds is a ``Shard``: the stored value, a merge buffer allocated once, and
what the current round has seen.

``dist_sync`` (a shard initialised with ``sync=True``): the pushes of one round, one from every
worker, are summed into the merge buffer in place; when the last one arrives the updater runs once
(``updater(key, merged, stored)``; without one the sum replaces the stored value). A worker's second
push of a key before the round closes waits for the next round, so no push is lost or counted twice.
A pull carries how many pushes of the key that worker has issued; it is answered once all of them
are received and merged into a closed round, so it never misses the worker's own pushes.

``dist_async``: every push is applied on arrival; an updater is required.

Values sent to workers are never changed under ZeroMQ's feet: when a reply may still be reading a
stored array, the next update writes a fresh copy instead (copy on write).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Hashable

import numpy as np

from .shard_memory import HostMemory

__all__ = ["Shard", "ServerStore", "KeyError_", "drain_backlog"]


class KeyError_(Exception):
    """A request a server refuses; the message goes back to the worker (``RemoteError`` there)."""


class Shard:
    """One key part held by this server."""

    __slots__ = (
        "key_id", "user_key", "shape", "dtype", "nbytes", "row_size", "sync", "stored", "merge",
        "count", "pushed", "received", "backlog", "waiting", "trackers", "error", "first", "group",
    )

    def __init__(self, key_id: int, user_key: Hashable, value: Any, merge: Any, sync: bool, row_size: int, num_workers: int) -> None:
        self.key_id = key_id
        self.user_key = user_key
        self.shape = tuple(value.shape)
        self.dtype = np.dtype(value.dtype)
        self.nbytes = int(value.nbytes)
        self.row_size = row_size
        self.sync = sync
        self.stored = value
        self.merge = merge
        self.count = 0
        self.pushed: set[int] = set()
        self.received = [0] * num_workers  # pushes received per worker
        self.backlog: deque = deque()  # (worker, data) pushes that belong to a later round
        self.waiting: list = []  # (worker, req_id, index, seq) pulls not answerable yet
        self.trackers: list = []  # sends that may still read ``stored``
        self.error: str | None = None
        self.first: np.ndarray | None = None  # the round's first push, read in place from its frame
        self.group: Any = None  # the server_groups.Group handling this key, if any

    def ready_for(self, worker: int, seq: int) -> bool:
        """True when a pull that needs ``seq`` pushes of ``worker`` can be answered now."""
        if self.received[worker] < seq:
            return False
        if not self.sync or not self.count:
            return True
        return worker not in self.pushed and not (self.backlog and any(w == worker for w, _ in self.backlog))


Answer = Callable[[int, int, int, "Shard"], None]


def drain_backlog(backlog: deque, pushed: set, merge: Callable[[int, Any], None]) -> deque:
    """After a round closed: ``merge(worker, data)`` each held push of a worker not yet in the new
    round (``pushed``), in arrival order; the pushes still held for a later round."""
    kept: deque = deque()
    while backlog:
        worker, data = backlog.popleft()
        if worker in pushed:
            kept.append((worker, data))
        else:
            merge(worker, data)
    return kept


class ServerStore:
    """All shards of one server, and the rules that merge and apply pushes (see the module docstring)."""

    def __init__(self, num_workers: int, backend: Any = None) -> None:
        self.num_workers = num_workers
        self.backend = backend or HostMemory()
        self.shards: dict[int, Shard] = {}
        self.updater: Any = None
        self.finished: dict[int, str] = {}  # workers that left the job: rank -> description

    # ---- init / updater ------------------------------------------------------------------
    def init(self, key_id: int, user_key: Hashable, value: np.ndarray, sync: bool, row_size: int) -> None:
        """Create a shard from its initial value.

        Raises:
            KeyError_: the key is already initialised.
        """
        if key_id in self.shards:
            raise KeyError_(f"key {user_key!r} is already initialised on this server")
        stored = self.backend.place(value.reshape(-1))  # kept flat; the updater gets ``shape`` views
        shard = Shard(key_id, user_key, stored, self.backend.empty_like(stored), sync, row_size, self.num_workers)
        shard.shape = tuple(value.shape)
        self.shards[key_id] = shard
        init_key = getattr(self.updater, "init_key", None)
        if init_key is not None:
            with self.backend.context():
                init_key(user_key, shard.stored.reshape(shard.shape))

    def set_updater(self, updater: Any) -> None:
        """Install ``updater(key, merged, stored)``; call its ``init_key`` for keys that already exist."""
        if not callable(updater):
            raise KeyError_(f"the updater must be callable, got {type(updater).__name__}")
        self.updater = updater
        init_key = getattr(updater, "init_key", None)
        if init_key is not None:
            with self.backend.context():
                for shard in self.shards.values():
                    init_key(shard.user_key, shard.stored.reshape(shard.shape))

    def shard(self, key_id: int) -> Shard:
        """The shard of ``key_id``.

        Raises:
            KeyError_: this server holds no such key.
        """
        shard = self.shards.get(key_id)
        if shard is None:
            raise KeyError_(f"key id {key_id:#x} was never initialised on this server")
        return shard

    # ---- push ----------------------------------------------------------------------------
    def push(self, shard: Shard, worker: int, data: np.ndarray, answer: Answer, borrowed: bool = False) -> None:
        """Take one worker's push of ``shard``; ``answer(worker, req_id, index, shard)`` releases waiting pulls.

        ``borrowed``: ``data`` lives in the worker's shared memory, which it reuses once this
        message is acknowledged, so nothing may keep a reference to it.

        Raises:
            KeyError_: dist_async without an updater.
        """
        shard.received[worker] += 1
        if not shard.sync:
            if self.updater is None:
                raise KeyError_(
                    f"dist_async needs an optimizer on the servers, but key {shard.user_key!r} was pushed before "
                    "set_optimizer(); call kv.set_optimizer(...) before the first push"
                )
            self.backend.load(shard.merge, data)
            self._apply(shard)
            if shard.waiting:
                self._release(shard, answer)
            return
        if worker in shard.pushed:
            shard.backlog.append((worker, data.copy() if borrowed else data))
            return
        if borrowed and shard.count == 0:
            self.backend.load(shard.merge, data)  # a copy now instead of a reference to the region
            shard.count = 1
            shard.pushed.add(worker)
        else:
            self._merge(shard, worker, data)
        if shard.count == self.num_workers:
            self._close_round(shard, answer)

    def wrong_size(self, shard: Shard, worker: int, nbytes: int) -> KeyError_:
        """Refuse ``worker``'s push of ``nbytes`` bytes to ``shard``: the error to send back.

        The push still counts as received: the worker counted it when it sent it, and its later
        pulls of the key ask for that many pushes (they would wait forever otherwise).
        """
        shard.received[worker] += 1
        return KeyError_(f"key {shard.user_key!r}: a push of {nbytes} bytes, but this server holds {shard.nbytes}")

    def _merge(self, shard: Shard, worker: int, data: np.ndarray) -> None:
        # The first push of a round is kept as a view of its frame; the second is summed with it into
        # the merge buffer in one pass; later ones are added in place.
        count = shard.count
        if count == 0:
            shard.first = data
        elif count == 1 and shard.first is not None:
            self.backend.add2(shard.merge, shard.first, data)
            shard.first = None
        else:
            self.backend.add(shard.merge, data)
        shard.count = count + 1
        shard.pushed.add(worker)

    def _close_round(self, shard: Shard, answer: Answer) -> None:
        while shard.count == self.num_workers:
            self._apply(shard)
            shard.count = 0
            shard.pushed.clear()
            if shard.backlog:
                self._drain_backlog(shard)
            if shard.waiting:
                self._release(shard, answer)

    def _drain_backlog(self, shard: Shard) -> None:
        shard.backlog = drain_backlog(shard.backlog, shard.pushed, lambda worker, data: self._merge(shard, worker, data))

    def _apply(self, shard: Shard) -> None:
        busy = bool(shard.trackers) and any(not t.done for t in shard.trackers)
        shard.trackers = []
        try:
            with self.backend.context():
                if self.updater is None and shard.first is not None:
                    if busy:  # a reply still reads the old array: write a new one
                        shard.stored = self.backend.empty_like(shard.stored)
                    self.backend.load(shard.stored, shard.first)
                elif self.updater is None:
                    # the merged sum becomes the value: swap buffers instead of copying
                    old = shard.stored
                    shard.stored = shard.merge
                    shard.merge = self.backend.empty_like(old) if busy else old
                else:
                    if shard.first is not None:
                        self.backend.load(shard.merge, shard.first)
                    if busy:
                        shard.stored = shard.stored.copy()
                    self.updater(shard.user_key, shard.merge.reshape(shard.shape), shard.stored.reshape(shard.shape))
            shard.error = None
        except Exception as exc:  # the user's updater: report it to whoever pulls the key
            shard.error = f"the updater raised {type(exc).__name__}: {exc} (key {shard.user_key!r})"
        finally:
            shard.first = None

    def _release(self, shard: Shard, answer: Answer) -> None:
        if not shard.waiting:
            return
        still = []
        for worker, req_id, index, seq in shard.waiting:
            if shard.ready_for(worker, seq):
                answer(worker, req_id, index, shard)
            else:
                still.append((worker, req_id, index, seq))
        shard.waiting = still

    # ---- pull ----------------------------------------------------------------------------
    def pull(self, shard: Shard, worker: int, req_id: int, index: int, seq: int, answer: Answer) -> None:
        """Answer a pull now, or once the pushes it must include have been applied.

        Raises:
            KeyError_: the pull waits for a round that a finished worker never pushed to.
        """
        if shard.ready_for(worker, seq):
            answer(worker, req_id, index, shard)
            return
        blocked = self.blocked(shard.user_key, shard.sync, shard.count, shard.pushed)
        if blocked:
            raise KeyError_(blocked)
        shard.waiting.append((worker, req_id, index, seq))

    def blocked(self, key: Hashable, sync: bool, count: int, pushed: set) -> str | None:
        """Why an open round of ``key`` can never close (a finished worker did not push), or None."""
        if not sync or not count or not self.finished:
            return None
        gone = [node for rank, node in self.finished.items() if rank not in pushed]
        if not gone:
            return None
        return (f"the current round of key {key!r} can never close: {', '.join(gone)} finished without pushing "
                "it (every worker must push a key the same number of times in dist_sync)")

    def rows(self, shard: Shard, rows: np.ndarray) -> np.ndarray:
        """The stored rows ``rows`` (ids local to the shard) as a host array.

        Raises:
            KeyError_: a row id outside the shard.
        """
        count = shard.stored.size // shard.row_size
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= count):
            raise KeyError_(f"key {shard.user_key!r}: row ids outside 0..{count - 1} on this server")
        return self.backend.rows(shard.stored, shard.row_size, rows)
