"""Broadcast and allgather: values copied, not summed, one segment per message.

``Broadcast``: the root sends its value to every other worker in segments of ``base.SEGMENT``
bytes; the others copy each segment into place as it comes and acknowledge the whole.
``Allgather``: every worker sends its
value to every other one the same way and each lands in its row of the result. Both run straight
from the workers' arrays (tracked until sent) and finish once every segment expected arrived.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psnode.errors import ProtocolError

from .base import SEGMENT, Op, Tag, copy_in, segment_named
from .wire import Desc, Kind, Record

__all__ = ["Broadcast", "Allgather"]


def _segments(total: int, itemsize: int) -> list[tuple[int, int]]:
    step = max(1, SEGMENT // itemsize)
    return [(a, min(a + step, total)) for a in range(0, total, step)]


def _place(op: Op, src: int, record: Record, segments: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The elements of the segment ``record`` names, when it was not taken yet (``Op.destination``), else None."""
    span = segment_named(segments, record)
    return None if span is None or op.seen(src, record) else span


def _check_segment(op: Op, src: int, record: Record, segments: list[tuple[int, int]]) -> tuple[int, int]:
    span = segment_named(segments, record)
    if span is None:
        raise ProtocolError(f"worker {src} sent elements {record.offset}+{record.count} as segment {record.segment} of "
                            f"{op.describe()}, which has {len(segments)} segments")
    op.first_time(src, record)
    return span


class Broadcast(Op):
    """Copy worker ``root``'s ``buf`` (flat) into every worker's ``buf``.

    The others acknowledge once they hold the whole value; once all did, the root tells them (an
    ``ACK`` of its own). So a broadcast ends on every worker only when every worker has the value,
    and a worker that refuses it (another shape or dtype, another root) fails it everywhere.
    """

    kind = "broadcast"

    def __init__(self, engine: Any, tag: Tag, desc: Desc, label: str, buf: np.ndarray, root: int) -> None:
        super().__init__(engine, tag, desc, label)
        self.buf = buf
        self.root = root
        self.segments = _segments(desc.total, desc.dtype.itemsize)
        self.remaining = len(self.segments)
        self.unacked: set[int] = set()
        self.everyone = False  # the root said every worker has the value

    def start(self) -> None:
        engine = self.engine
        if engine.rank == self.root:
            self.unacked = {r for r in range(engine.size) if r != self.root}
            for rank in sorted(self.unacked):
                for s, (a, b) in enumerate(self.segments):
                    self.send(rank, Kind.BCAST, self.root, s, a, b - a, data=self.buf[a:b])
            self.remaining = 0
        self._check()

    def on_message(self, src: int, record: Record, data: Any) -> None:
        root = self.engine.rank == self.root
        if record.kind == Kind.ACK and (src in self.unacked if root else src == self.root and not self.remaining):
            if root:
                self.unacked.discard(src)
            else:
                self.everyone = True
            self._check()
            return
        if record.kind != Kind.BCAST or record.step != self.root or src != self.root:
            raise ProtocolError(f"worker {src} sent a broadcast from worker {record.step} for {self.describe()}, "
                                f"which worker {self.engine.rank} expects from worker {self.root}")
        a, b = _check_segment(self, src, record, self.segments)
        copy_in(self.buf[a:b], data)
        self.remaining -= 1
        if self.remaining == 0:
            self.send(self.root, Kind.ACK)

    def destination(self, src: int, record: Record) -> np.ndarray | None:
        if (self.engine.rank == self.root or record.kind != Kind.BCAST or src != self.root
                or record.step != self.root):
            return None
        place = _place(self, src, record, self.segments)
        return None if place is None else self.buf[place[0]:place[1]]

    def _check(self) -> None:
        if self.finished:
            return
        if self.engine.rank == self.root:
            if self.unacked:
                return
            for rank in range(self.engine.size):
                if rank != self.root:
                    self.send(rank, Kind.ACK)
        elif self.remaining or not self.everyone:
            return
        self.finished = True
        self.complete()

    def waiting_for(self) -> set[int]:
        if self.engine.rank == self.root:
            return set(self.unacked)
        return {self.root} if self.remaining or not self.everyone else set()


class Allgather(Op):
    """Every worker's value into row ``rank`` of every worker's ``rows`` (shape ``(workers, elements)``)."""

    kind = "allgather"

    def __init__(self, engine: Any, tag: Tag, desc: Desc, label: str, rows: np.ndarray) -> None:
        super().__init__(engine, tag, desc, label)
        self.rows = rows
        self.segments = _segments(desc.total, desc.dtype.itemsize)
        self.remaining = {r: len(self.segments) for r in range(engine.size) if r != engine.rank}

    def start(self) -> None:
        engine = self.engine
        mine = self.rows[engine.rank]
        for rank in self.remaining:
            for s, (a, b) in enumerate(self.segments):
                self.send(rank, Kind.GATHER, 0, s, a, b - a, data=mine[a:b])
        self._check()

    def on_message(self, src: int, record: Record, data: Any) -> None:
        if record.kind != Kind.GATHER or src not in self.remaining:
            raise ProtocolError(f"worker {src} sent an unexpected message (kind {record.kind}) for {self.describe()}")
        a, b = _check_segment(self, src, record, self.segments)
        copy_in(self.rows[src][a:b], data)
        self.remaining[src] -= 1
        self._check()

    def destination(self, src: int, record: Record) -> np.ndarray | None:
        if record.kind != Kind.GATHER or src not in self.remaining:
            return None
        place = _place(self, src, record, self.segments)
        return None if place is None else self.rows[src][place[0]:place[1]]

    def _check(self) -> None:
        if not self.finished and not any(self.remaining.values()):
            self.finished = True
            self.complete()

    def waiting_for(self) -> set[int]:
        return {r for r, n in self.remaining.items() if n}
