"""The collectives' messages between workers: a header, a 48-byte record and, for data, one frame.

A message is ``[header, record]`` or ``[header, record, data]``. The header is the runtime's
(``psnode.node.protocol``) with ``cmd = COLL``, ``req_id`` = the collective's 64-bit key id and ``arg``
= its version (how many collectives of that key this worker started before): the *tag* that
matches a message to its collective on every worker, whatever order the workers start them in.

The record (``RECORD``, little endian)::

    kind      u16  what the message is (``Kind``)
    dtype     u8   the collective's dtype (``DTYPES``)
    flags     u8   spare
    shape     u32  crc32 of the collective's shape: workers that disagree on it are told so
    step      u32  the algorithm's step (ring steps), or the root (broadcast); ``SHM_READY``: the low
                   32 bits of the value's byte offset in the region
    segment   u32  which segment of its step; ``SHM_READY``: the offset's high 32 bits
    total     u64  elements of the whole collective
    offset    u64  where this message's elements start in it
    count     u64  how many elements the data frame holds
    aux       u64  a shared-memory region's reference (``SHM_READY``)

Every field is untrusted: ``unpack`` checks the kind, the dtype, that the elements lie inside the
collective and that the data frame holds exactly ``count`` elements; the algorithms check that the
sender, step and segment are ones they expect. An ``ERROR`` message's data is a UTF-8 sentence
(at most ``MAX_ERROR`` bytes) that every worker of the collective raises.
"""

from __future__ import annotations

import enum
import struct
import zlib
from typing import Any, NamedTuple, Sequence

import numpy as np

from psnode.errors import ProtocolError
from psnode.node.protocol import HEADER, Cmd, pack_header, unpack_header

__all__ = ["RECORD", "Kind", "Record", "Desc", "DTYPES", "dtype_code", "dtype_of", "shape_crc", "pack", "unpack",
           "MAX_ERROR", "PREFIX", "LANE_KINDS", "unpack_prefix", "peek_tag"]

RECORD = struct.Struct("<HBBIIIQQQQ")
_RECORD_SIZE = RECORD.size
_unpack_record = RECORD.unpack
MAX_ERROR = 4096


class Kind(enum.IntEnum):
    """What a collective message carries."""

    DIRECT = 1  # a worker's whole value, to every other worker (small allreduce)
    RING_RS = 2  # a segment of the ring's reduce-scatter
    RING_AG = 3  # a segment of the ring's allgather
    SHM_READY = 4  # "my value is in shared-memory region ``aux``, from byte ``step | segment << 32``"
    SHM_DONE = 5  # "my slice of the sum is in my region"
    SHM_FREE = 6  # "I read what I needed of your region; reuse it"
    BCAST = 7  # a segment of the root's value
    GATHER = 8  # a segment of a worker's value for allgather
    ERROR = 9  # the collective failed: a sentence every worker raises
    GO = 10  # rank 0 launched this GPU collective: launch it next (``nccl``)
    ACK = 11  # "I have the whole value" (to a broadcast's root)
    FLUSH = 12  # "say FLUSHED once you read this" (a finishing worker; no collective's tag)
    FLUSHED = 13  # "I read everything you sent before your FLUSH"


_KINDS = frozenset(int(k) for k in Kind)
_ERROR = int(Kind.ERROR)

DTYPES = [np.dtype(n) for n in ("float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32",
                                 "uint32", "int64", "uint64")]
"""The dtypes a collective sums, by wire code (index + 1)."""

_CODES = {d: i + 1 for i, d in enumerate(DTYPES)}
_NDTYPES = len(DTYPES)
_ITEMSIZES = [0] + [d.itemsize for d in DTYPES]


def dtype_code(dtype: Any) -> int:
    """The wire code of ``dtype``.

    Raises:
        TypeError: a dtype collectives do not sum (the message lists those they do).
    """
    code = _CODES.get(np.dtype(dtype))
    if code is None:
        raise TypeError(f"collectives sum {', '.join(d.name for d in DTYPES)}; not {np.dtype(dtype)}")
    return code


def dtype_of(code: int) -> np.dtype:
    """The dtype of wire code ``code``.

    Raises:
        ProtocolError: no dtype has that code.
    """
    if not 1 <= code <= len(DTYPES):
        raise ProtocolError(f"a collective message with dtype code {code}, not one of 1..{len(DTYPES)}")
    return DTYPES[code - 1]


def shape_crc(shape: Sequence[int]) -> int:
    """A 32-bit fingerprint of ``shape`` (workers compare it)."""
    return zlib.crc32(struct.pack(f"<{len(shape)}q", *shape))


class Desc:
    """What every worker of one collective must agree on: dtype and shape (and what follows from them).

    Raises:
        TypeError: a dtype collectives do not sum.
    """

    __slots__ = ("dtype", "shape", "total", "code", "crc")

    def __init__(self, dtype: Any, shape: Sequence[int]) -> None:
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(n) for n in shape)
        self.total = int(np.prod(self.shape, dtype=np.int64))
        self.code = dtype_code(self.dtype)
        self.crc = shape_crc(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the value."""
        return self.total * self.dtype.itemsize

    def mismatch(self, record: "Record") -> str | None:
        """How ``record``'s collective differs from this one, as words; None when it does not."""
        if record.dtype == self.code and record.total == self.total and record.shape == self.crc:
            return None
        theirs = dtype_of(record.dtype).name if 1 <= record.dtype <= len(DTYPES) else f"dtype code {record.dtype}"
        if record.total != self.total or record.dtype != self.code:
            return f"{theirs} with {record.total} elements"
        return f"{theirs} with {record.total} elements in another shape"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Desc) and (self.dtype, self.shape) == (other.dtype, other.shape)

    def __hash__(self) -> int:
        return hash((self.dtype, self.shape))

    def __str__(self) -> str:
        return f"{self.dtype.name} of shape {self.shape}"


class Record(NamedTuple):
    """One message's record (see the module docstring)."""

    kind: int
    dtype: int
    flags: int
    shape: int
    step: int
    segment: int
    total: int
    offset: int
    count: int
    aux: int


_make_record = Record._make


def pack(key_id: int, version: int, kind: int, desc: Desc, step: int = 0, segment: int = 0, offset: int = 0,
         count: int = 0, aux: int = 0, flags: int = 0) -> list:
    """The header and record frames of a message (append the data frame, if any)."""
    return [pack_header(Cmd.COLL, key_id, version),
            RECORD.pack(kind, desc.code, flags, desc.crc, step, segment, desc.total, offset, count, aux)]


def _itemsize_of(record: Record) -> int:
    """The element size of ``record``'s dtype, once its dtype and elements are checked.

    Raises:
        ProtocolError: an unknown dtype, or elements outside the collective.
    """
    code = record.dtype
    if not 1 <= code <= _NDTYPES:
        dtype_of(code)  # raises, naming it
    if record.offset + record.count > record.total:
        raise ProtocolError(f"a collective message with elements {record.offset}..{record.offset + record.count} "
                            f"of a collective of {record.total}")
    return _ITEMSIZES[code]


def unpack(frames: list) -> tuple[Record, Any]:
    """The record of a received message (its header already read) and its data frame's buffer (or None).

    Raises:
        ProtocolError: a wrong number of frames, a short record, an unknown kind or dtype, elements
            outside the collective, or a data frame of another length than ``count`` elements.
    """
    if len(frames) not in (2, 3):
        raise ProtocolError(f"a collective message of {len(frames)} frames, not 2 or 3")
    raw = frames[1].buffer if hasattr(frames[1], "buffer") else frames[1]
    if len(raw) != _RECORD_SIZE:
        raise ProtocolError(f"a collective record of {len(raw)} bytes, not {RECORD.size}")
    record = _make_record(_unpack_record(raw))
    kind = record.kind
    if kind not in _KINDS:
        raise ProtocolError(f"a collective message of unknown kind {kind}")
    data = None
    if len(frames) == 3:
        data = frames[2].buffer if hasattr(frames[2], "buffer") else memoryview(frames[2])
    if kind == _ERROR:
        if data is None or len(data) > MAX_ERROR:
            raise ProtocolError("a collective error message without a sentence, or one too long")
        return record, data
    itemsize = _itemsize_of(record)
    size = 0 if data is None else len(data)
    if size != record.count * itemsize:
        raise ProtocolError(f"a collective message of {size} data bytes for {record.count} elements of "
                            f"{itemsize} bytes")
    return record, data


PREFIX = HEADER.size + _RECORD_SIZE
"""Bytes before the data of a message on a lane (``psnode.transport.lanes``): its header and record frames."""

LANE_KINDS = frozenset({int(Kind.RING_RS), int(Kind.RING_AG), int(Kind.BCAST), int(Kind.GATHER)})
"""The kinds that travel on lanes: a segment of a value, always with data."""


def unpack_prefix(prefix: bytes) -> tuple[int, int, Record, int]:
    """The tag (key id, version), record and data bytes of a lane message's ``prefix``, checked
    before a byte of its data is read.

    Raises:
        ProtocolError: not a collective's header, a kind that does not travel on lanes, an unknown
            dtype, or elements outside the collective.
    """
    if len(prefix) != PREFIX:
        raise ProtocolError(f"a lane message prefix of {len(prefix)} bytes, not {PREFIX}")
    cmd, _, key_id, version = unpack_header(prefix[:HEADER.size])
    if cmd != Cmd.COLL:
        raise ProtocolError(f"a lane message with command {Cmd(cmd).name}, not {Cmd.COLL.name}")
    record = _make_record(RECORD.unpack_from(prefix, HEADER.size))
    if record.kind not in LANE_KINDS:
        raise ProtocolError(f"a lane message of kind {record.kind}, which does not travel on lanes")
    return key_id, version, record, record.count * _itemsize_of(record)


def peek_tag(prefix: bytes) -> tuple[int, int] | None:
    """The tag a lane message's ``prefix`` names, if its header is a collective's; else None."""
    try:
        cmd, _, key_id, version = unpack_header(prefix[:HEADER.size])
    except ProtocolError:
        return None
    return (key_id, version) if cmd == Cmd.COLL else None
