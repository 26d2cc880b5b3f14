"""Shared memory between processes of one host, for big values: the same-host fast path.

A worker keeps one region per (key part, server) for pushes and one for pulls. A region is an
anonymous ``memfd`` mapped in the worker; a server on the same host maps it through
``/proc/<pid>/fd/<fd>``. Nothing has a name in a file system, so nothing outlives the processes:
a killed job leaves no shared memory behind.

A push then copies the value into the region once and sends only a small message naming it; the
server sums straight out of the region. A server keeps big stored values in regions of its own
(``psnode.server.shared_values``): a pull's reply then names the server's region, the worker copies
the value out of it and writes the number the reply gave it into its pull region's *receipt* (the 8
bytes after the value), which tells the server that region is read. A stored value elsewhere is
written by the server into the worker's pull region, and the reply says only that it is there. The
regions replace the copies into and out of the kernel that a socket needs.

On the wire a part in shared memory has ``frame == IN_SHARED_MEMORY`` (the region its worker named)
or ``IN_SERVER_MEMORY`` (a server's region; ``seq`` carries the receipt) and
``offset == pid << 32 | fd``.

A reference comes from the network, so neither side trusts it: a process maps only a region of the
process the reference's sender registered as (the pid in the address book), and only when the
descriptor it opened is this job's memfd (its name carries a tag of the job id: ``job_tag``), a
regular file with no name on disk, at least as big as the part. Anything else is refused with an
error naming what was wrong; no path or descriptor a peer names is opened otherwise.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import stat

import numpy as np

__all__ = ["IN_SHARED_MEMORY", "IN_SERVER_MEMORY", "SHM_MIN", "receipt_offset", "Region", "Attachments",
           "WorkerRegions", "RefusedRegion", "probe", "can_attach", "encode", "decode", "job_tag"]

IN_SHARED_MEMORY = 0xFFFF
"""An entry's ``frame`` when the part lies in shared memory (``psnode.node.protocol``'s entries):
``offset`` names the region."""
IN_SERVER_MEMORY = 0xFFFE
"""A pull reply entry's ``frame`` when the value lies in a region of the server's: ``offset`` names
it, ``seq`` is the receipt the worker writes once it copied the value out."""
SHM_MIN = 1 << 20  # parts smaller than this go in the message: a region would not pay for itself


def receipt_offset(nbytes: int) -> int:
    """Where a region of ``nbytes`` keeps its receipt (a u64 after the value, 8-byte aligned)."""
    return (nbytes + 7) & ~7


class RefusedRegion(ValueError):
    """A shared-memory reference that names something other than a region of this job's sender."""


def job_tag(job_id: str) -> str:
    """The memfd name of the job's regions: ``pslaunch-`` and 12 hex digits of the job id's hash."""
    return "pslaunch-" + hashlib.sha256(job_id.encode()).hexdigest()[:12]


class Region:
    """A shared-memory buffer this process owns (closed with it), named with its job's tag: ``nbytes``
    of value (``array``), then the receipt a server reads (``receipt``, a u64 this process writes)."""

    def __init__(self, nbytes: int, name: str = "pslaunch") -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        size = receipt_offset(nbytes) + 8
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.array = np.frombuffer(self.map, dtype=np.uint8, count=nbytes)
        self.receipt = np.frombuffer(self.map, dtype=np.uint64, count=1, offset=receipt_offset(nbytes))
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


def _open_region(ref: int, pid: int, tag: str, nbytes: int) -> int:
    """Open the region ``ref`` of process ``pid`` after checking it is one of this job's regions.

    Raises:
        RefusedRegion: the reference names another process, or not a memfd of this job, or one too
            small; OSError: it cannot be opened (the process is gone).
    """
    owner, fd = decode(ref)
    if owner != pid or pid <= 0:
        raise RefusedRegion(f"a shared-memory reference to process {owner}, but its sender is process {pid}")
    handle = os.open(f"/proc/{owner}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        # what this process has opened, not what the path named a moment ago: no race with a reused fd
        target = os.readlink(f"/proc/self/fd/{handle}")
        info = os.fstat(handle)
        if target != f"/memfd:{tag} (deleted)" or not stat.S_ISREG(info.st_mode) or info.st_nlink != 0:
            raise RefusedRegion(f"fd {fd} of process {owner} is {target!r}, not a shared-memory region of this job")
        if info.st_size < nbytes:
            raise RefusedRegion(f"the region fd {fd} of process {owner} has {info.st_size} bytes, not {nbytes}")
    except BaseException:
        os.close(handle)
        raise
    return handle


class Attachments:
    """Regions of other processes of the job this process has mapped, by wire reference.

    ``tag`` is the job's memfd name (``job_tag``): nothing else is ever mapped.
    """

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}

    def view(self, ref: int, nbytes: int, pid: int, offset: int = 0) -> np.ndarray:
        """A writable uint8 view of ``nbytes`` of region ``ref`` of process ``pid``, from byte ``offset``.

        Raises:
            RefusedRegion: the reference is not a region of this job's process ``pid``, or the
                region ends before ``offset + nbytes``.
            OSError: the region cannot be mapped (the owner is gone).
        """
        end = offset + nbytes
        if offset < 0:
            raise RefusedRegion(f"a view at byte {offset} of a shared-memory region")
        entry = self._maps.get(ref)
        if entry is None or len(entry[1]) < end:
            handle = _open_region(ref, pid, self.tag, end)
            try:
                mapped = mmap.mmap(handle, os.fstat(handle).st_size)
            finally:
                os.close(handle)
            entry = (mapped, np.frombuffer(mapped, dtype=np.uint8))
            self._maps[ref] = entry
        return entry[1][offset:end]


def probe(job_id: str) -> Region:
    """A tiny region peers map once to learn whether this host lets them (``can_attach``)."""
    region = Region(8, job_tag(job_id))
    region.array[:] = 0x5A
    return region


def can_attach(ref: int, pid: int, tag: str) -> bool:
    """True when this process can map the probe region ``ref`` of ``pid`` (and reads its pattern)."""
    try:
        handle = _open_region(ref, pid, tag, 8)
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

    def __init__(self, job_id: str) -> None:
        self.tag = job_tag(job_id)
        self._regions: dict[tuple[int, int, int], Region] = {}
        self.servers: set[int] = set()  # servers on this host that map this worker's shared memory

    def find_servers(self, servers: list, fingerprint: str) -> None:
        """Note which of ``servers`` (PeerInfo) share this host and can map our regions (their probe)."""
        self.servers = {p.rank for p in servers
                        if p.fingerprint == fingerprint and p.shm_probe and can_attach(p.shm_probe, p.pid, self.tag)}

    def region(self, slot: tuple[int, int, int], nbytes: int) -> Region | None:
        """The region of ``slot`` when it is free (None: use a message this time)."""
        region = self._regions.get(slot)
        if region is None or region.nbytes != nbytes:
            try:
                region = Region(nbytes, self.tag)
            except OSError:
                return None
            self._regions[slot] = region
        return region if region.free() else None
