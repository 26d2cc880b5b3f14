"""Checkpoints on disk: the servers' files, the manifest, and which checkpoint is the newest complete one.

A job's checkpoint directory (``PSLAUNCH_CHECKPOINT_DIR``) holds one directory per checkpoint::

    ckpt-00000007/server-0-of-2.bin      server 0's shards: values, optimizer state, key/shape/dtype
    ckpt-00000007/server-1-of-2.bin
    ckpt-00000007/MANIFEST.json          written last, by server 0: the checkpoint is complete

A server writes its file under a temporary name, answers, and then, on a thread of its own, syncs
it to disk (``fsync``) and renames it into place (``psnode.checkpoint.file_format``): a file under its final
name is whole and on disk. Server 0, asked to commit, waits on its own thread for every server's file
under its final name (``finish_checkpoint``), syncs the directory (every rename in it becomes
durable), and writes the manifest the same way (temporary file, fsync, rename, fsync of the
directory). A checkpoint is *complete* once its manifest is renamed in; one without (a server died
during the commit, a sync failed) is ignored by ``scan`` and removed by a later ``collect``. A server
whose file cannot be synced leaves ``server-R-of-S.failed`` with the reason, so that server 0 stops
waiting and says why.

What a server file holds, and how it is written and read back: ``psnode.checkpoint.file_format``.
Nothing in a checkpoint is pickled, and every field of a manifest read back is checked
(``check_manifest``) before it is used.

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
import time
from typing import Any, Callable

import numpy as np

from psnode.checkpoint.file_format import (
    FORMAT,
    MAX_JSON,
    AtomicFile,
    check_user_key,
    checked_dtype,
    failure_of,
    fsync_dir,
)
from psnode.errors import RequestRefused
from psnode.node.values import is_int

__all__ = ["MANIFEST", "KEEP", "FILE_NAME", "dir_of", "file_name", "scan", "collect", "finish_checkpoint",
           "write_manifest", "read_manifest", "check_manifest", "json_safe"]

MANIFEST = "MANIFEST.json"
KEEP = 2  # complete checkpoints kept: the newest, and the one before it
FILE_NAME = re.compile(r"server-(\d{1,6})-of-(\d{1,6})\.bin")
_DIR_NAME = re.compile(r"ckpt-(\d{8})")
_MAX_ID = 10**8 - 1


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


# ---- completing a commit --------------------------------------------------------------------------
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
            failed = failure_of(path)
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
        fsync_dir(directory)  # the renames of every server's file, durable before the manifest names them
    except OSError as exc:
        raise RequestRefused(f"cannot sync the checkpoint directory {directory}: {exc.strerror or exc}") from exc
    write_manifest(directory, manifest)


# ---- the manifest -----------------------------------------------------------------------------------
def write_manifest(directory: str, manifest: dict) -> None:
    """Write ``directory/MANIFEST.json`` (temporary file, fsync, rename, fsync of the directory): from
    here on the checkpoint is complete.

    Raises:
        RequestRefused: it cannot be written (naming the path and the OS error).
    """
    path = os.path.join(directory, MANIFEST)
    try:
        with AtomicFile(path) as fh:
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
        if os.path.getsize(path) > MAX_JSON:
            raise RequestRefused(f"{path} is larger than {MAX_JSON} bytes")
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
        checked_dtype(shape, entry.get("dtype"), f" of key {entry['key']!r}", bad)
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


# ---- helpers --------------------------------------------------------------------------------------------
def json_safe(value: Any, what: str) -> Any:
    """``value`` if JSON can carry it unchanged (round trip), else ``RequestRefused`` naming ``what``."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise RequestRefused(f"{what} cannot be written as JSON: {exc}") from exc
    return json.loads(text)
