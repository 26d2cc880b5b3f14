"""The round machine: how the pushes of one value are merged and applied, and when a pull may see it.

One ``Round`` serves every kind of value a server holds: a whole key, one part of a key split across
servers, and a group of small keys stored side by side (``server_groups``). It is the only place the
rules below are written.

A round of ``dist_sync`` takes exactly one push of every worker (the *quorum*). Pushes are summed into
the merge buffer in place; the first is kept as a view of its message until a second arrives, so a
round of one worker copies nothing. When the quorum is reached the owner's ``apply`` runs once (the
updater, or the sum replaces the stored value) and the next round starts. A worker's second push
before the round closes is held in the backlog for the next round, so no push is lost or counted
twice. ``dist_async`` is a round whose quorum is one push: every push is applied on arrival.

A pull carries how many pushes of the value its worker has issued (``seq``). It is answered once all
of them were received and none of them sits in an open round, so it never misses the worker's own
pushes; until then it waits in the round (``wait``/``release``).

A *versioned* round (``dist_sync`` under ``PSLAUNCH_RESTART_SCOPE=worker``: a worker may be replaced
in place and redo its last steps) answers a pull of ``seq`` pushes with the value after round
``seq`` exactly (``closed`` counts the rounds applied; the store keeps the values a redo may ask
for), and ``duplicate`` tells a push that a replaced worker's predecessor already made.

States, per round: *open* (``count`` pushes merged, fewer than the quorum) -> *full* -> ``close``
applies it -> *open* with ``count`` 0 (plus any backlog merged at once). A round is *stuck* when a
worker that finished the job never pushed to it (``stuck_on``).

An elastic job's membership changes at round boundaries: a worker that leaves lowers the quorum of
the rounds after its last push (``leave``); one that joins (``join``) counts from a start round no
push reached yet. The quorum changes when that round opens (``changes``); the joiner's earlier
pushes wait in the backlog and its pulls until the round before its start closed, so its first pull
sees exactly the value the members' pushes of that round start from.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Hashable

__all__ = ["Round", "drain_backlog", "run_updater"]


class Round:
    """The round state of one value (see the module docstring). Single-threaded (the server's loop).

    ``memory`` is the value's memory kind (``shard_memory.HostMemory`` or ``GpuMemory``): ``add``,
    ``add2`` and ``load`` write the merge buffer ``merge``.
    """

    __slots__ = ("quorum", "memory", "merge", "count", "pushed", "received", "backlog", "first", "waiting", "closed",
                 "versioned", "leaving", "starts", "changes")

    def __init__(self, num_workers: int, quorum: int, memory: Any, merge: Any) -> None:
        self.quorum = quorum
        self.memory = memory
        self.merge = merge
        self.count = 0
        self.pushed: set[int] = set()
        self.received = [0] * num_workers  # pushes received per worker, over every round
        self.backlog: deque = deque()  # (worker, data): pushes that belong to a later round
        self.first: Any = None  # the open round's only push so far, a view of its message
        self.waiting: list = []  # (worker, seq, item): pulls not answerable yet
        self.closed = 0  # rounds applied: the value is the one after round ``closed``
        self.versioned = False  # pulls are answered with the value after their round (see the module docstring)
        self.leaving: set[int] = set()  # workers that left the job with a push still in an open round
        self.starts: dict[int, int] = {}  # joiners whose first round has not opened yet: worker -> that round
        self.changes: dict[int, int] = {}  # round -> change of the quorum when it opens (joins)

    # ---- pushes ----------------------------------------------------------------------------
    def push(self, worker: int, data: Any, borrowed: bool = False) -> bool:
        """Take ``worker``'s push ``data``; True when the round is full (then call ``close``).

        ``borrowed``: ``data`` lives in memory its sender reuses once the push is acknowledged
        (shared memory), so the round copies it instead of keeping a view.
        """
        self.received[worker] += 1
        if worker in self.pushed or (self.starts and self.closed + 1 < self.starts.get(worker, 0)):
            self.backlog.append((worker, data.copy() if borrowed else data))
            return False
        if borrowed and self.count == 0:
            self.memory.load(self.merge, data)
            self.count = 1
            self.pushed.add(worker)
        else:
            self._merge(worker, data)
        return self.count == self.quorum

    def duplicate(self, worker: int, seq: int) -> bool:
        """True when ``worker``'s push number ``seq`` (from 1) was received already: a versioned round's
        replaced worker redoing a push its predecessor made. It is not taken again."""
        return self.versioned and 0 < seq <= self.received[worker]

    def count_refused(self, worker: int) -> None:
        """Count ``worker``'s refused push (a wrong size) as received.

        Its worker counted it when it sent it, and the worker's later pulls ask for that many
        pushes: they would wait forever otherwise.
        """
        self.received[worker] += 1

    def _merge(self, worker: int, data: Any) -> None:
        count = self.count
        if count == 0:
            self.first = data
        elif count == 1 and self.first is not None:
            self.memory.add2(self.merge, self.first, data)
            self.first = None
        else:
            self.memory.add(self.merge, data)
        self.count = count + 1
        self.pushed.add(worker)

    @property
    def result(self) -> Any:
        """The full round's sum: the merge buffer, or the only push itself (a round of one)."""
        return self.merge if self.first is None else self.first

    def close(self, apply: Callable[[Any, "Round"], None], owner: Any) -> None:
        """Apply every full round with ``apply(owner, self)`` (which reads ``result``) and open the next.

        Held pushes of workers not yet in the new round join it at once, which may fill it again.
        """
        while self.count == self.quorum:
            apply(owner, self)
            self.closed += 1
            self.count = 0
            self.pushed.clear()
            self.first = None
            if self.changes:
                self.quorum += self.changes.pop(self.closed + 1, 0)
            if self.backlog:
                self.backlog = drain_backlog(self.backlog, self.pushed, self._merge, self._not_yet())
            if self.starts:
                self.starts = {w: r for w, r in self.starts.items() if r > self.closed + 1}
            if self.leaving:
                self._take_leaves()

    def _not_yet(self) -> Any:
        """The joiners whose first round is later than the open one (their pushes stay held)."""
        if not self.starts:
            return frozenset()
        return {w for w, r in self.starts.items() if r > self.closed + 1}

    # ---- an elastic job's membership --------------------------------------------------------
    def leave(self, worker: int) -> bool:
        """``worker`` left the job after its last push (an elastic job's step boundary): the rounds
        after the last one it pushed to do not wait for it, so each round sums exactly the workers that
        were members in it. True when the open round is full now (then call ``close``)."""
        if self.quorum == 1 and worker not in self.pushed:  # dist_async, or the last worker: nothing waits
            return False
        self.leaving.add(worker)
        self._take_leaves()
        return bool(self.count) and self.count == self.quorum

    def touched(self) -> int:
        """The latest round a push reached: the open one when it has pushes, plus the rounds the
        backlog holds pushes for."""
        held: dict[int, int] = {}
        for worker, _ in self.backlog:
            held[worker] = held.get(worker, 0) + 1
        return self.closed + (1 if self.count else 0) + max(held.values(), default=0)

    def join(self, worker: int, start: int) -> None:
        """``worker`` joins the job and counts in the rounds from ``start`` on, a round no push reached
        yet (``start > touched()``; see the module docstring). It counts its pushes from zero."""
        self.received[worker] = 0
        if start <= self.closed + 1 and not self.count:  # the open round is empty: it counts from it
            self.quorum += 1
            return
        self.starts[worker] = start
        self.changes[start] = self.changes.get(start, 0) + 1

    def _take_leaves(self) -> None:
        """Lower the quorum for each leaver with no push in the open round or the backlog."""
        for worker in list(self.leaving):
            if worker not in self.pushed and not any(w == worker for w, _ in self.backlog):
                self.leaving.discard(worker)
                self.quorum = max(1, self.quorum - 1)

    def swap_merge(self, buffer: Any) -> Any:
        """Make ``buffer`` the merge buffer; return the old one (an apply that keeps the sum)."""
        old, self.merge = self.merge, buffer
        return old

    # ---- pulls -----------------------------------------------------------------------------
    def ready_for(self, worker: int, seq: int) -> bool:
        """True when a pull of ``worker`` that must include its ``seq`` pushes can be answered now."""
        if self.starts and self.closed + 1 < self.starts.get(worker, 0):  # a joiner: the round before its first
            return False
        if self.versioned:  # answered with the value after round ``seq``, once that round closed
            return self.closed >= seq
        if self.received[worker] < seq:
            return False
        if not self.count:
            return True
        return worker not in self.pushed and not (self.backlog and any(w == worker for w, _ in self.backlog))

    def wait(self, worker: int, seq: int, item: Any) -> None:
        """Keep a pull that is not answerable yet; ``release`` gives ``item`` back once it is."""
        self.waiting.append((worker, seq, item))

    def release(self) -> list[tuple[int, Any]]:
        """The waiting pulls answerable now, as ``(worker, item)``, in arrival order."""
        ready, still = [], []
        for entry in self.waiting:
            if self.ready_for(entry[0], entry[1]):
                ready.append((entry[0], entry[2]))
            else:
                still.append(entry)
        self.waiting = still
        return ready

    def take_waiting(self) -> list[tuple[int, int, Any]]:
        """Every waiting pull, as ``(worker, seq, item)``; the round keeps none."""
        waiting, self.waiting = self.waiting, []
        return waiting

    def stuck_on(self, finished: dict[int, str]) -> list[str]:
        """The finished workers (their descriptions) that an open round waits for in vain."""
        if self.quorum == 1 or not self.count or not finished:
            return []
        return [node for rank, node in finished.items() if rank not in self.pushed]

    # ---- leaving a group --------------------------------------------------------------------
    def slice(self, lo: int, hi: int, merge: Any) -> "Round":
        """A round for elements ``lo:hi`` of this one's flat value, with the same progress.

        Used when a group of keys goes back to one round per key; waiting pulls are not copied
        (their items are the group's).
        """
        part = Round(len(self.received), self.quorum, self.memory, merge)
        part.count = self.count
        part.pushed = set(self.pushed)
        part.received = list(self.received)
        part.first = None if self.first is None else self.first[lo:hi]
        part.closed = self.closed
        part.versioned = self.versioned
        part.leaving = set(self.leaving)
        part.starts = dict(self.starts)
        part.changes = dict(self.changes)
        part.backlog = deque((w, d[lo:hi]) for w, d in self.backlog)
        return part


def drain_backlog(backlog: deque, pushed: set, merge: Callable[[int, Any], None],
                  not_yet: Any = frozenset()) -> deque:
    """After a round closed: ``merge(worker, data)`` each held push of a worker not yet in the new
    round (``pushed``, which ``merge`` adds to) nor a joiner whose first round is later (``not_yet``),
    in arrival order; return the pushes still held for a later round."""
    kept: deque = deque()
    while backlog:
        worker, data = backlog.popleft()
        if worker in pushed or worker in not_yet:
            kept.append((worker, data))
        else:
            merge(worker, data)
    return kept


def run_updater(updater: Callable[[Hashable, Any, Any], None], key: Hashable, merged: Any, stored: Any) -> str | None:
    """Call the user's ``updater(key, merged, stored)``; the error sentence for its pullers, or None.

    The updater is the user's code, so any exception is possible; it fails the key's pulls (the
    workers see it as a ``RemoteError``) instead of the server.
    """
    try:
        updater(key, merged, stored)
    except Exception as exc:
        return f"the updater raised {type(exc).__name__}: {exc} (key {key!r})"
    return None
