"""Many small keys pushed together, handled as one flat array: the server's fast path for key lists.

A worker that pushes and pulls the same list of small ``dist_sync`` keys round after round sends the
same message layout each time. The server then keeps those keys' values side by side in one flat
array (each key's stored value is a view into it), and merges, applies and replies for the whole
list with a handful of numpy calls instead of a Python loop over the keys.

The group keeps the round bookkeeping (pushes received, who pushed this round, pulls waiting) for
all its keys at once; this is exact as long as every access to its keys comes as the whole list.
Any other access *dissolves* the group first: its state is copied into each key's ``Shard`` and
the keys go back to the per-key path, with identical results.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import numpy as np

from .node import logger
from .protocol import ENTRY
from .server_store import drain_backlog

__all__ = ["Group", "MIN_GROUP"]

MIN_GROUP = 16  # fewer keys than this go the per-key way: a group would not pay for itself


class Group:
    """The shards of one message layout, stored in one flat array (see the module docstring)."""

    def __init__(self, shards: list, entries: np.ndarray, num_workers: int) -> None:
        self.shards = shards
        self.dtype = shards[0].dtype
        itemsize = self.dtype.itemsize
        self.offsets = entries["offset"].copy()
        self.nbytes = entries["nbytes"].copy()
        self.total = int(self.nbytes.sum())
        self.stored = np.empty(self.total // itemsize, self.dtype)
        self.merge = np.empty_like(self.stored)
        self.views: list[tuple[np.ndarray, np.ndarray]] = []
        for shard, offset, nbytes in zip(shards, self.offsets.tolist(), self.nbytes.tolist()):
            lo, hi = offset // itemsize, (offset + nbytes) // itemsize
            self.stored[lo:hi] = shard.stored
            shard.stored = self.stored[lo:hi]
            shard.merge = self.merge[lo:hi]
            shard.group = self
            self.views.append((lo, hi))
        self.count = 0
        self.pushed: set[int] = set()
        self.received = list(shards[0].received)
        self.first: np.ndarray | None = None
        self.backlog: deque = deque()  # (worker, flat data)
        self.waiting: list = []  # (worker, req_id, seq, request entries)
        self.active = True

    @staticmethod
    def eligible(shards: list, entries: np.ndarray, frame_size: int) -> bool:
        """True when these shards, pushed with these entries, can form a group now."""
        first = shards[0]
        if len(shards) < MIN_GROUP or not first.sync:
            return False
        offsets = entries["offset"]
        nbytes = entries["nbytes"]
        if entries["frame"].any() or int(nbytes.sum()) != frame_size:
            return False
        if offsets[0] != 0 or np.any(offsets[1:] != np.cumsum(nbytes)[:-1]):
            return False
        received = first.received
        for shard in shards:
            if (shard.group is not None or not shard.sync or shard.dtype != first.dtype or shard.count
                    or shard.backlog or shard.waiting or shard.trackers or shard.error or shard.received != received
                    or type(shard.stored) is not np.ndarray):
                return False
        return len({s.key_id for s in shards}) == len(shards)

    def matches(self, entries: np.ndarray) -> bool:
        """True when a message's entries have this group's layout (same keys already matched)."""
        return bool(np.array_equal(entries["offset"], self.offsets) and np.array_equal(entries["nbytes"], self.nbytes))

    # ---- push / pull ---------------------------------------------------------------------
    def push(self, worker: int, data: np.ndarray, num_workers: int, apply: Callable[["Group"], None]) -> None:
        """One worker's push of every key of the group (``data`` is the flat payload)."""
        self.received[worker] += 1
        if worker in self.pushed:
            self.backlog.append((worker, data))
            return
        self._merge(worker, data)
        while self.count == num_workers:
            apply(self)
            self.count = 0
            self.pushed.clear()
            self.first = None
            self.backlog = drain_backlog(self.backlog, self.pushed, self._merge)

    def _merge(self, worker: int, data: np.ndarray) -> None:
        if self.count == 0:
            self.first = data
        elif self.count == 1:
            np.add(self.first, data, out=self.merge)
            self.first = None
        else:
            np.add(self.merge, data, out=self.merge)
        self.count += 1
        self.pushed.add(worker)

    def ready_for(self, worker: int, seq: int) -> bool:
        """True when a pull needing ``seq`` pushes of ``worker`` can be answered now."""
        if self.received[worker] < seq:
            return False
        return not self.count or (worker not in self.pushed and not any(w == worker for w, _ in self.backlog))

    def reply_meta(self, entries: np.ndarray) -> bytes:
        """The reply's meta frame for a pull with request ``entries``: the values lie in one payload frame."""
        reply = entries.copy()
        reply["frame"] = 0
        reply["offset"] = self.offsets
        reply["nbytes"] = self.nbytes
        reply["seq"] = 0
        return reply.tobytes()

    # ---- leaving the fast path -----------------------------------------------------------------
    def dissolve(self) -> list:
        """Hand the group's state back to its shards; return the waiting pulls as per-key records.

        Each returned record is ``(shard, worker, req_id, index, seq)``.
        """
        self.active = False
        per_key = []
        for shard, (lo, hi) in zip(self.shards, self.views):
            shard.group = None
            shard.count = self.count
            shard.pushed = set(self.pushed)
            shard.received = list(self.received)
            shard.first = None if self.first is None else self.first[lo:hi]
            shard.backlog = deque((w, d[lo:hi]) for w, d in self.backlog)
        for worker, req_id, seq, entries in self.waiting:
            for shard, index in zip(self.shards, entries["index"].tolist()):
                per_key.append((shard, worker, req_id, index, seq))
        self.waiting = []
        return per_key


def entries_of(meta: Any) -> np.ndarray:
    """The meta frame as an ``ENTRY`` array (a view)."""
    return np.frombuffer(meta, dtype=ENTRY)


class Groups:
    """The groups of one server: finds the group of a message, runs it, dissolves it when needed.

    ``send(worker, frames)`` sends a reply; ``apply_group(group)`` applies a closed round.
    """

    def __init__(self, store: Any, send: Callable[[int, list], None], pull_reply: Callable[[int, bytes, bytes], list]) -> None:
        self.store = store
        self.send = send
        self.pull_reply = pull_reply  # (req_id, meta, payload) -> frames
        self.by_keys: dict[bytes, Group] = {}

    def try_push(self, worker: int, meta: Any, data_frames: list) -> bool:
        """Handle a push through a group when its layout allows; False: use the per-key path."""
        if len(meta) < MIN_GROUP * ENTRY.itemsize or len(data_frames) != 1:
            return False
        entries = entries_of(meta)
        keys = entries["key"].tobytes()
        group = self.by_keys.get(keys)
        if group is None:
            shards = [self.store.shards.get(k) for k in entries["key"].tolist()]
            if None in shards or not Group.eligible(shards, entries, len(data_frames[0])):
                return False
            group = Group(shards, entries, self.store.num_workers)
            self.by_keys[keys] = group
            logger.info("%d keys pushed together are handled as one group", len(shards))
        if not group.matches(entries) or len(data_frames[0]) != group.total:
            return False
        if np.any(entries["seq"] != group.received[worker] + 1):
            return False  # pushes of these keys went another way before: per key is exact
        data = np.frombuffer(data_frames[0], dtype=group.dtype)
        group.push(worker, data, self.store.num_workers, self.apply)
        if group.waiting:
            self._release(group)
        return True

    def try_pull(self, worker: int, req_id: int, meta: Any) -> bool:
        """Answer (or queue) a pull through a group when its layout allows; False: use the per-key path."""
        if len(meta) < MIN_GROUP * ENTRY.itemsize:
            return False
        entries = entries_of(meta)
        group = self.by_keys.get(entries["key"].tobytes())
        if group is None or not np.array_equal(entries["nbytes"], group.nbytes):
            return False
        seqs = entries["seq"]
        seq = int(seqs[0])
        if np.any(seqs != seq) or any(s.error for s in group.shards):
            return False
        if group.ready_for(worker, seq):
            self.send(worker, self.pull_reply(req_id, group.reply_meta(entries), group.stored.tobytes()))
        elif self.store.blocked(group.shards[0].user_key, True, group.count, group.pushed):
            return False  # the per-key path reports which round can never close
        else:
            group.waiting.append((worker, req_id, seq, entries.copy()))
        return True

    def apply(self, group: Group) -> None:
        """Apply a closed round to every key of the group (the updater once per key)."""
        updater = self.store.updater
        if updater is None:
            np.copyto(group.stored, group.merge if group.first is None else group.first)
            return
        if group.first is not None:
            np.copyto(group.merge, group.first)
        for shard, (lo, hi) in zip(group.shards, group.views):
            try:
                updater(shard.user_key, group.merge[lo:hi].reshape(shard.shape), group.stored[lo:hi].reshape(shard.shape))
                shard.error = None
            except Exception as exc:  # the user's updater: reported to whoever pulls the key
                shard.error = f"the updater raised {type(exc).__name__}: {exc} (key {shard.user_key!r})"

    def _release(self, group: Group) -> None:
        still = []
        for worker, req_id, seq, entries in group.waiting:
            if group.ready_for(worker, seq) and not any(s.error for s in group.shards):
                self.send(worker, self.pull_reply(req_id, group.reply_meta(entries), group.stored.tobytes()))
            else:
                still.append((worker, req_id, seq, entries))
        group.waiting = still

    def dissolve(self, group: Group) -> None:
        """Put the group's keys back on the per-key path (their state moves to the shards)."""
        for keys, g in list(self.by_keys.items()):
            if g is group:
                del self.by_keys[keys]
        logger.info("a group of %d keys goes back to the per-key path", len(group.shards))
        for shard, worker, req_id, index, seq in group.dissolve():
            shard.waiting.append((worker, req_id, index, seq))
