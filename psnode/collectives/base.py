"""The collectives' interface: one collective as a state machine (``Op``), the job's shape
(``Topology``), and the allreduce algorithms by name.

An ``Op`` is one collective on this worker, identified on every worker by its tag (key id,
version). ``start`` runs on the thread that calls the collective: it sends what this worker can
send at once. ``on_message`` runs on the thread that receives for the node, once per message of
the op from another worker, under the op's lock; it sums or copies what came, sends what that
allows, and calls ``complete`` when the result is in place. Nothing in an op blocks: a worker runs
many ops at once (asynchronous pushes), each advancing as its messages arrive.

An op names the peers it still waits for (``waiting_for``): when one of them leaves the job the
engine fails the op naming it, and a stalled op's warning names them.

Allreduce algorithms are known by name (``_ALGORITHMS``, imported on first use); ``choose`` picks one from the
value's size and the topology, the same on every worker (it reads only what every worker knows:
the address book and the job's settings).
"""

from __future__ import annotations

import abc
import importlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from psnode.errors import ProtocolError, PSNodeError

from .wire import Desc, Kind, Record, pack

__all__ = ["Op", "Tag", "Topology", "algorithm", "algorithm_names", "choose",
           "DIRECT_MAX", "SEGMENT", "SEGMENT_MAX", "TRACK_MIN", "ring_segment", "slices", "segment_named",
           "copy_in"]

Tag = tuple[int, int]
"""``(key id, version)``: names one collective on every worker."""

DIRECT_MAX = 256 << 10  # an allreduce sending at most this many bytes in all goes directly to every worker
SEGMENT = 1 << 20  # bytes per message of a big value: the reduction of one overlaps the transfer of the next
SEGMENT_MAX = 4 << 20  # a ring's segments grow up to this with the chunk (``ring_segment``)
TRACK_MIN = 64 << 10  # data frames at least this big leave without a copy (and are tracked until sent)


def ring_segment(chunk: int, itemsize: int) -> int:
    """Elements per segment of a ring whose biggest chunk has ``chunk`` elements: a quarter of the
    chunk, at least ``SEGMENT`` and at most ``SEGMENT_MAX`` bytes.

    Each message costs a fixed amount besides its bytes (a wake-up of the receiving thread, a
    tracked zero-copy send, the Python of a segment): on the TCP ring of 2 and 4 workers 4 MiB
    segments took 15 to 20 % less time per 64 MiB allreduce than 1 MiB ones (docs/benchmarks.md).
    Four segments per chunk still let the reduction of one overlap the transfer of the next. A pure
    function of the sizes: every worker of the ring cuts its chunks alike.
    """
    target = min(SEGMENT_MAX, max(SEGMENT, chunk * itemsize // 4))
    return max(1, target // itemsize)


def slices(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` element ranges covering ``total``, sizes differing by one at most."""
    return [(i * total // parts, (i + 1) * total // parts) for i in range(parts)]


def segment_named(segments: list[tuple[int, int]], record: Record, base: int = 0) -> tuple[int, int] | None:
    """Segment ``record.segment`` of ``segments`` (element ranges, offset by ``base`` in the
    collective) when ``record`` names exactly its elements, else None."""
    s = record.segment
    if s >= len(segments):
        return None
    a, b = segments[s]
    return (a, b) if (record.offset, record.count) == (base + a, b - a) else None


def copy_in(place: np.ndarray, data: Any) -> None:
    """Copy a segment's data into ``place``, unless it was read there already (``Op.destination``)."""
    incoming = np.frombuffer(data, place.dtype, len(place))
    if incoming.ctypes.data != place.ctypes.data:
        np.copyto(place, incoming)


@dataclass(frozen=True)
class Topology:
    """Where the workers run: ``hosts[r]`` is worker ``r``'s host number (0, 1, ... in rank order of
    first appearance); ``shm``: workers of one host reduce through shared memory."""

    rank: int
    hosts: tuple[int, ...]
    shm: bool

    @property
    def size(self) -> int:
        """Workers in the job."""
        return len(self.hosts)

    def local(self, rank: int | None = None) -> list[int]:
        """The workers on ``rank``'s host (this worker's by default), by rank."""
        host = self.hosts[self.rank if rank is None else rank]
        return [r for r, h in enumerate(self.hosts) if h == host]

    @property
    def host_count(self) -> int:
        """How many hosts the workers run on."""
        return len(set(self.hosts))

    def uniform_local_size(self) -> int | None:
        """Workers per host when every host runs as many, else None."""
        counts = {h: self.hosts.count(h) for h in set(self.hosts)}
        sizes = set(counts.values())
        return sizes.pop() if len(sizes) == 1 else None

    @classmethod
    def of(cls, rank: int, fingerprints: list[str], shm: bool) -> "Topology":
        """From the workers' host fingerprints (the address book's, by rank)."""
        numbers: dict[str, int] = {}
        return cls(rank, tuple(numbers.setdefault(f, len(numbers)) for f in fingerprints), shm)


def choose(nbytes: int, topology: Topology) -> str:
    """The allreduce algorithm for a value of ``nbytes`` on ``topology`` (the same on every worker).

    Small values go ``direct`` (one message to every worker: one hop); big ones through shared
    memory on one host (``shm``), ``hierarchical`` over several hosts with as many workers each,
    else a pipelined ``ring``.
    """
    size = topology.size
    if size == 1:
        return "direct"
    if nbytes * (size - 1) <= DIRECT_MAX:
        return "direct"
    local = topology.uniform_local_size()
    if topology.shm and topology.host_count == 1:
        return "shm"
    if topology.shm and local is not None and local > 1:
        return "hierarchical"
    return "ring"


class Runner(Protocol):
    """What an op uses of the engine that runs it (``engine.Engine``): who this worker is among
    how many, the topology and shared memory, and the engine's send, completion and abort."""

    rank: int
    size: int
    topology: Topology
    shared: Any

    def send(self, rank: int, frames: list, track: bool) -> Any: ...

    def complete(self, op: "Op") -> None: ...

    def abort(self, op: "Op", error: PSNodeError, tell: bool = True) -> None: ...


class Op(abc.ABC):
    """One collective on this worker (see the module docstring).

    ``label`` names it in errors (``allreduce of key 'w'``). ``future`` completes when the result
    is in place and every buffer this worker sent from is free again.
    """

    kind = "collective"

    def __init__(self, engine: Runner, tag: Tag, desc: Desc, label: str) -> None:
        self.engine = engine
        self.tag = tag
        self.desc = desc
        self.label = label
        self.future: Any = None  # the engine gives the caller's future, or a new one
        self.lock = threading.RLock()
        self.finished = False  # no more messages expected (the engine forgets the op)
        self.trackers: list[Any] = []  # zero-copy sends still leaving
        self.started = time.monotonic()
        self._seen: set[tuple[int, int, int, int]] | None = None  # (src, kind, step, segment): none counts twice

    @abc.abstractmethod
    def start(self) -> None:
        """Send what this worker can send at once (the calling thread, under ``lock``)."""

    @abc.abstractmethod
    def on_message(self, src: int, record: Record, data: Any) -> None:
        """Take one message of worker ``src`` (the receiving thread, under ``lock``).

        Raises:
            ProtocolError: a message this op did not expect (naming what came).
        """

    @abc.abstractmethod
    def waiting_for(self) -> set[int]:
        """The workers this op still needs a message from."""

    def destination(self, src: int, record: Record) -> np.ndarray | None:
        """Where the data of ``record`` from worker ``src`` belongs, asked before it is read (a lane's
        message, ``lane_path``): a view of this op's value that ``on_message`` then gets as the data,
        or None (it arrives in a buffer of its own). Only for a message this op expects and has not
        taken yet (under ``lock``); by default None."""
        return None

    # ---- helpers for the algorithms -------------------------------------------------------------
    def describe(self) -> str:
        """``allreduce of key 'w' (version 3)``."""
        return f"{self.label} (version {self.tag[1]})"

    def seen(self, src: int, record: Record) -> bool:
        """Whether a message with ``record``'s (sender, kind, step, segment) was taken already."""
        return self._seen is not None and (src, record.kind, record.step, record.segment) in self._seen

    def first_time(self, src: int, record: Record) -> None:
        """Refuse a message that was already taken (a peer must not make a segment count twice).

        Raises:
            ProtocolError: the same (sender, kind, step, segment) came before.
        """
        mark = (src, record.kind, record.step, record.segment)
        if self._seen is None:
            self._seen = set()
        elif mark in self._seen:
            raise ProtocolError(f"worker {src} sent segment {record.segment} of step {record.step} of "
                                f"{self.describe()} twice")
        self._seen.add(mark)

    def send(self, rank: int, kind: Kind, step: int = 0, segment: int = 0, offset: int = 0, count: int = 0,
             aux: int = 0, data: np.ndarray | bytes | None = None) -> None:
        """Send one message of this op to worker ``rank``; a big array leaves without a copy and is tracked."""
        frames = pack(self.tag[0], self.tag[1], kind, self.desc, step, segment, offset, count, aux)
        track = False
        if data is not None:
            if isinstance(data, np.ndarray):
                if data.nbytes >= TRACK_MIN:
                    track = True
                    data = data.reshape(-1).view(np.uint8) if data.flags.c_contiguous else np.ascontiguousarray(data)
                else:
                    data = data.tobytes()
            frames.append(data)
        tracker = self.engine.send(rank, frames, track)
        if tracker is not None and not getattr(tracker, "done", True):
            self.trackers.append(tracker)

    def complete(self) -> None:
        """The result is in place: complete the future once every tracked send has left."""
        self.engine.complete(self)

    def abort(self, error: PSNodeError, tell: bool = True) -> None:
        """Fail this op here and, with ``tell``, on every other worker (an ``ERROR`` message)."""
        self.engine.abort(self, error, tell)


_ALGORITHMS: dict[str, str | Callable[..., Op]] = {
    "direct": "psnode.collectives.direct:DirectAllreduce",
    "ring": "psnode.collectives.ring:RingAllreduce",
    "shm": "psnode.collectives.local:ShmAllreduce",
    "hierarchical": "psnode.collectives.local:HierarchicalAllreduce",
}


def algorithm_names() -> list[str]:
    """Every allreduce algorithm's name, sorted."""
    return sorted(_ALGORITHMS)


def algorithm(name: str) -> Callable[..., Op]:
    """The allreduce ``Op`` class called ``name``.

    Raises:
        ValueError: no algorithm has that name; the message lists the known ones.
    """
    factory = _ALGORITHMS.get(name)
    if factory is None:
        raise ValueError(f"unknown allreduce algorithm {name!r}; known: {', '.join(algorithm_names())}")
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        _ALGORITHMS[name] = factory
    return factory
