"""Big stored values in shared memory that the server's workers on its host copy out themselves.

**Why.** On one host a pull's reply used to be written by the server into each worker's pull region:
one pass over the value per worker, one after the other on the server's loop, after the round
closed; a 4 MiB round of 2 workers on 2 cores spent about a third of its time there. When the
stored value itself lies in a region of the server's, the reply names that region instead
(``same_host.IN_SERVER_MEMORY``) and each worker copies the value out in its own process, all at
once, while the server goes on.

**Reading.** A reply that names a value region carries a *receipt*: a number the worker writes into
its own pull region's receipt cell (``same_host.Region.receipt``, which the server maps) once it has
copied the value out. ``Receipt`` is done when the cell holds that number or more. Each reply's
receipt joins the shard's trackers, so the store's own rule keeps the value unchanged while a worker
may read it (``ServerStore._update`` writes a new array when a tracker is not done).

**Reuse.** A value region is handed out again only once no array of the server's refers to it (the
store replaced it; a finalizer says so) and every receipt given for it is done, so no worker still
copies from it. Regions are never closed while the server runs: a worker keeps its mapping of a
reference, which must go on naming the same memory. They are bounded: all together at most
``SPARE`` times the bytes of the values placed here, and a quarter of the descriptors the process
may open (each region holds one, and sockets need theirs); past that a value is kept in private
memory and its replies are copied into the workers' regions as before.

Thread-safety: the server's loop calls everything here. A finalizer runs on whichever thread drops an
array's last reference (the loop, or a thread that was sending it: a lane's, ZeroMQ's) and only
clears a flag the loop reads.
"""

from __future__ import annotations

import resource
import weakref
from typing import Any

import numpy as np

from psnode.transport import same_host

__all__ = ["SharedValues", "Receipt", "SPARE"]

SPARE = 3  # regions' bytes per byte of the values placed: the stored value, the next round's sum, one still read
_DONE = (1 << 63) - 1  # a receipt cell of a worker that is gone: every receipt it was given counts as done


class Receipt:
    """Done once a worker wrote ``number`` or more into its receipt ``cell`` (a u64 view of its region)."""

    __slots__ = ("cell", "number")

    def __init__(self, cell: np.ndarray, number: int) -> None:
        self.cell = cell
        self.number = number

    @property
    def done(self) -> bool:
        return int(self.cell[0]) >= self.number


def give_up(cell: np.ndarray) -> None:
    """The worker that owns ``cell`` is gone: every receipt it was given is done."""
    cell[0] = _DONE


class _Value:
    """One region of the pool: ``used`` while an array of the server's refers to it, read by ``readers``."""

    __slots__ = ("region", "readers", "used")

    def __init__(self, region: same_host.Region) -> None:
        self.region = region
        self.readers: list[Receipt] = []
        self.used = False

    def read_by(self, receipt: Receipt) -> int:
        """The wire reference of this region, which a worker reads until ``receipt`` is done."""
        self.readers.append(receipt)
        return self.region.ref

    def free(self) -> bool:
        if self.used:
            return False
        self.readers = [r for r in self.readers if not r.done]
        return not self.readers


class SharedValues:
    """The server's value regions (see the module docstring); ``tag``: the job's memfd name."""

    def __init__(self, tag: str, min_bytes: int = same_host.SHM_MIN) -> None:
        self.tag = tag
        self.min_bytes = min_bytes
        self.placed = 0  # bytes of the values placed here
        self.held = 0  # bytes of every region
        self._by_address: dict[int, _Value] = {}
        self._by_size: dict[int, list[_Value]] = {}
        self.max_regions = resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4

    def empty(self, nbytes: int, dtype: Any, placed: bool = False) -> np.ndarray | None:
        """A flat array of ``nbytes`` in a value region, or None (too small, or the pool is full);
        ``placed``: it holds a value of its own (a key's first array), which the bound counts."""
        if nbytes < self.min_bytes:
            return None
        if placed:
            self.placed += nbytes
        value = self._reusable(nbytes) or self._new(nbytes)
        if value is None:
            return None
        value.used = True
        dtype = np.dtype(dtype)
        array = np.frombuffer(value.region.map, dtype=dtype, count=nbytes // dtype.itemsize)
        weakref.finalize(array, _unused, value)
        return array

    def _reusable(self, nbytes: int) -> _Value | None:
        for value in self._by_size.get(nbytes, ()):
            if value.free():
                return value
        return None

    def _new(self, nbytes: int) -> _Value | None:
        if self.held + nbytes > SPARE * self.placed or len(self._by_address) >= self.max_regions:
            return None
        try:
            region = same_host.Region(nbytes, self.tag)
        except OSError:  # out of memory or descriptors: private memory serves as well
            return None
        value = _Value(region)
        self.held += nbytes
        self._by_address[region.array.ctypes.data] = value
        self._by_size.setdefault(nbytes, []).append(value)
        return value

    def region_of(self, array: np.ndarray) -> _Value | None:
        """The value region ``array`` is the whole value of, or None (private memory, or a part)."""
        if not self._by_address or not array.flags.c_contiguous:
            return None
        value = self._by_address.get(array.ctypes.data)
        return value if value is not None and value.region.nbytes == array.nbytes else None

    def serve(self, array: np.ndarray, receipt: Receipt) -> int | None:
        """The wire reference of ``array``'s region, which a worker will read until ``receipt`` is
        done; None when ``array`` lies in no region (reply with a copy)."""
        value = self.region_of(array)
        return None if value is None else value.read_by(receipt)


def _unused(value: _Value) -> None:
    value.used = False
