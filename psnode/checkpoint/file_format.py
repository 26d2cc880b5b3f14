"""A server's checkpoint file: its format, its writing and syncing, and its reading, every field checked.

A server file is ``MAGIC``, the length of its index (u64, little endian), the index (JSON), zero
padding to ``ALIGN`` bytes, then the arrays' raw bytes, each at an ``ALIGN``-aligned offset from
there. The index lists each shard (``key_id``, ``user_key``, ``shape``, ``dtype``, ``row_size``,
``offset``), each key's optimizer state arrays and scalars, and the updater's own scalars. Nothing
in a checkpoint is pickled: a shared directory may hold files others wrote, and every field read
back is checked (``read_index``) before it is used.

A server writes its file under a temporary name (``write_server_file``), answers, and then, on a
thread of its own, syncs it to disk and renames it into place (``settle_server_file``): a file under
its final name is whole and on disk. One that cannot be synced leaves ``server-R-of-S.failed`` with
the reason (``failure_of``), which server 0, waiting for the files of a commit, reads
(``psnode.checkpoint.layout.finish_checkpoint``).
"""

from __future__ import annotations

import json
import os
import struct
import threading
from typing import Any, Callable

import numpy as np

from psnode.errors import RequestRefused
from psnode.node.values import VALUE_DTYPES, dtype_of, is_int, is_shape

__all__ = ["MAGIC", "ALIGN", "FORMAT", "MAX_JSON", "STATE_DTYPES", "ServerFile", "write_server_file",
           "settle_server_file", "failure_of", "read_index", "read_into", "check_user_key", "checked_dtype",
           "AtomicFile", "fsync_dir"]

MAGIC = b"PSCKPT\x00\x01"
ALIGN = 64
FORMAT = 1  # of a server file's index and of a manifest
MAX_JSON = 512 << 20  # bytes of index or manifest read back at most
_CHUNK = 64 << 20  # bytes per read or write call
_HEADER = struct.Struct("<8sQ")
_FAILED_TEXT = 2000  # characters of a failure marker read back at most

STATE_DTYPES = VALUE_DTYPES
"""The dtypes a value or an optimizer state array may have in a checkpoint: a key's."""


class ServerFile:
    """What a server writes: an index (JSON-able) and the host arrays it refers to, in order.

    ``add(array)`` returns the offset the array gets in the data area; the index records it.
    """

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.size = 0

    def add(self, array: np.ndarray) -> int:
        """Queue ``array`` (C-contiguous host memory, kept alive until written); its data offset."""
        offset = self.size
        self.arrays.append(array)
        self.size = _aligned(offset + array.nbytes)
        return offset


def write_server_file(directory: str, name: str, index: dict, body: ServerFile,
                      beat: Callable[[], None] = lambda: None) -> tuple[int, str]:
    """Write ``index`` and ``body``'s arrays to a temporary file in ``directory`` that becomes
    ``name`` once ``settle_server_file`` synced it; return ``(the file's size, its temporary path)``.

    The writing runs on a thread of its own while the calling thread calls ``beat`` every half
    second: a loaded disk may take many seconds for a gigabyte (the kernel holds back a writer of
    many dirty pages), and the server's heartbeats must go on. The caller changes none of the
    arrays meanwhile; once this returns, the bytes are the file's and the arrays may change.

    Raises:
        RequestRefused: the file cannot be written (the message names it and the OS error).
    """
    path = os.path.join(directory, name)
    text = json.dumps(index, separators=(",", ":")).encode()
    head = _HEADER.pack(MAGIC, len(text)) + text
    head += b"\0" * (_aligned(len(head)) - len(head))

    def write() -> tuple[int, str]:
        os.makedirs(directory, exist_ok=True)
        tmp = _temporary_name(path)
        try:
            with open(tmp, "wb", buffering=0) as fh:
                fh.write(head)
                written = 0
                for array in body.arrays:
                    data = memoryview(array.reshape(-1)).cast("B") if array.size else memoryview(b"")
                    for start in range(0, len(data), _CHUNK):
                        fh.write(data[start:start + _CHUNK])
                    written += len(data)
                    pad = _aligned(written) - written
                    if pad:
                        fh.write(b"\0" * pad)
                        written += pad
        except BaseException:
            _remove_quietly(tmp)
            raise
        return len(head) + written, tmp

    try:
        return _beating(write, beat)
    except OSError as exc:
        raise RequestRefused(f"cannot write the checkpoint file {path}: {exc.strerror or exc}") from exc


def settle_server_file(tmp: str, path: str) -> None:
    """Sync the temporary file ``tmp`` to disk and rename it to ``path``: from then on the file is
    whole under its final name. On failure ``tmp`` is removed and a failure marker left next to
    ``path`` (``finish_checkpoint`` reads it); the error is raised too.

    Raises:
        RequestRefused: naming the file and the OS error.
    """
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        _remove_quietly(tmp)
        why = f"cannot sync the checkpoint file {path} to disk: {exc.strerror or exc}"
        try:  # renamed in whole: server 0, polling, must never read a marker half written
            with AtomicFile(failure_marker(path), durable=False) as fh:
                fh.write(why.encode())
        except OSError:
            pass  # server 0 then waits until it gives up; this server's log says why
        raise RequestRefused(why) from exc


def failure_marker(path: str) -> str:
    """Where a server that cannot sync ``path`` writes why."""
    return os.path.splitext(path)[0] + ".failed"


def failure_of(path: str) -> str | None:
    """The reason a server left next to ``path`` when it could not sync it, or None."""
    try:
        with open(failure_marker(path), "rb") as fh:
            return fh.read(_FAILED_TEXT).decode("utf-8", "replace")
    except OSError:
        return None


def _beating(work: Callable[[], Any], beat: Callable[[], None]) -> Any:
    """``work()`` on a thread of its own, calling ``beat`` here every half second until it is done;
    its result, or its exception raised here."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="psnode-checkpoint-write", daemon=True)
    thread.start()
    while True:
        thread.join(0.5)
        if not thread.is_alive():
            break
        beat()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def read_index(path: str) -> tuple[dict, int, int]:
    """``(index, data offset, file size)`` of a server file, the index checked for shape.

    Raises:
        RequestRefused: the file is missing, not a checkpoint file, or its index is malformed.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            magic, length = _HEADER.unpack(fh.read(_HEADER.size).ljust(_HEADER.size, b"\0"))
            if magic != MAGIC:
                raise RequestRefused(f"{path} is not a checkpoint file of this format")
            if length > min(MAX_JSON, size - _HEADER.size):
                raise RequestRefused(f"{path}: an index of {length} bytes in a file of {size}")
            index = json.loads(fh.read(length))
    except OSError as exc:
        raise RequestRefused(f"cannot read the checkpoint file {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise RequestRefused(f"{path}: its index is not JSON: {exc}") from exc
    data = _aligned(_HEADER.size + length)
    _check_index(index, path, size - data)
    return index, data, size


def read_into(path: str, data_offset: int, entry: dict, start: int, out: np.ndarray) -> None:
    """Read elements ``start : start + out.size`` of the array ``entry`` (an index entry with
    ``offset``, ``dtype``) of file ``path`` into the C-contiguous ``out``.

    Raises:
        RequestRefused: the file cannot be read or ends early.
    """
    itemsize = out.dtype.itemsize
    view = memoryview(out.reshape(-1)).cast("B") if out.size else memoryview(bytearray(0))
    try:
        with open(path, "rb", buffering=0) as fh:
            fh.seek(data_offset + entry["offset"] + start * itemsize)
            done = 0
            while done < len(view):
                got = fh.readinto(view[done:done + _CHUNK])
                if not got:
                    raise RequestRefused(f"{path} ends early: {len(view) - done} bytes of key "
                                         f"{entry.get('user_key')!r} are missing")
                done += got
    except OSError as exc:
        raise RequestRefused(f"cannot read the checkpoint file {path}: {exc.strerror or exc}") from exc


def _check_index(index: Any, path: str, data_size: int) -> None:
    """Every field of a server file's index, checked: ranges inside the data area, known dtypes."""
    def bad(what: str) -> RequestRefused:
        return RequestRefused(f"{path}: a malformed index: {what}")

    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise bad(f"format {index.get('format') if isinstance(index, dict) else index!r}, expected {FORMAT}")
    shards, states = index.get("shards"), index.get("states")
    if not isinstance(shards, list) or not isinstance(states, list):
        raise bad("no list of shards or states")
    for entry in shards:
        if not isinstance(entry, dict) or not is_int(entry.get("key_id")) or not 0 <= entry["key_id"] < 1 << 64:
            raise bad(f"shard {str(entry)[:200]}")
        check_user_key(entry.get("user_key"), bad)
        _check_array_entry(entry, data_size, bad)
        if not is_int(entry.get("row_size")) or entry["row_size"] < 1:
            raise bad(f"row size {entry.get('row_size')!r} of key {entry['user_key']!r}")
    for state in states:
        if not isinstance(state, dict) or not isinstance(state.get("arrays"), list):
            raise bad(f"state {str(state)[:200]}")
        check_user_key(state.get("user_key"), bad)
        for entry in state["arrays"]:
            if not isinstance(entry, dict):
                raise bad(f"state array {str(entry)[:200]}")
            _check_array_entry(entry, data_size, bad)


def _check_array_entry(entry: dict, data_size: int, bad: Callable[[str], Exception]) -> None:
    shape, offset = entry.get("shape"), entry.get("offset")
    dtype = checked_dtype(shape, entry.get("dtype"), "", bad)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if not is_int(offset) or offset < 0 or offset % ALIGN or offset + count * dtype.itemsize > data_size:
        raise bad(f"{count} values of {dtype} at offset {offset!r} of a data area of {data_size} bytes")
    entry["_dtype"], entry["_size"] = dtype, count


def checked_dtype(shape: Any, dtype: Any, what: str, bad: Callable[[str], Exception]) -> np.dtype:
    """The dtype of an array described by ``shape`` and ``dtype`` read back, both checked."""
    if not is_shape(shape):
        raise bad(f"shape {str(shape)[:100]!r}{what}")
    found = dtype_of(dtype)
    if found not in STATE_DTYPES:
        raise bad(f"dtype {found if found is not None else repr(dtype)[:40]}{what}")
    return found


def check_user_key(key: Any, bad: Callable[[str], Exception]) -> None:
    """A user key read back: an int of 64 bits or a str of at most 4096 characters."""
    if isinstance(key, str):
        if len(key) > 4096:
            raise bad(f"a key of {len(key)} characters")
    elif not is_int(key) or not -(1 << 63) <= key < 1 << 64:
        raise bad(f"key {str(key)[:100]!r} is neither a 64-bit int nor a str")


class AtomicFile:
    """A file written under a temporary name and renamed to ``path`` on success (removed on
    failure), so that nobody ever reads it half written. ``durable``: the file is synced to disk
    before the rename, and its directory after it."""

    def __init__(self, path: str, durable: bool = True) -> None:
        self.path = path
        self.durable = durable
        self.tmp = _temporary_name(path)
        self.fh: Any = None

    def __enter__(self) -> Any:
        self.fh = open(self.tmp, "wb", buffering=0)
        return self.fh

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        try:
            if kind is None and self.durable:
                os.fsync(self.fh.fileno())
            self.fh.close()
            if kind is None:
                os.replace(self.tmp, self.path)
                if self.durable:
                    fsync_dir(os.path.dirname(self.path))
        finally:
            _remove_quietly(self.tmp)


def fsync_dir(directory: str) -> None:
    """Sync ``directory``'s entries (the renames in it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary_name(path: str) -> str:
    """A temporary name next to ``path``, unique to this writer (a dot file: ``scan`` ignores it)."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}-{os.urandom(4).hex()}")


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
