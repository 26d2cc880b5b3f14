"""Allreduce through shared memory between the workers of one host, and the hierarchical allreduce.

**Same host** (``ShmAllreduce``). Each worker of the host has a shared-memory region (an anonymous
``memfd``, mapped by the others through ``/proc/<pid>/fd/<fd>`` as ``psnode.transport.same_host`` does) and the
value is cut into one slice per worker. A worker copies the slices the others sum into its region
and says ``SHM_READY``; once every worker did, worker ``j`` sums slice ``j`` of every region into
its own value (the ranks split the work by slices), copies that slice into its region and says
``SHM_DONE``; once every worker did, it copies the other slices of the sum out of their regions
and says ``SHM_FREE``. A caller's array made in shared memory (``SharedRegions.shared_array``) is
named where it lies, with its byte offset: nothing is copied into or out of a region of the op, and
the op completes only once every peer said ``SHM_FREE``, since the peers read the caller's array.
No byte crosses a socket: the messages are a few dozen bytes each. Every slice is summed by one
worker: every worker gets the same bits.

**Hierarchical** (``HierarchicalAllreduce``), when several hosts run as many workers each: the
same, except that between ``SHM_READY`` and ``SHM_DONE`` worker ``j`` of every host runs a ring
(``ring.RingState``) over its slice with worker ``j`` of the other hosts. So every worker reduces
within its host, takes part in one of the rings across hosts, and reads the rest of the sum back
within its host.

A region is reused once every worker of the host said ``SHM_FREE`` (``SharedRegions``). A region
named by a peer is mapped only when it is a region of this job (an anonymous memfd named with the
job's tag, ``same_host.job_tag``) of the process that peer registered as, and as big as the value
(``same_host.Attachments``): a peer cannot make a worker map anything else.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from psnode.errors import PeerDiedError, ProtocolError
from psnode.transport import same_host

from .base import Op, Tag, slices
from .ring import RingState
from .wire import Desc, Kind, Record

__all__ = ["SharedRegions", "LocalPhase", "ShmAllreduce", "HierarchicalAllreduce"]

_EARLY_RING = 100_000  # ring messages held for a ring not started yet, at most
ARENA = 64 << 20  # bytes of shared memory the small shared arrays are cut from, per region
SHARED_ALIGN = 64  # a shared array starts on a cache line


class SharedRegions:
    """This worker's regions (taken per op, reused once free) and the peers' regions it mapped.

    Thread-safe: ops start on callers' threads and end on the receiving thread.
    """

    def __init__(self, workers: list, job_id: str) -> None:
        self.workers = workers
        self.tag = same_host.job_tag(job_id)
        self._free: list[same_host.Region] = []
        self._maps = same_host.Attachments(self.tag)
        self._lock = threading.Lock()
        self._arrays: list[tuple[int, int, same_host.Region]] = []  # (first address, end, region) of shared arrays
        self._arena: same_host.Region | None = None  # where the next small shared array goes
        self._arena_used = 0

    def shared_array(self, nbytes: int) -> tuple[same_host.Region, int]:
        """Room for an array the caller keeps (``Collectives.shared_empty``): a region and the byte
        offset of the array in it.

        Arrays are cut from arenas of ``ARENA`` bytes (one descriptor each, where a region per
        array would run a model of many tensors out of descriptors; pages are used only once
        written); a bigger array gets a region of its own. Kept for the process's life, as
        ``give`` says of the op regions: the caller allocates its arrays once and reuses them.
        """
        size = -(-max(nbytes, 1) // SHARED_ALIGN) * SHARED_ALIGN
        with self._lock:
            if size > ARENA:
                return self._register(same_host.Region(size, self.tag)), 0
            if self._arena is None or self._arena_used + size > self._arena.nbytes:
                self._arena = self._register(same_host.Region(ARENA, self.tag))
                self._arena_used = 0
            offset = self._arena_used
            self._arena_used += size
            return self._arena, offset

    def _register(self, region: same_host.Region) -> same_host.Region:
        start = region.array.ctypes.data
        self._arrays.append((start, start + region.nbytes, region))
        return region

    def locate(self, buf: np.ndarray) -> tuple[same_host.Region, int] | None:
        """The shared array region ``buf`` (flat, C-contiguous) lies in and its byte offset there, or None."""
        if not self._arrays:
            return None
        start = buf.ctypes.data
        end = start + buf.nbytes
        with self._lock:
            for first, last, region in self._arrays:
                if first <= start and end <= last:
                    return region, start - first
        return None

    def take(self, nbytes: int) -> same_host.Region:
        """A free region of at least ``nbytes`` (the smallest such), or a new one."""
        with self._lock:
            fits = [r for r in self._free if r.nbytes >= nbytes]
            if fits:
                region = min(fits, key=lambda r: r.nbytes)
                self._free.remove(region)
                return region
        rounded = max(1 << 20, -(-nbytes // (1 << 20)) * (1 << 20))  # whole MiB: one region serves nearby sizes
        return same_host.Region(rounded, self.tag)

    def give(self, region: same_host.Region) -> None:
        """``region`` is free again (every worker said ``SHM_FREE``).

        Regions are kept for the process's life: as many as collectives ran at once, of their
        sizes. Dropping one would free its descriptor's number for another region, and a peer's
        cached mapping of the old one would then be read for the new one.
        """
        with self._lock:
            self._free.append(region)

    def view(self, src: int, ref: int, nbytes: int, offset: int = 0) -> np.ndarray:
        """``nbytes`` of worker ``src``'s region ``ref`` from byte ``offset``, mapped here (cached).

        Raises:
            ProtocolError: ``ref`` is not an anonymous collectives region of ``nbytes`` or more, or it
                cannot be mapped (naming the worker and why).
            PeerDiedError: the process that made it is gone.
        """
        pid, fd = same_host.decode(ref)
        path = f"/proc/{pid}/fd/{fd}"
        sender = self.workers[src].pid if 0 <= src < len(self.workers) else -1
        try:
            with self._lock:
                return self._maps.view(ref, nbytes, sender, offset)
        except same_host.RefusedRegion as exc:
            raise ProtocolError(f"worker {src} named a shared-memory region this worker does not map: {exc}") from exc
        except OSError as exc:
            if _process_gone(pid):  # the process died: the scheduler will say so too
                host = self.workers[src].host if 0 <= src < len(self.workers) else ""
                raise PeerDiedError(f"worker {src} (pid {pid}) died or was killed: its shared-memory region is gone",
                                    "worker", src, host) from exc
            raise ProtocolError(
                f"worker {src}'s shared-memory region {path} cannot be mapped here ({exc}); if this host does not "
                "let processes map each other's memory, set PSLAUNCH_SAME_HOST=ipc") from exc


SUM_BLOCK = 256 << 10  # bytes summed at a time: the block stays in the core's cache (L2) between passes


def sum_slice(mine: np.ndarray, others: list[np.ndarray], publish: np.ndarray | None) -> None:
    """``mine += sum(others)`` in list order, then copy it into ``publish`` when given.

    Block by block: each block of ``mine`` is read from memory once, summed with every other
    array's block while it stays in cache, and copied from cache. With whole-array passes each
    addition read and wrote all of ``mine`` again: for 4 workers the slice's memory traffic falls
    from 11 slice-sized passes to 6. The order of the additions per element is unchanged, so the
    bits are those of the plain passes.
    """
    step = max(1, SUM_BLOCK // max(1, mine.itemsize))
    for lo in range(0, len(mine), step):
        hi = lo + step
        block = mine[lo:hi]
        for other in others:
            np.add(block, other[lo:hi], out=block)
        if publish is not None:
            publish[lo:hi] = block


def _process_gone(pid: int) -> bool:
    """True when process ``pid`` no longer runs (gone, or a zombie not reaped yet: its descriptors are)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[-1].split()[:1]
    except OSError:
        return True
    return state in ([b"Z"], [b"X"])


class LocalPhase:
    """The same-host steps of one op over the workers ``group`` (this host's, by rank) and ``buf``
    (flat); ``middle(view, base, done)``, when given, runs between ``SHM_READY`` and ``SHM_DONE`` on
    this worker's slice and calls ``done()`` when the slice holds the sum over every host."""

    def __init__(self, op: Op, group: list[int], buf: np.ndarray,
                 middle: Callable[[np.ndarray, int, Callable[[], None]], None] | None = None) -> None:
        self.op = op
        self.group = group
        self.buf = buf
        self.middle = middle
        me = op.engine.rank
        self.j = group.index(me)
        self.peers = [r for r in group if r != me]
        self.slices = slices(len(buf), len(group))
        self.region: same_host.Region | None = None  # taken for this op (the caller's array is private)
        self.in_place = False  # the caller's array is a shared array: the peers read it where it is
        self.mine: np.ndarray | None = None
        self.theirs: dict[int, np.ndarray] = {}
        self.done_from: set[int] = set()
        self.free_from: set[int] = set()
        self.stage = "ready"  # -> "middle" -> "done" -> "out"

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    def start(self) -> None:
        """Copy the slices the others sum into this worker's region and say so; a shared array
        (``SharedRegions.shared_array``) is named where it lies, with no copy."""
        shared = self.op.engine.shared
        placed = shared.locate(self.buf)
        if placed is not None:
            self.in_place = True
            self.mine = self.buf
            ref, offset = placed[0].ref, placed[1]
        else:
            self.region = shared.take(max(self.nbytes, 1))
            self.mine = self.region.array[:self.nbytes].view(self.buf.dtype)
            for i, (a, b) in enumerate(self.slices):
                if i != self.j:
                    self.mine[a:b] = self.buf[a:b]
            ref, offset = self.region.ref, 0
        for rank in self.peers:  # the byte offset in the region travels as step (low 32 bits) and segment
            self.op.send(rank, Kind.SHM_READY, step=offset & 0xFFFFFFFF, segment=offset >> 32, aux=ref)
        self._check_ready()

    def on_message(self, src: int, record: Record, data: Any) -> None:
        """Take a ``SHM_*`` message of a worker of this host.

        Raises:
            ProtocolError: not from this host's workers, or a region that cannot be mapped.
        """
        if src not in self.peers or record.kind not in (Kind.SHM_READY, Kind.SHM_DONE, Kind.SHM_FREE):
            raise ProtocolError(f"worker {src} sent an unexpected message (kind {record.kind}) for the same-host "
                                f"steps of {self.op.describe()}")
        self.op.first_time(src, record)
        if record.kind == Kind.SHM_READY:
            offset = record.step | record.segment << 32
            if offset % self.buf.itemsize:
                raise ProtocolError(f"worker {src} named its value at byte {offset} of its region, not a multiple "
                                    f"of the {self.buf.itemsize}-byte elements of {self.op.describe()}")
            view = self.op.engine.shared.view(src, record.aux, self.nbytes, offset)
            self.theirs[src] = view.view(self.buf.dtype)
            self._check_ready()
        elif record.kind == Kind.SHM_DONE:
            self.done_from.add(src)
            self._check_done()
        else:
            self.free_from.add(src)
            self._check_free()

    def _check_ready(self) -> None:
        if self.stage != "ready" or len(self.theirs) < len(self.peers):
            return
        self.stage = "middle"
        a, b = self.slices[self.j]
        mine = self.buf[a:b]
        others = [self.theirs[rank][a:b] for rank in self.peers]  # this worker alone sums slice j: the same bits everywhere
        if self.middle is None:  # the sum is final: published block by block while still in cache
            sum_slice(mine, others, None if self.in_place else self.mine[a:b])
            self._say_done()
        else:
            sum_slice(mine, others, None)
            self.middle(mine, a, self._after_middle)

    def _after_middle(self) -> None:
        """The rings across hosts left the slice's sum in the value: publish it (a shared array is its own region)."""
        if not self.in_place:
            a, b = self.slices[self.j]
            self.mine[a:b] = self.buf[a:b]
        self._say_done()

    def _say_done(self) -> None:
        for rank in self.peers:
            self.op.send(rank, Kind.SHM_DONE)
        self.stage = "done"
        self._check_done()

    def _check_done(self) -> None:
        if self.stage != "done" or len(self.done_from) < len(self.peers):
            return
        for i, rank in enumerate(self.group):
            if rank != self.op.engine.rank:
                a, b = self.slices[i]
                self.buf[a:b] = self.theirs[rank][a:b]
        for rank in self.peers:
            self.op.send(rank, Kind.SHM_FREE)
        self.theirs.clear()
        self.stage = "out"
        if not self.in_place:  # the peers read a region of the op's own, not the caller's array
            self.op.local_done()
        self._check_free()

    def _check_free(self) -> None:
        if self.stage != "out" or len(self.free_from) < len(self.peers) or self.mine is None:
            return
        if self.in_place:  # the peers are done reading the caller's array: only now may it change
            self.mine = None
            self.op.finished = True
            self.op.local_done()
            return
        self.op.engine.shared.give(self.region)
        self.region = self.mine = None
        self.op.finished = True

    def waiting_for(self) -> set[int]:
        """The workers of this host whose next message has not come."""
        if self.stage == "ready":
            return set(self.peers) - set(self.theirs)
        if self.stage == "done":
            return set(self.peers) - self.done_from
        if self.stage == "out" and self.in_place and self.mine is not None:
            return set(self.peers) - self.free_from
        return set()


class ShmAllreduce(Op):
    """Sum ``buf`` (flat) over the workers of this host (every worker of the job) through shared memory."""

    kind = "shm"

    def __init__(self, engine: Any, tag: Tag, desc: Desc, label: str, buf: np.ndarray) -> None:
        super().__init__(engine, tag, desc, label)
        self.phase = LocalPhase(self, engine.topology.local(), buf)

    def start(self) -> None:
        self.phase.start()

    def on_message(self, src: int, record: Record, data: Any) -> None:
        self.phase.on_message(src, record, data)

    def waiting_for(self) -> set[int]:
        return self.phase.waiting_for()

    def local_done(self) -> None:
        """The sum is in place (the peers may still be reading this worker's region)."""
        self.complete()


class HierarchicalAllreduce(ShmAllreduce):
    """Sum ``buf`` over every worker: within each host through shared memory, across hosts by one
    ring per slice (see the module docstring)."""

    kind = "hierarchical"

    def __init__(self, engine: Any, tag: Tag, desc: Desc, label: str, buf: np.ndarray) -> None:
        Op.__init__(self, engine, tag, desc, label)
        topology = engine.topology
        group = topology.local()
        j = group.index(engine.rank)
        firsts = sorted({min(topology.local(r)) for r in range(topology.size)})
        self.across = [topology.local(first)[j] for first in firsts]  # worker j of every host
        self.ring: RingState | None = None
        self._ring_early: list[tuple[int, Record, Any]] = []
        self.phase = LocalPhase(self, group, buf, self._across_hosts)

    def _across_hosts(self, view: np.ndarray, base: int, done: Callable[[], None]) -> None:
        self.ring = RingState(self, self.across, view, base, done)
        early, self._ring_early = self._ring_early, []
        for message in early:
            self.ring.on_message(*message)
        self.ring.start()

    def on_message(self, src: int, record: Record, data: Any) -> None:
        if record.kind in (Kind.RING_RS, Kind.RING_AG):
            if self.ring is None:  # another host finished its same-host step first
                if len(self._ring_early) >= _EARLY_RING:
                    raise ProtocolError(f"worker {src} sent more ring messages for {self.describe()} than it has")
                self._ring_early.append((src, record, data))
            else:
                self.ring.on_message(src, record, data)
            return
        self.phase.on_message(src, record, data)

    def destination(self, src: int, record: Record) -> np.ndarray | None:
        return self.ring.destination(src, record) if self.ring is not None else None

    def waiting_for(self) -> set[int]:
        waiting = self.phase.waiting_for()
        if self.phase.stage == "middle":
            waiting |= self.ring.waiting_for() if self.ring is not None else set()
        return waiting
