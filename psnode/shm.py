"""Shared memory between processes of one host, for big values: the same-host fast path.

A worker keeps one region per (key part, server) for pushes and one for pulls. A region is an
anonymous ``memfd`` mapped in the worker; a server on the same host maps it through
``/proc/<pid>/fd/<fd>``. Nothing has a name in a file system, so nothing outlives the processes:
a killed job leaves no shared memory behind.

A push then copies the value into the region once and sends only a small message naming it; the
server sums straight out of the region. A pull reply is written by the server into the worker's
pull region and the message says only that it is there. The regions replace the copies into and
out of the kernel that a socket needs.

On the wire a part in shared memory has ``frame == SHM_FRAME`` (``protocol.IN_SHARED_MEMORY``) and
``offset == pid << 32 | fd``.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from .protocol import IN_SHARED_MEMORY

__all__ = ["SHM_FRAME", "SHM_MIN", "Region", "Attachments", "WorkerRegions", "probe", "can_attach", "encode", "decode"]

SHM_FRAME = IN_SHARED_MEMORY
SHM_MIN = 1 << 20  # parts smaller than this go in the message: a region would not pay for itself


class Region:
    """A shared-memory buffer this process owns (closed with it)."""

    def __init__(self, nbytes: int, name: str = "pslaunch") -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(nbytes, 1))
        self.map = mmap.mmap(self.fd, max(nbytes, 1))
        self.array = np.frombuffer(self.map, dtype=np.uint8, count=nbytes)
        self.nbytes = nbytes
        self.ref = encode(os.getpid(), self.fd)
        self.busy = None  # the future of the last request using it; reusable once that is done

    def free(self) -> bool:
        """True when no request in flight uses the region."""
        return self.busy is None or self.busy.done()


def encode(pid: int, fd: int) -> int:
    """The wire reference of a region."""
    return (pid << 32) | fd


def decode(ref: int) -> tuple[int, int]:
    """``(pid, fd)`` from a wire reference."""
    return ref >> 32, ref & 0xFFFFFFFF


class Attachments:
    """Regions of other processes this process has mapped, by wire reference."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}

    def view(self, ref: int, nbytes: int) -> np.ndarray:
        """A writable uint8 view of the first ``nbytes`` of region ``ref``.

        Raises:
            OSError: the region cannot be mapped (another host, or the owner is gone).
        """
        entry = self._maps.get(ref)
        if entry is None or len(entry[1]) < nbytes:
            pid, fd = decode(ref)
            handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
            try:
                size = os.fstat(handle).st_size
                mapped = mmap.mmap(handle, size)
            finally:
                os.close(handle)
            entry = (mapped, np.frombuffer(mapped, dtype=np.uint8))
            self._maps[ref] = entry
        return entry[1][:nbytes]


def probe() -> Region:
    """A tiny region peers map once to learn whether this host lets them (``can_attach``)."""
    region = Region(8, "pslaunch-probe")
    region.array[:] = 0x5A
    return region


def can_attach(ref: int) -> bool:
    """True when this process can map the region ``ref`` (and reads the probe's pattern)."""
    try:
        pid, fd = decode(ref)
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            mapped = mmap.mmap(handle, 8)
        finally:
            os.close(handle)
        ok = mapped[:8] == b"\x5a" * 8
        mapped.close()
        return ok
    except (OSError, ValueError):
        return False


class WorkerRegions:
    """A worker's regions, one per (key part, server, push 0 / pull 1), and the servers that can map them.

    A region is reused once the request that used it is done (``Region.busy``); a busy one means the
    part travels in the message this time.
    """

    def __init__(self) -> None:
        self._regions: dict[tuple[int, int, int], Region] = {}
        self.servers: set[int] = set()  # servers on this host that map this worker's shared memory

    def find_servers(self, servers: list, fingerprint: str) -> None:
        """Note which of ``servers`` (PeerInfo) share this host and can map our regions (their probe)."""
        self.servers = {p.rank for p in servers if p.fingerprint == fingerprint and p.shm_probe and can_attach(p.shm_probe)}

    def region(self, slot: tuple[int, int, int], nbytes: int) -> Region | None:
        """The region of ``slot`` when it is free (None: use a message this time)."""
        region = self._regions.get(slot)
        if region is None or region.nbytes != nbytes:
            try:
                region = Region(nbytes)
            except OSError:
                return None
            self._regions[slot] = region
        return region if region.free() else None
