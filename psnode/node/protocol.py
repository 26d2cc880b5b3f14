"""The wire format: a fixed 24-byte header frame, then (per command) a meta frame and raw data frames.

Header (little endian, ``HEADER``)::

    magic  2s   b"PS"
    version u8  2
    cmd    u8   one of ``Cmd``
    flags  u16  ``FLAG_*`` bits
    spare  u16
    req_id u64  matches a reply to its request
    arg    i64  command argument (barrier group, priority, ...)

Data commands (push, pull, rows) carry a meta frame: a packed array of ``ENTRY`` records, one per
key part, that says where its bytes lie in which data frame (64-bit offsets and lengths, so no
32-bit size limit) and how they are encoded (``codec``: ``psnode.compression.codecs``; ``raw`` is 0). Data frames are the arrays' raw bytes, sent and received without copies and
read with ``numpy.frombuffer``. Control commands (register, address book, errors, init) carry one
JSON frame (a checkpoint request and its reply too). Nothing on the wire is pickled except the updater a worker ships with ``set_updater``
(a control message, only ever unpickled by a server of the same job).

The small round trip has two single-frame commands whose header frame carries the whole message
(``COMPACT_CMDS``): ``PUSH_PULL`` (a push of one small part and a pull of the same part, the
``ONE_PART`` record after the header, then the value's bytes) and ``VALUE`` (the reply to a pull of
one part: the header, then the value's bytes). One struct unpack reads either; the general form
would take five frames and a dozen Python objects per message.
"""

from __future__ import annotations

import enum
import itertools
import json
import struct
from typing import Any

import numpy as np

from psnode.errors import ProtocolError
from psnode.transport.same_host import IN_SERVER_MEMORY, IN_SHARED_MEMORY  # frame numbers of the entries below

__all__ = [
    "HEADER",
    "MAGIC",
    "VERSION",
    "Cmd",
    "FLAG_ERROR",
    "FLAG_SYNC",
    "FLAG_ACKS",
    "FLAG_PULL",
    "FLAG_OFFER",
    "FLAG_REDO",
    "FLAG_MIRROR",
    "ENTRY",
    "Group",
    "GROUP_ROLES",
    "parse_group",
    "pack_header",
    "unpack_header",
    "with_flags",
    "pack_json",
    "unpack_json",
    "unpack_entries",
    "pack_entries",
    "ENTRY_STRUCT",
    "COMPACT_CMDS",
    "ONE_PART",
    "PUSH_PULL",
    "pack_push_pull",
    "unpack_push_pull",
    "pack_value",
    "peek",
    "peek_req_id",
    "peek_arg",
    "IN_SERVER_MEMORY",
    "IN_SHARED_MEMORY",
    "MAX_DATA_FRAMES",
    "PACK_LIMIT",
    "MAX_ENTRIES",
    "OWN_FRAME",
    "pack_codec_params",
    "unpack_codec_params",
    "MARK_COUNT",
    "MAX_MARK_SCALARS",
    "pack_counts",
]

HEADER = struct.Struct("<2sBBHHQq")
MAGIC = b"PS"
VERSION = 2  # 2: entries carry a codec

FLAG_ERROR = 1  # the reply carries a JSON error {"error": message} instead of a result
FLAG_SYNC = 2  # init: the key is merged per round (dist_sync), else applied on arrival (dist_async)
FLAG_ACKS = 4  # a reply whose last frame holds push acknowledgements: (req_id, parts) u64 pairs
FLAG_PULL = 8  # a push whose last two frames are a whole pull message (header, meta), run right after it
FLAG_OFFER = 16  # a push of one big part without its value: it follows once the server sends PUSH_INVITE
# init / set-updater from a worker 0 started again alone, redoing what its predecessor may have done
# before it died: a key already there alike (key, dtype, size) counts as initialised, an updater
# already installed stays (with its state)
FLAG_REDO = 32
# a worker's copy, for a replica, of what it sends a server (PSLAUNCH_SERVER_REPLICAS): the replica
# takes it as the server does and answers nothing (the server answers)
FLAG_MIRROR = 64


class Cmd(enum.IntEnum):
    """Commands; replies are their own commands so a node never guesses what a frame is."""

    REGISTER = 1
    ADDRBOOK = 2
    REGISTER_FAILED = 3
    HEARTBEAT = 4
    HEARTBEAT_ACK = 5
    BARRIER = 6
    BARRIER_DONE = 7
    FINISH = 8
    FINISH_ACK = 9
    SHUTDOWN = 10
    SHUTDOWN_ACK = 11
    NODE_DIED = 12
    WORKER_FINISHED = 13
    WORKER_REJOINED = 14  # scheduler -> servers, JSON {"old": uid, "node": record}: a restarted worker's new address
    INIT = 20
    INIT_ACK = 21
    PUSH = 22
    PUSH_ACK = 23
    PULL = 24
    PULL_REPLY = 25
    ROWS = 26
    ROWS_REPLY = 27
    SET_UPDATER = 28
    SET_UPDATER_ACK = 29
    PUSH_PULL = 30  # compact: req_id = the pull's, arg = the push's; ONE_PART record; the value
    VALUE = 31  # compact: req_id = the pull's, arg = the part's index in it; the value
    SET_CODEC = 32  # JSON {"codec": id, "params": {...}}: a codec's parameters (a threshold), before its pushes
    SET_CODEC_ACK = 33
    COLL = 40  # between workers: req_id = the collective's key id, arg = its version; psnode.collectives.wire
    RDV_SET = 41  # to the scheduler: {"key", "value"}, a rendezvous value (e.g. NCCL's unique id)
    RDV_GET = 42  # to the scheduler: {"key"}; answered by RDV_VALUE once the key is set
    RDV_VALUE = 43  # from the scheduler: {"value"} (or FLAG_ERROR and {"error"})
    PEERS = 44  # a worker to the scheduler: send me every worker's record (its book held only the servers)
    PEERS_REPLY = 45  # from the scheduler: {"nodes": [worker records]}
    PUSH_INVITE = 46  # server -> worker: req_id = an offered push's, arg = its part's index; send its value now
    LEDGER_APPEND = 47  # worker 0 to the scheduler: {"log"} and one entry frame (psnode.scheduler.ledger)
    LEDGER_ACK = 48  # from the scheduler: arg = the appended entry's index (or FLAG_ERROR and {"error"})
    LEDGER_READ = 49  # a worker to the scheduler: arg = the first index wanted, {"log", "wait"}
    LEDGER_ENTRIES = 50  # from the scheduler: arg = the first index, {"end"}, then one frame per entry
    MARK = 51  # worker -> server, no answer: JSON {"id", "scalars"} and its push counts (psnode.server.marks)
    MARKS = 52  # a replaced worker to a server: its predecessor's kept marks, please
    MARKS_REPLY = 53  # from the server: JSON [{"id", "scalars", "complete"}], each mark's counts frame, the taken counts
    # scheduler -> nodes, JSON {"rank", "lost": uid, "by": uid or null, "message"}: a server (or a replica,
    # "replica": true) of that rank is lost; "by", a replica, holds its keys from now on (a worker sends it
    # what it sent the lost server and got no answer to)
    SERVER_LOST = 54
    # scheduler -> node, JSON {"barriers": {group: completed}}: a scheduler started again in place took this
    # node's registration again; the node sends it again what it had asked and not been answered
    SCHEDULER_BACK = 55
    # a replica joining a running job (a lost server's or replica's process started again: psnode.server.snapshot):
    REPLICA_JOINED = 56  # scheduler -> workers, JSON {"rank", "node"}: copy what you send server "rank" to it too
    REPLICA_JOINING = 57  # scheduler -> the server of its rank, JSON {"node"}: send it your keys once every worker seamed
    SEAM = 58  # worker -> server, JSON {"replica": uid}: what follows, that replica gets a copy of
    SNAPSHOT = 59  # server -> the joining replica: a JSON index and the arrays of its keys (psnode.server.snapshot)
    STALLED = 60  # server -> the workers whose pushes a stalled round holds, JSON {"text"}: said in their logs too
    BARRIER_STALLED = 61  # scheduler -> the nodes waiting in a stalled barrier, JSON {"text"}: said in their logs too
    LEAVE = 62  # worker -> scheduler (an elastic job): I leave at this step boundary, my pushes all acknowledged
    LEAVE_ACK = 63  # from the scheduler: every node was told (or FLAG_ERROR and {"error"})
    WORKER_LEFT = 64  # scheduler -> servers and workers, JSON {"rank", "node", "workers"}: it left; the rounds
    #                   after its last push do not wait for it, and "workers" take part now
    JOIN_FREEZE = 65  # scheduler -> servers (a worker joins an elastic job): hold the workers' messages, answer
    JOIN_ROUND = 66  # server -> scheduler, JSON {"touched", "unsettled"}: the latest round a push reached here
    WORKER_JOINED = 67  # scheduler -> servers, then server -> workers, JSON {"rank", "node", "start", "workers",
    #                     "version", "provider"}: it counts from round "start"; servers end their freeze
    JOIN_THAW = 68  # scheduler -> servers: end the freeze without a join (no rank could be given yet)
    JOIN_SCALARS = 69  # provider worker -> scheduler -> the joiner, JSON {"rank", "start", "scalars"}: the
    #                    State scalars the members had when round "start" began
    LEAVING = 70  # worker -> servers before its last push, JSON {"last"}; a server relays it to every worker as
    #               {"rank", "last"}: round "last" is the leaver's last, so the others count without it after;
    #               server -> workers for a lost worker, {"rank", "last" (null: no dist_sync key here), "lost"
    #               (the scheduler's change number)}: the last round the scripts count it in
    CHECKPOINT = 34  # JSON {"op": "save" | "commit" | "scan" | "read" | "restore", ...}: psnode.server.checkpoints
    CHECKPOINT_REPLY = 35  # JSON: the operation's result


class Group(enum.IntEnum):
    """Barrier groups: every worker, every server, or every worker and server."""

    WORKERS = 1
    SERVERS = 2
    ALL = 3


GROUP_ROLES = {Group.WORKERS: ("worker",), Group.SERVERS: ("server",), Group.ALL: ("worker", "server")}


def parse_group(group: "Group | int | str") -> Group:
    """``Group.WORKERS`` / ``"workers"`` / ``1`` -> ``Group.WORKERS`` (also ``"servers"``, ``"all"``).

    Raises:
        ValueError: an unknown group; the message lists the known ones.
    """
    try:
        if isinstance(group, str):
            return Group[group.upper()]
        return Group(group)
    except (KeyError, ValueError):
        known = ", ".join(repr(g.name.lower()) for g in Group)
        raise ValueError(f"unknown barrier group {group!r}; the groups are {known}") from None


_CMDS = frozenset(int(c) for c in Cmd)
COMPACT_CMDS = frozenset({int(Cmd.PUSH_PULL), int(Cmd.VALUE)})  # header frames that carry their message

ENTRY = np.dtype(
    [("key", "<u8"), ("index", "<u4"), ("frame", "<u2"), ("codec", "<u2"), ("offset", "<u8"), ("nbytes", "<u8"),
     ("seq", "<u8")]
)
"""One key part of a data message.

key: the 64-bit key id; index: the part's position in the worker's request (replies echo it);
frame: which data frame (0 = the first after the meta frame) holds its bytes, or ``IN_SHARED_MEMORY`` /
``IN_SERVER_MEMORY`` (``psnode.transport.same_host``);
codec: how the bytes encode the value (``psnode.compression.codecs``; 0 = raw, the value's own bytes);
offset, nbytes: where the (encoded) bytes lie; seq: push -> this worker's push count of the key
including this one; pull -> pushes of the key this worker has issued, all of which the value
returned must include.
"""

MAX_DATA_FRAMES = IN_SERVER_MEMORY - 1  # frame numbers a message can use

PACK_LIMIT = 4 << 20
#: The most part records one message's meta frame holds (2.5 MiB of them): a push or pull of more
#: key parts travels in further messages, so a call of a million keys stays far below the frame limit.
MAX_ENTRIES = 65536
#: A value of at least this many bytes travels in a frame of its own (a push: in a message of its
#: own; a pull reply: straight from the stored array, not copied into a packed frame).
OWN_FRAME = 65536
"""The most bytes of small values one data frame carries (a push's, or a pull reply's): more travel in
further messages, so every frame stays far below a node's frame limit (``NodeEnv.max_message``)."""


def pack_header(cmd: int, req_id: int = 0, arg: int = 0, flags: int = 0) -> bytes:
    """Encode a header frame."""
    return HEADER.pack(MAGIC, VERSION, cmd, flags, 0, req_id, arg)


def with_flags(header: bytes, flags: int) -> bytes:
    """A header frame with the ``FLAG_*`` bits ``flags`` added."""
    return header[:4] + (int.from_bytes(header[4:6], "little") | flags).to_bytes(2, "little") + header[6:]


def unpack_header(frame: Any) -> tuple[int, int, int, int]:
    """Decode a header frame into ``(cmd, flags, req_id, arg)``.

    Raises:
        ProtocolError: wrong length, magic, version or an unknown command.
    """
    data = getattr(frame, "buffer", frame)  # a received frame's memoryview, or bytes
    if len(data) < HEADER.size:
        raise ProtocolError(f"header frame of {len(data)} bytes, expected {HEADER.size}")
    magic, version, cmd, flags, _, req_id, arg = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"header with magic {magic!r} version {version}, expected {MAGIC!r} version {VERSION}")
    if cmd not in _CMDS:
        raise ProtocolError(f"unknown command {cmd}")
    if len(data) != HEADER.size and cmd not in COMPACT_CMDS:
        raise ProtocolError(f"header frame of {len(data)} bytes, expected {HEADER.size}")
    return cmd, flags, req_id, arg


def pack_json(obj: Any) -> bytes:
    """Encode a control body."""
    return json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(frame: Any) -> Any:
    """Decode a control body.

    Raises:
        ProtocolError: not UTF-8 JSON.
    """
    data = frame.bytes if hasattr(frame, "bytes") else bytes(frame)
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"control body is not JSON: {exc}") from exc


ENTRY_STRUCT = struct.Struct("<QIHHQQQ")  # the same record as ENTRY, for packing a few at a time

ONE_PART = struct.Struct("<QIHHQQ")
"""``PUSH_PULL``'s record after the header: key id, index (the part's place in the pull), codec (of
the pushed value), spare, nbytes (the encoded value's length, which follows), seq (the push's count
of the key, this one included)."""

PUSH_PULL = struct.Struct(HEADER.format + ONE_PART.format[1:])  # header and record in one (un)pack


def pack_push_pull(pull_req: int, push_req: int, key: int, index: int, seq: int, value: bytes, codec: int = 0) -> bytes:
    """A ``PUSH_PULL`` frame: push ``value`` of part ``key`` and pull it back (see the module docstring)."""
    return PUSH_PULL.pack(MAGIC, VERSION, Cmd.PUSH_PULL, 0, 0, pull_req, push_req, key, index, codec, 0, len(value),
                          seq) + value


def unpack_push_pull(buf: Any) -> tuple[int, int, int, int, int, int, int]:
    """``(pull_req, push_req, key, index, codec, nbytes, seq)`` of a ``PUSH_PULL`` frame; the value
    follows at ``PUSH_PULL.size``.

    Raises:
        ProtocolError: the frame is shorter than its record or its length disagrees with ``nbytes``.
    """
    if len(buf) < PUSH_PULL.size:
        raise ProtocolError(f"PUSH_PULL of {len(buf)} bytes, shorter than its {PUSH_PULL.size}-byte record")
    fields = PUSH_PULL.unpack_from(buf)
    pull_req, push_req, key, index, codec, _, nbytes, seq = fields[5:]
    if len(buf) != PUSH_PULL.size + nbytes:
        raise ProtocolError(f"PUSH_PULL of {len(buf)} bytes for a value of {nbytes}")
    return pull_req, push_req, key, index, codec, nbytes, seq


def peek(header: bytes) -> tuple[int, int]:
    """``(cmd, flags)`` of a header this node packed itself (no checks: for its own outgoing frames)."""
    return header[3], int.from_bytes(header[4:6], "little")


def peek_arg(header: bytes) -> int:
    """The ``arg`` of a header this node packed itself (a request's parts in the message)."""
    return int.from_bytes(header[16:24], "little", signed=True)


def peek_req_id(header: bytes) -> int:
    """The request id of a header this node packed itself."""
    return int.from_bytes(header[8:16], "little")


def pack_value(req_id: int, index: int, value: bytes) -> bytes:
    """A ``VALUE`` frame: the reply to pull ``req_id`` for its part ``index``."""
    return HEADER.pack(MAGIC, VERSION, Cmd.VALUE, 0, 0, req_id, index) + value


def pack_codec_params(codec: int, params: dict[str, Any]) -> bytes:
    """A ``SET_CODEC`` body: codec ``codec`` takes ``params`` (names to JSON numbers, strings, booleans).

    A float travels as JSON writes it (the shortest text that reads back as the same double), so a
    float32 threshold arrives with every bit: MXNet sends it as a 6-decimal string instead.
    """
    return pack_json({"codec": int(codec), "params": params})


_PARAM_TYPES = (int, float, str, bool)


def unpack_codec_params(frame: Any) -> tuple[int, dict[str, Any]]:
    """``(codec id, params)`` of a ``SET_CODEC`` body, checked for shape and JSON types only (the
    codec checks the values).

    Raises:
        ProtocolError: not JSON, or not ``{"codec": 0..65535, "params": {name: number|string|bool}}``
            (the message says what was found).
    """
    body = unpack_json(frame)
    if not isinstance(body, dict) or set(body) != {"codec", "params"}:
        raise ProtocolError(f"SET_CODEC body must be {{'codec': id, 'params': {{...}}}}, got {str(body)[:200]}")
    codec, params = body["codec"], body["params"]
    if isinstance(codec, bool) or not isinstance(codec, int) or not 0 <= codec < 1 << 16:
        raise ProtocolError(f"SET_CODEC names codec {codec!r}, not an id 0..65535")
    if not isinstance(params, dict) or len(params) > 16:
        raise ProtocolError(f"SET_CODEC parameters must be an object of at most 16 names, got {str(params)[:200]}")
    for name, value in params.items():
        if len(name) > 64 or not isinstance(value, _PARAM_TYPES) or (isinstance(value, str) and len(value) > 256):
            raise ProtocolError(f"SET_CODEC parameter {name[:64]!r} = {str(value)[:80]!r} is not a short number, string or boolean")
    return codec, params


#: Bytes of JSON a ``MARK``'s scalars may take.
MAX_MARK_SCALARS = 64 << 10
#: A ``MARK``'s push counts, one record per key part: its key id and the pushes of it the worker
#: had issued (``psnode.server.marks``).
MARK_COUNT = np.dtype([("key", "<u8"), ("seq", "<u8")])


def pack_counts(counts: dict[int, int]) -> bytes:
    """``{key id: pushes}`` as a ``MARK``'s counts frame (``MARK_COUNT`` records)."""
    out = np.empty(len(counts), MARK_COUNT)
    if counts:
        out["key"] = np.fromiter(counts.keys(), np.uint64, len(counts))
        out["seq"] = np.fromiter(counts.values(), np.uint64, len(counts))
    return out.tobytes()


def pack_entries(rows: list[tuple[int, int, int, int, int, int, int]]) -> bytes:
    """Encode ``(key, index, frame, codec, offset, nbytes, seq)`` records into a meta frame.

    ``starmap`` packs each record without a Python step: 1000 records in 80 µs, where building a
    numpy table of them took 380 µs (a 2-core AMD EPYC)."""
    return b"".join(itertools.starmap(ENTRY_STRUCT.pack, rows))


def unpack_entries(frame: Any, frame_sizes: list[int] | None = None) -> list[tuple[int, int, int, int, int, int, int]]:
    """Decode a meta frame into ``(key, index, frame, codec, offset, nbytes, seq)`` records.

    With ``frame_sizes`` (the data frames' lengths) every part is checked to lie inside its frame.

    Raises:
        ProtocolError: a truncated meta frame, or a part outside the data frames.
    """
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    if len(buf) % ENTRY_STRUCT.size:
        raise ProtocolError(f"meta frame of {len(buf)} bytes is not a multiple of {ENTRY_STRUCT.size}")
    rows = list(ENTRY_STRUCT.iter_unpack(buf))
    if frame_sizes is not None:
        count = len(frame_sizes)
        for row in rows:
            if row[2] >= IN_SERVER_MEMORY:  # in shared memory (psnode.transport.same_host), not in a frame
                continue
            if row[2] >= count or row[4] + row[5] > frame_sizes[row[2]]:
                raise ProtocolError(f"a part of key {row[0]:#x} lies outside the message's data frames")
    return rows
