"""Many small keys pushed together, handled as one flat value: the server's fast path for key lists.

A worker that pushes and pulls the same list of small ``dist_sync`` keys round after round sends the
same message layout each time. The server then keeps those keys' values side by side in one flat
array (each key's stored value is a view into it), and one ``rounds.Round`` merges, applies and
answers for the whole list with a handful of numpy calls instead of a Python loop over the keys.

This is exact as long as every access to its keys comes as the whole list. Any other access
*dissolves* the group first: each key gets a round with the group's progress (``Round.slice``),
its waiting pulls become per-key pulls, and the keys go back to the per-key path with identical
results.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from psnode.log import logger
from psnode.node.protocol import ENTRY
from psnode.server.replies import pull_reply
from psnode.server.rounds import Round, run_updater
from psnode.server.shard_memory import HostMemory

__all__ = ["Group", "Groups", "MIN_GROUP"]

MIN_GROUP = 16  # fewer keys than this go the per-key way: a group would not pay for itself
_HOST = HostMemory()


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
        self.round = Round(num_workers, shards[0].round.quorum, _HOST, np.empty_like(self.stored))
        self.round.received = list(shards[0].round.received)
        self.views: list[tuple[int, int]] = []
        for shard, offset, nbytes in zip(shards, self.offsets.tolist(), self.nbytes.tolist()):
            lo, hi = offset // itemsize, (offset + nbytes) // itemsize
            self.stored[lo:hi] = shard.stored
            shard.stored = self.stored[lo:hi]
            shard.group = self
            self.views.append((lo, hi))

    @staticmethod
    def eligible(shards: list, entries: np.ndarray, frame_size: int) -> bool:
        """True when these shards, pushed with these entries, can form a group now."""
        first = shards[0]
        if len(shards) < MIN_GROUP or not first.sync:
            return False
        offsets = entries["offset"]
        nbytes = entries["nbytes"]
        if entries["frame"].any() or entries["codec"].any() or int(nbytes.sum()) != frame_size:
            return False
        if offsets[0] != 0 or np.any(offsets[1:] != np.cumsum(nbytes)[:-1]):
            return False
        received = first.round.received
        for shard in shards:
            r = shard.round
            if (shard.group is not None or not shard.sync or shard.dtype != first.dtype or r.count or r.backlog
                    or r.starts or r.changes or r.leaving or r.waiting or shard.trackers or shard.error or r.received != received
                    or type(shard.stored) is not np.ndarray):
                return False
        return len({s.key_id for s in shards}) == len(shards)

    def matches(self, entries: np.ndarray) -> bool:
        """True when a message's entries have this group's layout (same keys already matched)."""
        return bool(np.array_equal(entries["offset"], self.offsets) and np.array_equal(entries["nbytes"], self.nbytes))

    def reply_meta(self, entries: np.ndarray) -> bytes:
        """The reply's meta frame for a pull with request ``entries``: the values lie in one payload frame."""
        reply = entries.copy()
        reply["frame"] = 0
        reply["offset"] = self.offsets
        reply["nbytes"] = self.nbytes
        reply["seq"] = 0
        return reply.tobytes()

    def apply(self, updater: Any, full: Round) -> None:
        """Apply a full round: the sum becomes the values, or ``updater`` runs once per key."""
        if updater is None:
            np.copyto(self.stored, full.result)
            return
        if full.first is not None:
            np.copyto(full.merge, full.first)
        for shard, (lo, hi) in zip(self.shards, self.views):
            shard.error = run_updater(updater, shard.user_key, full.merge[lo:hi].reshape(shard.shape),
                                      self.stored[lo:hi].reshape(shard.shape))

    def dissolve(self) -> list:
        """Give each shard a round with the group's progress; return the waiting pulls per key.

        Each returned record is ``(shard, worker, seq, req_id, index)``.
        """
        merge = self.round.merge
        for shard, (lo, hi) in zip(self.shards, self.views):
            shard.group = None
            shard.round = self.round.slice(lo, hi, merge[lo:hi])
        per_key = []
        for worker, seq, (req_id, entries) in self.round.take_waiting():
            for shard, index in zip(self.shards, entries["index"].tolist()):
                per_key.append((shard, worker, seq, req_id, index))
        return per_key


def entries_of(meta: Any) -> np.ndarray:
    """The meta frame as an ``ENTRY`` array (a view)."""
    return np.frombuffer(meta, dtype=ENTRY)


class Groups:
    """The groups of one server: finds the group of a message, runs it, dissolves it when needed.

    ``store`` is the server's ``ServerStore``, ``replies`` its ``server_replies.Replies``.
    """

    def __init__(self, store: Any, replies: Any) -> None:
        self.store = store
        self.replies = replies
        self.by_keys: dict[bytes, Group] = {}
        self.timeline: Any = None  # PSLAUNCH_TIMELINE: a group's merge and update are one event each

    def try_push(self, worker: int, meta: Any, data_frames: list) -> bool:
        """Handle a push through a group when its layout allows; False: use the per-key path (always
        under replay: a group's round is not versioned)."""
        if len(meta) < MIN_GROUP * ENTRY.itemsize or len(data_frames) != 1 or self.store.replay:
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
        if not group.matches(entries) or len(data_frames[0]) != group.total or entries["codec"].any():
            return False
        round_ = group.round
        if np.any(entries["seq"] != round_.received[worker] + 1):
            return False  # pushes of these keys went another way before: per key is exact
        self.store.pushed_bytes += group.total
        start = time.monotonic_ns() if self.timeline is not None else 0
        if round_.push(worker, np.frombuffer(data_frames[0], dtype=group.dtype)):
            round_.close(self._apply, group)
            if any(s.error for s in group.shards):
                self._fall_back(group)  # each key's pullers hear of its own updater error
                self._traced("merge", group, start)
                return True
        self._traced("merge", group, start)
        if round_.waiting:
            for waiter, (req_id, entries) in round_.release():
                self._reply(group, waiter, req_id, entries)
        return True

    def _apply(self, group: Group, full: Round) -> None:
        start = time.monotonic_ns() if self.timeline is not None else 0
        group.apply(self.store.updater, full)
        self.store.updates += len(group.shards)
        self._traced("update", group, start)

    def _traced(self, name: str, group: Group, start: int) -> None:
        if self.timeline is not None:
            self.timeline.add(name, f"{len(group.shards)} keys", start, time.monotonic_ns())

    def try_pull(self, worker: int, req_id: int, meta: Any) -> bool:
        """Answer (or keep) a pull through a group when its layout allows; False: use the per-key path."""
        if len(meta) < MIN_GROUP * ENTRY.itemsize:
            return False
        entries = entries_of(meta)
        group = self.by_keys.get(entries["key"].tobytes())
        if group is None or not np.array_equal(entries["nbytes"], group.nbytes) or entries["codec"].any():
            return False  # (a pull answered in a codec goes key by key)
        seqs = entries["seq"]
        seq = int(seqs[0])
        if np.any(seqs != seq) or any(s.error for s in group.shards):
            return False  # the per-key path reports each key's updater error
        round_ = group.round
        if round_.ready_for(worker, seq):
            self._reply(group, worker, req_id, entries)
        elif self.store.stuck(group.shards[0].user_key, round_):
            return False  # the per-key path reports which round can never close
        else:
            round_.wait(worker, seq, (req_id, entries.copy()))
        return True

    def _reply(self, group: Group, worker: int, req_id: int, entries: np.ndarray) -> None:
        self.replies.send_to(worker, pull_reply(req_id, group.reply_meta(entries), group.stored.tobytes()), req_id)

    def _fall_back(self, group: Group) -> None:
        """Dissolve ``group`` and answer the pulls its last round released, key by key."""
        self.dissolve(group)
        for shard in group.shards:
            for waiter, (req_id, index) in shard.round.release():
                self.replies.answer(waiter, req_id, index, shard)

    def dissolve(self, group: Group) -> None:
        """Put the group's keys back on the per-key path (their state moves to the shards)."""
        for keys, g in list(self.by_keys.items()):
            if g is group:
                del self.by_keys[keys]
        logger.info("a group of %d keys goes back to the per-key path", len(group.shards))
        for shard, worker, seq, req_id, index in group.dissolve():
            shard.round.wait(worker, seq, (req_id, index))
