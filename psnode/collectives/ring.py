"""The ring allreduce: a reduce-scatter, then an allgather, with pipelined segments.

The value is cut into one chunk per worker of the ring, each chunk into segments of a quarter of
it, 1 to 4 MiB (``base.ring_segment``). In the reduce-scatter, worker ``i`` sends chunk ``i`` to its right
neighbour; each worker adds what arrives from its left into its own copy of that chunk and passes
it on, so after ``n - 1`` steps worker ``i`` holds chunk ``i + 1`` summed over the ring. The
allgather passes the summed chunks around once more. Each segment travels on its own: a worker
adds one segment and sends it on while the next is still arriving, so the reduction of one segment
overlaps the transfer of the next (gloo's ring does the same with 1 MiB segments). Every chunk is
summed once, in ring order, and then copied: every worker gets the same bits.

Segments leave without a copy. A reduce-scatter segment is overwritten later only by the summed
chunk, which cannot arrive before that segment was received; the allgather's segments are tracked,
and the op completes once they have left (``Op.trackers``).

``RingState`` runs one ring over a slice of the op's value; the hierarchical allreduce runs one
over its own slice between the hosts (``local``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from psnode.errors import ProtocolError

from .base import Op, Tag, copy_in, ring_segment, segment_named, slices
from .wire import Desc, Kind, Record

__all__ = ["RingState", "RingAllreduce"]


class RingState:
    """A ring allreduce of ``buf`` (a flat view whose first element is element ``base`` of the op's
    value) over the workers ``ring`` (in ring order), inside ``op``; calls ``on_done`` once ``buf``
    holds the sum. Messages that come before ``start`` wait for it."""

    def __init__(self, op: Op, ring: list[int], buf: np.ndarray, base: int, on_done: Callable[[], None]) -> None:
        self.op = op
        self.buf = buf
        self.base = base
        self.on_done = on_done
        n = len(ring)
        self.n = n
        pos = ring.index(op.engine.rank)
        self.pos = pos
        self.left = ring[pos - 1]
        self.right = ring[(pos + 1) % n]
        step = ring_segment(-(-len(buf) // n), buf.dtype.itemsize)  # the biggest chunk's: the same on every worker
        self.segments = [[(a + s, min(a + s + step, b)) for s in range(0, b - a, step)] for a, b in slices(len(buf), n)]
        self.to_reduce = sum(len(self.segments[(pos - 1 - k) % n]) for k in range(n - 1))
        self.to_gather = sum(len(self.segments[(pos - k) % n]) for k in range(n - 1))
        self.started = False
        self.done = False
        self._early: list[tuple[int, Record, Any]] = []

    def start(self) -> None:
        """Send this worker's chunk (reduce-scatter step 0), then take what came early."""
        self.started = True
        for s, (a, b) in enumerate(self.segments[self.pos] if self.n > 1 else ()):
            self.op.send(self.right, Kind.RING_RS, 0, s, self.base + a, b - a, data=self.buf[a:b])
        early, self._early = self._early, []
        for message in early:
            self.on_message(*message)
        self._check_done()

    def destination(self, src: int, record: Record) -> np.ndarray | None:
        """An allgather segment from the left this ring expects and has not taken: its place in the value.

        It is safe to write there while the ring runs: that part of the value last left this worker
        as a reduce-scatter segment, which its right neighbour read before the sum could come round.
        """
        if not self.started or record.kind != Kind.RING_AG or src != self.left or record.step >= self.n - 1:
            return None
        span = segment_named(self.segments[(self.pos - record.step) % self.n], record, self.base)
        if span is None or self.op.seen(src, record):
            return None
        return self.buf[span[0]:span[1]]

    def on_message(self, src: int, record: Record, data: Any) -> None:
        """Add (reduce-scatter) or copy (allgather) one segment from the left and pass it on.

        Raises:
            ProtocolError: not from the left neighbour, a step or segment out of range, or
                elements other than that segment's.
        """
        if not self.started:
            self._early.append((src, record, data))
            return
        n, op = self.n, self.op
        kind, k, s = record.kind, record.step, record.segment
        if src != self.left or kind not in (Kind.RING_RS, Kind.RING_AG) or k >= n - 1:
            raise ProtocolError(f"worker {src} sent an unexpected ring message (kind {kind}, step {k}) for "
                                f"{op.describe()}; its left neighbour is worker {self.left}")
        chunk = (self.pos - 1 - k) % n if kind == Kind.RING_RS else (self.pos - k) % n
        segments = self.segments[chunk]
        span = segment_named(segments, record, self.base)
        if span is None:
            raise ProtocolError(f"worker {src} sent elements {record.offset}+{record.count} as segment {s} of step {k} "
                                f"of {op.describe()}, which has {len(segments)} segments there")
        op.first_time(src, record)
        a, b = span
        view = self.buf[a:b]
        if kind == Kind.RING_RS:
            np.add(view, np.frombuffer(data, view.dtype, b - a), out=view)
            self.to_reduce -= 1
            if k < n - 2:
                op.send(self.right, Kind.RING_RS, k + 1, s, self.base + a, b - a, data=view)
            else:  # this chunk is summed over the whole ring: the allgather starts with it
                op.send(self.right, Kind.RING_AG, 0, s, self.base + a, b - a, data=view)
        else:
            copy_in(view, data)
            self.to_gather -= 1
            if k < n - 2:
                op.send(self.right, Kind.RING_AG, k + 1, s, self.base + a, b - a, data=view)
        self._check_done()

    def _check_done(self) -> None:
        if not self.done and self.to_reduce == 0 and self.to_gather == 0:
            self.done = True
            self.on_done()

    def waiting_for(self) -> set[int]:
        """The left neighbour while segments are still to come."""
        return set() if self.done else {self.left}


class RingAllreduce(Op):
    """Sum ``buf`` (flat) over every worker in place, with one ring in rank order."""

    kind = "ring"

    def __init__(self, engine: Any, tag: Tag, desc: Desc, label: str, buf: np.ndarray) -> None:
        super().__init__(engine, tag, desc, label)
        self.ring = RingState(self, list(range(engine.size)), buf, 0, self._done)

    def start(self) -> None:
        self.ring.start()

    def on_message(self, src: int, record: Record, data: Any) -> None:
        self.ring.on_message(src, record, data)

    def destination(self, src: int, record: Record) -> np.ndarray | None:
        return self.ring.destination(src, record)

    def waiting_for(self) -> set[int]:
        return self.ring.waiting_for()

    def _done(self) -> None:
        self.finished = True
        self.complete()
