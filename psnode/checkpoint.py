"""Checkpoints on disk: the servers' files, the manifest, and which checkpoint is the newest complete one.

A job's checkpoint directory (``PSLAUNCH_CHECKPOINT_DIR``) holds one directory per checkpoint::

    ckpt-00000007/server-0-of-2.bin      server 0's shards: values, optimizer state, key/shape/dtype
    ckpt-00000007/server-1-of-2.bin
    ckpt-00000007/MANIFEST.json          written last, by server 0: the checkpoint is complete

A server writes its file under a temporary name, answers, and then, on a thread of its own, syncs
it to disk (``fsync``) and renames it into place (``settle_server_file``): a file under its final name
is whole and on disk. Server 0, asked to commit, waits on its own thread for every server's file
under its final name (``finish_checkpoint``), syncs the directory (every rename in it becomes
durable), and writes the manifest the same way (temporary file, fsync, rename, fsync of the
directory). A checkpoint is *complete* once its manifest is renamed in; one without (a server died
during the commit, a sync failed) is ignored by ``scan`` and removed by a later ``collect``. A server
whose file cannot be synced leaves ``server-R-of-S.failed`` with the reason, so that server 0 stops
waiting and says why.

A server file is ``MAGIC``, the length of its index (u64, little endian), the index (JSON), zero
padding to ``ALIGN`` bytes, then the arrays' raw bytes, each at an ``ALIGN``-aligned offset from
there. The index lists each shard (``key_id``, ``user_key``, ``shape``, ``dtype``, ``row_size``,
``offset``), each key's optimizer state arrays and scalars, and the updater's own scalars. Nothing
in a checkpoint is pickled: a shared directory may hold files others wrote, and every field read
back is checked (``read_index``, ``check_manifest``) before it is used.

Paths: the ids and file names a worker's request names are turned into paths here, and only ids
(integers) and names matching ``FILE_NAME`` are accepted, so every path stays inside the
checkpoint directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import struct
import threading
import time
from typing import Any, Callable

import numpy as np

from .errors import RequestRefused
from .server_store import VALUE_DTYPES, dtype_of, is_int, is_shape

__all__ = [
    "MAGIC", "ALIGN", "MANIFEST", "FORMAT", "KEEP", "FILE_NAME", "dir_of", "file_name", "scan", "ServerFile",
    "write_server_file", "settle_server_file", "finish_checkpoint", "read_index", "read_into", "write_manifest", "read_manifest", "check_manifest",
    "collect", "check_user_key", "json_safe", "STATE_DTYPES",
]

MAGIC = b"PSCKPT\x00\x01"
ALIGN = 64
MANIFEST = "MANIFEST.json"
FORMAT = 1
KEEP = 2  # complete checkpoints kept: the newest, and the one before it
FILE_NAME = re.compile(r"server-(\d{1,6})-of-(\d{1,6})\.bin")
_DIR_NAME = re.compile(r"ckpt-(\d{8})")
_MAX_ID = 10**8 - 1
_MAX_JSON = 512 << 20  # bytes of index or manifest read back at most
_CHUNK = 64 << 20  # bytes per read or write call
_HEADER = struct.Struct("<8sQ")
_FAILED_TEXT = 2000  # characters of a failure marker read back at most

STATE_DTYPES = VALUE_DTYPES
"""The dtypes a value or an optimizer state array may have in a checkpoint: a key's."""


def dir_of(root: str, ckpt_id: Any) -> str:
    """The directory of checkpoint ``ckpt_id`` under ``root``.

    Raises:
        RequestRefused: ``ckpt_id`` is not an integer 0..99999999.
    """
    if not is_int(ckpt_id) or not 0 <= ckpt_id <= _MAX_ID:
        raise RequestRefused(f"checkpoint id {ckpt_id!r} is not an integer 0..{_MAX_ID}")
    return os.path.join(root, f"ckpt-{ckpt_id:08d}")


def file_name(rank: int, num_servers: int) -> str:
    """The name of server ``rank``'s file in a checkpoint of ``num_servers`` servers."""
    return f"server-{rank}-of-{num_servers}.bin"


def scan(root: str) -> tuple[int | None, int | None]:
    """``(newest complete id, highest id of any checkpoint directory)`` under ``root``; None for none.

    A directory is complete when its manifest exists; a missing ``root`` holds none.
    """
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        raise RequestRefused(f"cannot list the checkpoint directory {root}: {exc.strerror or exc}") from exc
    ids = sorted(int(m.group(1)) for m in map(_DIR_NAME.fullmatch, names) if m)
    complete = [i for i in ids if os.path.isfile(os.path.join(dir_of(root, i), MANIFEST))]
    return (complete[-1] if complete else None), (ids[-1] if ids else None)


def collect(root: str, newest: int, keep: int = KEEP) -> list[int]:
    """Remove the checkpoints older than the ``keep`` newest complete ones up to ``newest`` (torn ones
    among them too); return the ids removed. Errors are ignored: a later commit tries again."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    ids = sorted(int(m.group(1)) for m in map(_DIR_NAME.fullmatch, names) if m)
    complete = [i for i in ids if i <= newest and os.path.isfile(os.path.join(dir_of(root, i), MANIFEST))]
    kept = set(complete[-keep:])
    removed = []
    for i in ids:
        if i < newest and i not in kept:
            shutil.rmtree(dir_of(root, i), ignore_errors=True)
            removed.append(i)
    return removed


# ---- a server's file ----------------------------------------------------------------------------------
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
        tmp = _temporary(path)
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
            _unlink(tmp)
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
        _unlink(tmp)
        why = f"cannot sync the checkpoint file {path} to disk: {exc.strerror or exc}"
        try:
            with open(_failure_marker(path), "w") as fh:
                fh.write(why)
        except OSError:
            pass  # server 0 then waits until it gives up; this server's log says why
        raise RequestRefused(why) from exc


def finish_checkpoint(directory: str, manifest: dict, stopping: Callable[[], bool], patience: float) -> None:
    """Complete the checkpoint in ``directory``: wait until every file ``manifest`` lists is there
    under its final name with its size (synced by its server), sync the directory, and write the
    manifest. Gives up after ``patience`` seconds or once ``stopping()``.

    Raises:
        RequestRefused: a server could not write or sync its file (its reason), a file has another
            size than its server wrote, or the wait ran out (naming the files missing).
    """
    ckpt_id = manifest["id"]
    deadline = time.monotonic() + patience
    missing = list(manifest["files"])
    pause = 0.001
    while missing:
        waiting = []
        for item in missing:
            path = os.path.join(directory, item["name"])
            failed = _read_failure(path)
            if failed is not None:
                raise RequestRefused(f"checkpoint {ckpt_id} is not complete: server {item['server']}: {failed}")
            try:
                found = os.stat(path)
            except FileNotFoundError:
                waiting.append(item)
                continue
            except OSError as exc:
                raise RequestRefused(f"checkpoint {ckpt_id} is not complete: {path}: {exc.strerror or exc}") from exc
            if not stat.S_ISREG(found.st_mode):  # not a file its server renamed in (yet)
                waiting.append(item)
                continue
            size = found.st_size
            if size != item["bytes"]:
                raise RequestRefused(f"checkpoint {ckpt_id} is not complete: {path} holds {size} bytes, "
                                     f"server {item['server']} wrote {item['bytes']}")
        missing = waiting
        if missing:
            if stopping() or time.monotonic() > deadline:
                names = ", ".join(item["name"] for item in missing)
                raise RequestRefused(f"checkpoint {ckpt_id} is not complete: {names} not synced to disk by "
                                     f"{'the end of the server' if stopping() else f'{patience:g} s after the commit'}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
    try:
        _fsync_dir(directory)  # the renames of every server's file, durable before the manifest names them
    except OSError as exc:
        raise RequestRefused(f"cannot sync the checkpoint directory {directory}: {exc.strerror or exc}") from exc
    write_manifest(directory, manifest)


def _failure_marker(path: str) -> str:
    return os.path.splitext(path)[0] + ".failed"


def _read_failure(path: str) -> str | None:
    """The reason a server left next to ``path`` when it could not sync it, or None."""
    try:
        with open(_failure_marker(path), "rb") as fh:
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
            if length > min(_MAX_JSON, size - _HEADER.size):
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
    dtype = _checked(shape, entry.get("dtype"), "", bad)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if not is_int(offset) or offset < 0 or offset % ALIGN or offset + count * dtype.itemsize > data_size:
        raise bad(f"{count} values of {dtype} at offset {offset!r} of a data area of {data_size} bytes")
    entry["_dtype"], entry["_size"] = dtype, count


# ---- the manifest -----------------------------------------------------------------------------------
def write_manifest(directory: str, manifest: dict) -> None:
    """Write ``directory/MANIFEST.json`` (temporary file, fsync, rename, fsync of the directory): from
    here on the checkpoint is complete.

    Raises:
        RequestRefused: it cannot be written (naming the path and the OS error).
    """
    path = os.path.join(directory, MANIFEST)
    try:
        with _Atomic(path) as fh:
            fh.write(json.dumps(manifest, separators=(",", ":")).encode())
    except OSError as exc:
        raise RequestRefused(f"cannot write the checkpoint manifest {path}: {exc.strerror or exc}") from exc


def read_manifest(root: str, ckpt_id: int) -> dict:
    """The manifest of checkpoint ``ckpt_id``, checked (``check_manifest``).

    Raises:
        RequestRefused: it is missing, unreadable or malformed (the message names the file).
    """
    path = os.path.join(dir_of(root, ckpt_id), MANIFEST)
    try:
        if os.path.getsize(path) > _MAX_JSON:
            raise RequestRefused(f"{path} is larger than {_MAX_JSON} bytes")
        with open(path, "rb") as fh:
            manifest = json.loads(fh.read())
    except OSError as exc:
        raise RequestRefused(f"cannot read the checkpoint manifest {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise RequestRefused(f"{path} is not JSON: {exc}") from exc
    check_manifest(manifest, path)
    if manifest["id"] != ckpt_id:
        raise RequestRefused(f"{path} names checkpoint {manifest['id']}, not {ckpt_id}")
    return manifest


def check_manifest(manifest: Any, where: str) -> None:
    """Check a manifest (from a worker, or read back from disk) field by field.

    The form: ``{"format": 1, "id": int, "num_servers": n, "files": [{"server", "name", "bytes"}],
    "keys": [{"key", "shape", "dtype", "parts": [[server, part id, start, stop], ...]}],
    "scalars": {...}, ...}``; every part lies inside its key, and the parts of a key cover it.

    Raises:
        RequestRefused: naming ``where`` and the first field that is wrong.
    """
    def bad(what: str) -> RequestRefused:
        return RequestRefused(f"{where}: a malformed checkpoint manifest: {what}")

    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise bad("not an object of format 1")
    num = manifest.get("num_servers")
    if not is_int(manifest.get("id")) or not is_int(num) or not 1 <= num <= 100000:
        raise bad(f"id {manifest.get('id')!r} or num_servers {num!r}")
    files = manifest.get("files")
    if not isinstance(files, list) or len(files) != num:
        raise bad(f"{len(files) if isinstance(files, list) else 'no'} files for {num} servers")
    for rank, item in enumerate(files):
        if (not isinstance(item, dict) or item.get("server") != rank or item.get("name") != file_name(rank, num)
                or not is_int(item.get("bytes")) or item["bytes"] < 0):
            raise bad(f"file entry {str(item)[:200]}")
    keys = manifest.get("keys")
    if not isinstance(keys, list) or not isinstance(manifest.get("scalars"), dict):
        raise bad("no list of keys or object of scalars")
    for entry in keys:
        if not isinstance(entry, dict):
            raise bad(f"key entry {str(entry)[:200]}")
        check_user_key(entry.get("key"), bad)
        shape, parts = entry.get("shape"), entry.get("parts")
        _checked(shape, entry.get("dtype"), f" of key {entry['key']!r}", bad)
        size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not isinstance(parts, list) or not parts:
            raise bad(f"no parts of key {entry['key']!r}")
        covered = 0
        for part in sorted(parts, key=lambda p: p[2] if isinstance(p, list) and len(p) == 4 and is_int(p[2]) else -1):
            if (not isinstance(part, list) or len(part) != 4 or not all(is_int(v) for v in part)
                    or not 0 <= part[0] < num or not 0 <= part[1] < 1 << 64 or part[2] != covered or part[3] < part[2]):
                raise bad(f"part {str(part)[:100]} of key {entry['key']!r} (of {size} elements)")
            covered = part[3]
        if covered != size:
            raise bad(f"the parts of key {entry['key']!r} cover {covered} of its {size} elements")


def _checked(shape: Any, dtype: Any, what: str, bad: Callable[[str], Exception]) -> np.dtype:
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


# ---- helpers --------------------------------------------------------------------------------------------
class _Atomic:
    """A file written under a temporary name, fsynced and renamed to ``path`` on success (removed on failure)."""

    def __init__(self, path: str, sync_dir: bool = True) -> None:
        self.path = path
        self.sync_dir = sync_dir
        self.tmp = _temporary(path)
        self.fh: Any = None

    def __enter__(self) -> Any:
        self.fh = open(self.tmp, "wb", buffering=0)
        return self.fh

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        try:
            if kind is None:
                os.fsync(self.fh.fileno())
            self.fh.close()
            if kind is None:
                os.replace(self.tmp, self.path)
                if self.sync_dir:
                    _fsync_dir(os.path.dirname(self.path))
        finally:
            _unlink(self.tmp)


def _temporary(path: str) -> str:
    """A temporary name next to ``path``, unique to this writer (a dot file: ``scan`` ignores it)."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}-{os.urandom(4).hex()}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def json_safe(value: Any, what: str) -> Any:
    """``value`` if JSON can carry it unchanged (round trip), else ``RequestRefused`` naming ``what``."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise RequestRefused(f"{what} cannot be written as JSON: {exc}") from exc
    return json.loads(text)
