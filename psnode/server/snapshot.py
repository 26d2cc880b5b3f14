"""A server's keys as one message, for a replica that joins a running job (``--server-replicas``).

A server or replica that was lost is started again by pslaunch as a replica; so that its rank
tolerates a loss again, it needs what the server of its rank holds. Every worker marks the point in
its stream to that server from which the newcomer gets its copies (``SEAM``); once every worker
that has not finished did, the server holds exactly what came before those points, and sends it
(``SNAPSHOT``): each key part's value, its round (the rounds closed, each worker's pushes taken,
the open round's partial sum and any held pushes, the values kept for late pulls), the optimizer
(worker 0's updater as it came, and its state), every worker's kept marks, the workers that
finished, and the codecs' parameters. The replica takes it, then the copies that came after the
points, in order.

The frames are ``[JSON index, array, array, ...]``; nothing is pickled but worker 0's updater, which
the server kept as it came. ``read_snapshot`` checks every field before anything changes.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Callable

import numpy as np

from psnode.errors import ProtocolError
from psnode.node.protocol import MARK_COUNT
from psnode.node.values import MAX_DIMS, VALUE_DTYPES, dtype_of, is_int, is_shape
from psnode.server.marks import Mark, read_mark
from psnode.server.rounds import Round
from psnode.server.store import ServerStore, Shard
from psnode.transport.base import Frame

__all__ = ["snapshot_frames", "read_snapshot", "Snapshot"]

FORMAT = 1
_MAX_INDEX = 256 << 20  # bytes of JSON index read at most


def snapshot_frames(store: ServerStore, updater_blob: bytes | None, state: dict | None,
                    codecs: dict[int, dict]) -> list:
    """The ``SNAPSHOT`` frames of ``store`` (after the header): the JSON index, then the arrays.
    ``state``: the updater's state in ``state_dict`` form (``Checkpoints.updater_state``)."""
    memory = store.memory
    arrays: list = []

    def add(array: Any) -> int:
        arrays.append(np.ascontiguousarray(memory.host(array)).reshape(-1).copy())
        return len(arrays) - 1

    shards = []
    for shard in store.shards.values():
        round_ = shard.round
        shards.append({
            "key": shard.key_id, "user_key": shard.user_key, "shape": list(shard.shape), "dtype": shard.dtype.str,
            "row_size": shard.row_size, "sync": shard.sync, "value": add(shard.stored), "closed": round_.closed,
            "received": list(round_.received), "count": round_.count, "pushed": sorted(round_.pushed),
            "partial": add(round_.result) if round_.count else None,
            "backlog": [[worker, add(data)] for worker, data in round_.backlog],
            "history": [[version, add(value)] for version, value in sorted(shard.history.items())],
            "error": shard.error})
    marks = []
    for worker in sorted(store.marks.workers()):
        for mark in store.marks.of(worker):
            counts = np.empty(len(mark.keys), MARK_COUNT)
            counts["key"], counts["seq"] = mark.keys, mark.seqs
            arrays.append(counts.view(np.uint8))
            marks.append({"worker": worker, "id": mark.id, "scalars": json.loads(mark.scalars),
                          "barriers": mark.barriers, "setup": mark.setup, "counts": len(arrays) - 1})
    updater = None
    if updater_blob is not None:
        arrays.append(np.frombuffer(updater_blob, np.uint8))
        updater = len(arrays) - 1
    keys = None
    if state is not None:
        keys = [[key, {"scalars": item["scalars"], "arrays": [add(a) for a in item["arrays"]],
                       "shapes": [list(np.shape(a)) for a in item["arrays"]],
                       "dtypes": [np.dtype(a.dtype).str for a in item["arrays"]]}]
                for key, item in state["keys"].items()]
    index = {"v": FORMAT, "shards": shards, "marks": marks, "updater": updater,
             "state": None if state is None else {"scalars": state.get("scalars"), "keys": keys},
             "finished": {str(r): d for r, d in store.finished.items()},
             "codecs": [[codec, params] for codec, params in sorted(codecs.items())]}
    return [json.dumps(index).encode(), *arrays]


class Snapshot:
    """A ``SNAPSHOT`` read and checked (``read_snapshot``): what a replica takes."""

    def __init__(self) -> None:
        self.shards: list[Shard] = []
        self.marks: list[tuple[int, Mark]] = []
        self.updater_blob: bytes | None = None
        self.state: dict | None = None
        self.finished: dict[int, str] = {}
        self.codecs: list[tuple[int, dict]] = []


def read_snapshot(frames: list, num_workers: int, memory: Any, versioned: bool) -> Snapshot:
    """The snapshot that ``frames`` (after the header) carry, every field checked.

    Raises:
        ProtocolError: a field missing, of the wrong type or out of range (the message names it).
    """
    if not frames or len(frames[0].buffer) > _MAX_INDEX:
        raise ProtocolError("a SNAPSHOT without its index, or with one too big")
    try:
        index = json.loads(bytes(frames[0].buffer))
    except ValueError as exc:
        raise ProtocolError(f"a SNAPSHOT's index does not parse: {exc}") from None
    if not isinstance(index, dict) or index.get("v") != FORMAT:
        raise ProtocolError(f"a SNAPSHOT's index of format {str(index.get('v') if isinstance(index, dict) else '?')[:20]}, "
                            f"not {FORMAT}")
    data = [f.buffer for f in frames[1:]]

    def array(i: Any, dtype: np.dtype, count: int, what: str) -> np.ndarray:
        if not is_int(i) or not 0 <= i < len(data):
            raise ProtocolError(f"a SNAPSHOT's {what} names frame {i!r}, not one of its {len(data)}")
        if len(data[i]) != count * dtype.itemsize:
            raise ProtocolError(f"a SNAPSHOT's {what} has {len(data[i])} bytes, not {count} values of {dtype}")
        return np.frombuffer(data[i], dtype, count).copy()

    out = Snapshot()
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise ProtocolError("a SNAPSHOT's shards are not a list")
    seen: set[int] = set()
    for item in shards:
        out.shards.append(_read_shard(item, array, num_workers, memory, versioned, seen))
    for item in _list(index.get("marks"), "marks"):
        out.marks.append(_read_mark(item, data, num_workers, len(out.shards)))
    blob = index.get("updater")
    if blob is not None:
        if not is_int(blob) or not 0 <= blob < len(data):
            raise ProtocolError(f"a SNAPSHOT's updater names frame {blob!r}")
        out.updater_blob = bytes(data[blob])
    state = index.get("state")
    if state is not None:
        out.state = _read_state(state, array, memory)
    finished = index.get("finished")
    if not isinstance(finished, dict) or not all(str(k).isdigit() and int(k) < num_workers for k in finished):
        raise ProtocolError(f"a SNAPSHOT's finished workers {str(finished)[:80]} are not ranks of the job")
    out.finished = {int(k): str(v)[:200] for k, v in finished.items()}
    for item in _list(index.get("codecs"), "codecs"):
        if not (isinstance(item, list) and len(item) == 2 and is_int(item[0]) and isinstance(item[1], dict)):
            raise ProtocolError(f"a SNAPSHOT's codec {str(item)[:80]} is not [id, parameters]")
        out.codecs.append((int(item[0]), item[1]))
    return out


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise ProtocolError(f"a SNAPSHOT's {what} are not a list")
    return value


def _count(value: Any, what: str, high: int = 1 << 62) -> int:
    if not is_int(value) or not 0 <= value < high:
        raise ProtocolError(f"a SNAPSHOT's {what} {value!r} is not a count in 0..{high - 1}")
    return int(value)


def _read_shard(item: Any, array: Callable, num_workers: int, memory: Any, versioned: bool, seen: set) -> Shard:
    if not isinstance(item, dict):
        raise ProtocolError("a SNAPSHOT's shard is not an object")
    key, user_key, shape = item.get("key"), item.get("user_key"), item.get("shape")
    if not is_int(key) or not 0 <= key < 1 << 64 or key in seen:
        raise ProtocolError(f"a SNAPSHOT's key id {key!r} is not a new 64-bit unsigned integer")
    seen.add(key)
    if not (isinstance(user_key, str) or is_int(user_key)) or not is_shape(shape) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"a SNAPSHOT's key {str(user_key)[:40]!r} of shape {str(shape)[:40]} is not a key")
    dtype = dtype_of(item.get("dtype"))
    if dtype is None or dtype not in VALUE_DTYPES:
        raise ProtocolError(f"a SNAPSHOT's key {user_key!r} has dtype {str(item.get('dtype'))[:20]!r}")
    size = int(np.prod(shape)) if shape else 1
    what = f"key {user_key!r}"
    value = array(item.get("value"), dtype, size, f"{what}'s value")
    received = item.get("received")
    if not isinstance(received, list) or len(received) != num_workers:
        raise ProtocolError(f"a SNAPSHOT's {what} counts pushes of {str(received)[:40]}, not of {num_workers} workers")
    sync = item.get("sync") is True
    quorum = num_workers if sync else 1
    count = _count(item.get("count"), f"{what}'s open round", quorum)
    pushed = item.get("pushed")
    if not isinstance(pushed, list) or len(pushed) != count or not all(is_int(w) and 0 <= w < num_workers for w in pushed):
        raise ProtocolError(f"a SNAPSHOT's {what} names {str(pushed)[:40]} as its open round's pushers")
    stored = memory.place(value)
    round_ = Round(num_workers, quorum, memory, memory.empty_like(stored))
    round_.closed = _count(item.get("closed"), f"{what}'s rounds closed")
    round_.received = [_count(r, f"{what}'s pushes taken") for r in received]
    round_.count, round_.pushed, round_.versioned = count, set(pushed), versioned and sync
    if count:
        memory.load(round_.merge, array(item.get("partial"), dtype, size, f"{what}'s open round"))
    backlog = deque()
    for entry in _list(item.get("backlog"), f"{what}'s held pushes"):
        if not (isinstance(entry, list) and len(entry) == 2 and is_int(entry[0]) and 0 <= entry[0] < num_workers):
            raise ProtocolError(f"a SNAPSHOT's {what} holds the push {str(entry)[:40]}")
        backlog.append((int(entry[0]), array(entry[1], dtype, size, f"{what}'s held push")))
    round_.backlog = backlog
    row_size = _count(item.get("row_size"), f"{what}'s row size") or 1
    shard = Shard(int(key), user_key, tuple(shape), stored, round_, sync, row_size)
    for entry in _list(item.get("history"), f"{what}'s kept values"):
        if not (isinstance(entry, list) and len(entry) == 2):
            raise ProtocolError(f"a SNAPSHOT's {what} keeps {str(entry)[:40]}")
        shard.history[_count(entry[0], f"{what}'s kept round")] = memory.place(
            array(entry[1], dtype, size, f"{what}'s kept value"))
    error = item.get("error")
    shard.error = str(error)[:1000] if error is not None else None
    return shard


def _read_mark(item: Any, data: list, num_workers: int, num_parts: int) -> tuple[int, Mark]:
    """A worker's kept mark, read as its ``MARK`` message would be (``marks.read_mark`` checks it)."""
    if not isinstance(item, dict) or not is_int(item.get("worker")) or not 0 <= item["worker"] < num_workers:
        raise ProtocolError(f"a SNAPSHOT's mark {str(item)[:80]} is not of a worker of the job")
    counts = item.get("counts")
    if not is_int(counts) or not 0 <= counts < len(data):
        raise ProtocolError(f"a SNAPSHOT's mark names counts frame {counts!r}")
    head = json.dumps({k: item.get(k) for k in ("id", "scalars", "barriers", "setup")}).encode()
    return int(item["worker"]), read_mark([Frame(memoryview(head)), Frame(data[counts])], max(num_parts, 1))


def _read_state(state: Any, array: Callable, memory: Any) -> dict:
    if not isinstance(state, dict) or not isinstance(state.get("keys"), list):
        raise ProtocolError("a SNAPSHOT's optimizer state is not {scalars, keys}")
    keys = {}
    for entry in state["keys"]:
        if not (isinstance(entry, list) and len(entry) == 2 and (isinstance(entry[0], str) or is_int(entry[0]))
                and isinstance(entry[1], dict)):
            raise ProtocolError(f"a SNAPSHOT's optimizer state of {str(entry)[:60]} is not [key, state]")
        key, item = entry
        frames, shapes, dtypes = item.get("arrays"), item.get("shapes"), item.get("dtypes")
        if not (isinstance(frames, list) and isinstance(shapes, list) and isinstance(dtypes, list)
                and len(frames) == len(shapes) == len(dtypes)):
            raise ProtocolError(f"a SNAPSHOT's optimizer state of key {key!r} lists its arrays unevenly")
        arrays = []
        for i, shape, name in zip(frames, shapes, dtypes):
            dtype = dtype_of(name)
            if dtype is None or dtype not in VALUE_DTYPES or not is_shape(shape):
                raise ProtocolError(f"a SNAPSHOT's optimizer state of key {key!r}: an array of {str(name)[:20]} "
                                    f"{str(shape)[:40]}")
            size = int(np.prod(shape)) if shape else 1
            arrays.append(memory.place(array(i, dtype, size, f"optimizer state of key {key!r}").reshape(shape)))
        keys[key] = {"scalars": item.get("scalars"), "arrays": arrays}
    return {"scalars": state.get("scalars"), "keys": keys}
