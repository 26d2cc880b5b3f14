"""A server's part in checkpoints: write its shards, write the manifest (server 0), restore, re-shard.

Worker 0 drives a commit (``kvcore.elastic.State.commit``): once every worker's pushes were taken,
it asks every server to ``save`` checkpoint ``id``: each writes its file and answers, then syncs it
to disk and renames it into place on its background thread (``psnode.checkpoint.file_format``). Then it asks
server 0 to ``commit`` the manifest it built: server 0 waits, on its background thread, for every
server's file, and writes the manifest; the checkpoint is complete once that file is renamed in,
and only then does server 0 answer (a worker that does not wait for the answer goes on training
meanwhile). ``restore`` loads a complete checkpoint: the request says which key parts this server
holds now, as ``[part id, user key, start, stop]`` of the key's flat elements, so a job with another
number of servers re-shards (the worker computes the new layout; this server reads the ranges it
needs from every old server's file). ``scan`` and ``read`` tell a worker which checkpoint is the
newest complete one and what its manifest says.

Every request is a JSON object from the network: each field is checked, a refusal names what was
wrong (``RequestRefused``, the worker's ``RemoteError``), and no path is taken from it (only ids and
the names ``psnode.checkpoint.layout`` builds). State changing operations (``save``, ``commit``,
``restore``) are taken from worker 0 only.

Optimizer state: the updater the servers hold may offer ``state_dict()`` and
``load_state_dict(state)`` (``kvcore.optim.Updater`` does), with ``state`` of the form
``{"scalars": JSON, "keys": {user key: {"scalars": JSON, "arrays": [array, ...]}}}``; each key's
arrays have the shape of the value the updater was given for it (element-wise state, so they can be
re-sharded with the values). An updater without them has its values checkpointed and nothing else.
Restored keys are announced to an updater with ``restore_key(key, value)`` (when it has one) instead
of ``init_key``, so it keeps the restored weights.

Single-threaded (the server's loop), but for what runs on the background thread (``BackgroundWork``,
in order): syncing and renaming this server's files, completing a checkpoint (server 0), and
removing old checkpoints. The loop calls ``poll()`` to answer the requests that waited for it and
``busy`` says when to call it soon. Long reads and writes call ``beat`` between chunks so that the
server's heartbeats go on.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Hashable

import numpy as np

from psnode.checkpoint import file_format as cf
from psnode.checkpoint import layout as ck
from psnode.errors import RequestRefused
from psnode.log import logger
from psnode.node.values import is_int
from psnode.server.background import BackgroundWork

__all__ = ["Checkpoints"]

_OPS = ("save", "commit", "scan", "read", "restore")
_CHANGING = frozenset({"save", "commit", "restore"})
_FILES_PATIENCE = 1800.0  # seconds server 0 waits for the other servers' files of a commit (a slow shared disk)

Answer = Callable[[bool, Any], None]
"""How a request is answered: ``answer(True, reply object)`` or ``answer(False, RequestRefused)``."""


class Checkpoints:
    """The checkpoint requests of one server (see the module docstring).

    ``store``: its ``ServerStore``; ``groups``: its ``server_groups.Groups`` (dissolved before values
    are read or replaced); ``root``: the checkpoint directory (None: checkpoints are off);
    ``rank``: a callable giving this server's rank; ``beat``: keeps heartbeats going.
    """

    def __init__(self, store: Any, groups: Any, root: str | None, num_servers: int, job_id: str,
                 rank: Callable[[], int], beat: Callable[[], None]) -> None:
        self.store = store
        self.groups = groups
        self.root = root
        self.num_servers = num_servers
        self.job_id = job_id
        self._rank = rank
        self._beat = beat
        self.background = BackgroundWork("psnode-checkpoint")

    @property
    def busy(self) -> bool:
        """True while work of the background thread is under way: call ``poll`` soon."""
        return self.background.busy

    def poll(self) -> None:
        """Answer the requests whose background work has finished (call it from the server's loop)."""
        self.background.finished()

    def handle(self, worker: int, body: Any, answer: Answer) -> None:
        """Run one request of worker ``worker`` and ``answer`` it: now, or for ``commit`` once the
        checkpoint is complete (from a later ``poll``).

        Raises:
            RequestRefused: a malformed request, one worker ``worker`` may not make, no checkpoint
                directory, or the files cannot be read or written (the message says which).
        """
        if not isinstance(body, dict) or body.get("op") not in _OPS:
            raise RequestRefused(f"a checkpoint request must be an object with op one of {', '.join(_OPS)}, "
                                 f"got {str(body)[:200]}")
        op = body["op"]
        if op in _CHANGING and worker != 0:
            raise RequestRefused(f"worker {worker} may not {op} a checkpoint; worker 0 does it for the job")
        if self.root is None:
            raise RequestRefused(f"server {self._rank()} has no checkpoint directory (PSLAUNCH_CHECKPOINT_DIR); "
                                 "start the job with pslaunch --checkpoint-dir DIR")
        if op == "commit":
            self.commit(body.get("id"), body.get("manifest"), answer)
            return
        if op == "scan":
            newest, highest = ck.scan(self.root)
            reply = {"newest": newest, "highest": highest}
        elif op == "read":
            reply = {"manifest": ck.read_manifest(self.root, body.get("id"))}
        elif op == "save":
            reply = self.save(body.get("id"), body.get("preempted") is True)
        else:
            reply = self.restore(body.get("id"), body.get("parts"))
        answer(True, reply)

    # ---- writing --------------------------------------------------------------------------------
    def save(self, ckpt_id: Any, preempted: bool = False) -> dict:
        """Write this server's file of checkpoint ``ckpt_id``: every shard (and every restored value
        not initialised yet), the updater's state. Refused while a round is open, unless ``preempted``:
        worker 0 of a preempted job asks at its step boundary, where every round of its step is applied
        and the open rounds (the others' pushes of the next step) cannot close without it, so the
        values held are exactly those after the step (``kvcore.preempting``)."""
        directory = ck.dir_of(self.root, ckpt_id)
        store, memory = self.store, self.store.memory
        self._dissolve()
        for shard in store.shards.values():
            round_ = shard.round
            if (round_.count or round_.backlog) and not preempted:
                raise RequestRefused(
                    f"key {shard.user_key!r} has pushes of workers {sorted(round_.pushed)} in a round that is still "
                    f"open on server {self._rank()}: commit between steps, once every worker pushed every key the "
                    "same number of times")
        body = cf.ServerFile()
        shards = []
        for shard in store.shards.values():
            host = np.ascontiguousarray(memory.host(shard.stored)).reshape(-1)
            shards.append({"key_id": shard.key_id, "user_key": shard.user_key, "shape": list(shard.shape),
                           "dtype": shard.dtype.str, "row_size": shard.row_size, "offset": body.add(host)})
        for key_id, (user_key, value) in store.pending.items():
            shards.append({"key_id": key_id, "user_key": user_key, "shape": [int(value.size)],
                           "dtype": value.dtype.str, "row_size": 1, "offset": body.add(value.reshape(-1))})
        state = self.updater_state()
        states = []
        for key, item in state["keys"].items():
            cf.check_user_key(key, lambda what: RequestRefused(f"the updater's state_dict(): {what}"))
            arrays = []
            for array in item["arrays"]:
                host = np.ascontiguousarray(memory.host(array))
                if host.dtype not in cf.STATE_DTYPES:
                    raise RequestRefused(f"the updater's state of key {key!r} holds an array of dtype {host.dtype}, "
                                         "which a checkpoint cannot hold")
                arrays.append({"shape": list(host.shape), "dtype": host.dtype.str, "offset": body.add(host)})
            states.append({"user_key": key, "scalars": item["scalars"], "arrays": arrays})
        index = {"format": cf.FORMAT, "id": ckpt_id, "server": self._rank(), "num_servers": self.num_servers,
                 "job_id": self.job_id, "shards": shards, "states": states, "updater": state["scalars"]}
        name = ck.file_name(self._rank(), self.num_servers)
        size, tmp = cf.write_server_file(directory, name, index, body, self._beat)
        logger.info("server %d wrote %s of checkpoint %d (%d bytes); syncing it", self._rank(), name, ckpt_id, size)
        def settled(ok: bool, error: Any) -> None:  # a failure reaches the workers through server 0's commit
            if not ok:
                logger.error("server %d: %s", self._rank(), error)

        self.background.submit(lambda: cf.settle_server_file(tmp, os.path.join(directory, name)), settled)
        return {"name": name, "bytes": size, "shards": len(shards)}

    def updater_state(self) -> dict:
        """The updater's ``state_dict()`` checked for form, or the restored state it has not taken yet."""
        updater = self.store.updater
        dump = getattr(updater, "state_dict", None)
        if dump is None:
            held = self.store.restored_state
            return held if held is not None else {"scalars": None, "keys": {}}
        try:
            state = dump()
        except Exception as exc:  # the user's code
            raise RequestRefused(f"the updater's state_dict() raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(state, dict) or not isinstance(state.get("keys"), dict):
            raise RequestRefused("the updater's state_dict() must return {'scalars': ..., 'keys': {key: {'scalars': "
                                 f"..., 'arrays': [...]}}}}}}, got {type(state).__name__}")
        keys = {}
        for key, item in state["keys"].items():
            if not isinstance(item, dict) or not isinstance(item.get("arrays", []), (list, tuple)):
                raise RequestRefused(f"the updater's state_dict() for key {key!r} is not {{'scalars', 'arrays'}}")
            keys[key] = {"scalars": ck.json_safe(item.get("scalars"), f"the updater's scalars of key {key!r}"),
                         "arrays": list(item.get("arrays", []))}
        return {"scalars": ck.json_safe(state.get("scalars"), "the updater's scalars"), "keys": keys}

    def commit(self, ckpt_id: Any, manifest: Any, answer: Answer) -> None:
        """Server 0: complete checkpoint ``ckpt_id`` on the background thread (every server's file
        synced and in place, then the manifest), and ``answer`` once it is complete or failed; then
        remove the checkpoints older than the newest ``KEEP``."""
        directory = ck.dir_of(self.root, ckpt_id)
        if self._rank() != 0:
            raise RequestRefused(f"server {self._rank()} was asked to commit a manifest; server 0 writes it")
        ck.check_manifest(manifest, f"the manifest of checkpoint {ckpt_id}")
        if manifest["id"] != ckpt_id:
            raise RequestRefused(f"a manifest of checkpoint {manifest['id']} was sent to commit {ckpt_id}")
        background = self.background

        def complete() -> dict:
            ck.finish_checkpoint(directory, manifest, background.stopping, _FILES_PATIENCE)
            logger.info("server 0 committed checkpoint %d", ckpt_id)
            return {"id": ckpt_id}

        def answered(ok: bool, value: Any) -> None:
            if not ok:
                logger.error("server 0: %s", value)
                if not isinstance(value, RequestRefused):
                    value = RequestRefused(f"checkpoint {ckpt_id} is not complete: {type(value).__name__}: {value}")
            answer(ok, value)

        background.submit(complete, answered)
        # Old checkpoints go after the commit, on the same thread: freeing gigabytes takes a while, and
        # it touches only directories nobody writes any more (one cut short is finished by the next).
        background.submit(lambda: ck.collect(self.root, ckpt_id))

    def close(self, timeout: float = 3.0) -> None:
        """Let the background work (syncs, a commit's completion, removals) finish for at most
        ``timeout`` seconds, and answer what finished."""
        self.background.close(timeout)

    # ---- restoring ------------------------------------------------------------------------------
    def restore(self, ckpt_id: Any, parts: Any) -> dict:
        """Load checkpoint ``ckpt_id``'s values of ``parts`` (this server's key parts in the job's
        layout now) and the matching optimizer state. Everything is read and checked before
        anything changes: a refused restore leaves the server as it was."""
        manifest = ck.read_manifest(self.root, ckpt_id)
        directory = ck.dir_of(self.root, ckpt_id)
        keys = {(type(e["key"]), e["key"]): e for e in manifest["keys"]}
        wanted = self._check_parts(parts, keys, ckpt_id)
        files = _Files(directory, manifest)
        self._dissolve()
        values = {}
        for part_id, user_key, start, stop in wanted:
            entry = keys[(type(user_key), user_key)]
            out = np.empty(stop - start, np.dtype(entry["dtype"]))
            for server, old_id, lo, hi in entry["parts"]:
                a, b = max(lo, start), min(hi, stop)
                if a < b:
                    files.read(server, old_id, user_key, a - lo, hi - lo, entry["dtype"], out[a - start:b - start], self._beat)
            values[part_id] = (user_key, out)
        self._check_held(values, ckpt_id)
        state = self._restore_state(wanted, keys, files, manifest)
        store, memory = self.store, self.store.memory
        loaded = 0
        for part_id, (user_key, value) in values.items():
            shard = store.shards.get(part_id)
            if shard is None:
                store.pending[part_id] = (user_key, value)
                continue
            shard.stored = memory.place(value)  # a new array: replies in flight may still read the old one
            shard.trackers = []
            shard.error = None
            store.restored.add(part_id)
            restore_key = getattr(store.updater, "restore_key", None)
            if restore_key is not None:
                with memory.context():
                    restore_key(user_key, shard.stored.reshape(shard.shape))
            loaded += 1
        store.take_restored_state(state)
        logger.info("server %d restored checkpoint %d: %d keys now, %d when initialised", self._rank(), ckpt_id,
                    loaded, len(values) - loaded)
        return {"loaded": loaded, "pending": len(values) - loaded, "states": len(state["keys"]) if state else 0}

    def _check_parts(self, parts: Any, keys: dict, ckpt_id: int) -> list[tuple[int, Hashable, int, int]]:
        if not isinstance(parts, list):
            raise RequestRefused(f"a restore request's parts are a {type(parts).__name__}, not a list")
        wanted = []
        seen = set()
        for part in parts:
            if not isinstance(part, list) or len(part) != 4:
                raise RequestRefused(f"a restore part {str(part)[:100]} is not [part id, key, start, stop]")
            part_id, user_key, start, stop = part
            cf.check_user_key(user_key, lambda what: RequestRefused(f"a restore part: {what}"))
            entry = keys.get((type(user_key), user_key))
            if entry is None:
                raise RequestRefused(f"key {user_key!r} is not in checkpoint {ckpt_id}")
            size = int(np.prod(entry["shape"], dtype=np.int64)) if entry["shape"] else 1
            if (not is_int(part_id) or not 0 <= part_id < 1 << 64 or part_id in seen or not is_int(start)
                    or not is_int(stop) or not 0 <= start <= stop <= size):
                raise RequestRefused(f"restore part {str(part)[:100]} of key {user_key!r} (of {size} elements in "
                                     f"checkpoint {ckpt_id})")
            seen.add(part_id)
            wanted.append((part_id, user_key, start, stop))
        return wanted

    def _check_held(self, values: dict, ckpt_id: int) -> None:
        """Keys already initialised here must match the checkpoint's dtype and size, and be idle."""
        for part_id, (user_key, value) in values.items():
            shard = self.store.shards.get(part_id)
            if shard is None:
                continue
            if shard.user_key != user_key or shard.dtype != value.dtype or shard.size != value.size:
                raise RequestRefused(
                    f"key {shard.user_key!r} holds {shard.size} values of {shard.dtype} on server {self._rank()}, but "
                    f"checkpoint {ckpt_id} has {value.size} values of {value.dtype} of key {user_key!r} for it")
            if shard.round.count or shard.round.backlog or shard.round.waiting:
                raise RequestRefused(f"key {user_key!r} is in the middle of a round on server {self._rank()}: "
                                     "restore before the first push")

    def _restore_state(self, wanted: list, keys: dict, files: "_Files", manifest: dict) -> dict | None:
        """The optimizer state for this server's parts now, in ``state_dict`` form (None: the
        checkpoint holds none). Taken as it was when this server holds the same parts of a key as
        the server of its rank did; else cut from the old servers' arrays, which needs one part
        per key per server on both sides (element-wise state)."""
        if not files.has_states():
            return None
        rank, memory = self._rank(), self.store.memory
        mine: dict[tuple, list] = {}
        for part_id, user_key, start, stop in wanted:
            mine.setdefault((type(user_key), user_key), []).append((part_id, start, stop))
        out: dict[Hashable, dict] = {}
        for tkey, held in mine.items():
            user_key = tkey[1]
            entry = keys[tkey]
            old = entry["parts"]
            if rank < manifest["num_servers"] and set(held) == {tuple(p[1:]) for p in old if p[0] == rank}:
                same = files.state(rank, user_key)  # the same parts as before: the state as it was, if any
                if same is not None:
                    out[user_key] = {"scalars": same["scalars"],
                                     "arrays": [memory.place(files.read_state(rank, a, self._beat)) for a in same["arrays"]]}
                continue
            holders = [p for p in old if files.state(p[0], user_key) is not None]
            if not holders:
                continue
            why = None
            if len(held) != 1:
                why = f"server {rank} now holds {len(held)} parts of it"
            elif any(sum(1 for q in old if q[0] == p[0]) != 1 for p in old):
                why = "an old server held several parts of it"
            elif len(holders) != len(old):
                why = f"servers {sorted(p[0] for p in old if p not in holders)} held no state of it"
            if why is None:
                counts = {len(files.state(p[0], user_key)["arrays"]) for p in old}
                sizes_ok = all(a["_size"] == p[3] - p[2] for p in old for a in files.state(p[0], user_key)["arrays"])
                if len(counts) != 1 or not sizes_ok:
                    why = "its state arrays are not element-wise (one value per element of the key)"
            if why is not None:
                raise RequestRefused(f"cannot re-shard the optimizer state of key {user_key!r} onto "
                                     f"{self.num_servers} servers: {why}; restore onto "
                                     f"{manifest['num_servers']} servers")
            _, start, stop = held[0]
            arrays = []
            for i in range(counts.pop()):
                dtype = files.state(old[0][0], user_key)["arrays"][i]["_dtype"]
                array = np.empty(stop - start, dtype)
                for server, _, lo, hi in old:
                    a, b = max(lo, start), min(hi, stop)
                    if a < b:
                        files.read_state_into(server, user_key, i, a - lo, array[a - start:b - start], self._beat)
                if start == 0 and stop == (int(np.prod(entry["shape"], dtype=np.int64)) if entry["shape"] else 1):
                    array = array.reshape(entry["shape"])
                arrays.append(memory.place(array))
            first = min(old, key=lambda p: (p[2] > start, p[2]))
            out[user_key] = {"scalars": files.state(first[0], user_key)["scalars"], "arrays": arrays}
        scalars = files.updater_scalars(rank)
        return {"scalars": scalars, "keys": out}

    def _dissolve(self) -> None:
        for group in list(self.groups.by_keys.values()):
            self.groups.dissolve(group)


class _Files:
    """The old servers' files of one checkpoint, their indexes read once, checked against the manifest."""

    def __init__(self, directory: str, manifest: dict) -> None:
        self.directory = directory
        self.manifest = manifest
        self._index: dict[int, tuple[str, dict, int]] = {}

    def _open(self, server: int) -> tuple[str, dict, int]:
        if server not in self._index:
            item = self.manifest["files"][server]
            path = os.path.join(self.directory, item["name"])
            index, data, size = cf.read_index(path)
            if size != item["bytes"]:
                raise RequestRefused(f"{path} holds {size} bytes, but the manifest says {item['bytes']}")
            index["_shards"] = {e["key_id"]: e for e in index["shards"]}
            index["_states"] = {(type(s["user_key"]), s["user_key"]): s for s in index["states"]}
            self._index[server] = (path, index, data)
        return self._index[server]

    def has_states(self) -> bool:
        """True when any server's file holds optimizer state."""
        return any(self._open(s)[1]["states"] or self._open(s)[1].get("updater") is not None
                   for s in range(len(self.manifest["files"])))

    def read(self, server: int, part_id: int, user_key: Hashable, start: int, size: int, dtype: str,
             out: np.ndarray, beat: Callable[[], None]) -> None:
        """Elements ``start : start + out.size`` of part ``part_id`` (of ``size`` elements) from
        ``server``'s file into ``out``."""
        path, index, data = self._open(server)
        entry = index["_shards"].get(part_id)
        if entry is None or entry["user_key"] != user_key:
            raise RequestRefused(f"{path} holds no part {part_id:#x} of key {user_key!r}, which the manifest lists")
        if entry["_dtype"] != np.dtype(dtype) or entry["_size"] != size:
            raise RequestRefused(f"{path}: part {part_id:#x} of key {user_key!r} holds {entry['_size']} values of "
                                 f"{entry['_dtype']}, the manifest says {size} of {np.dtype(dtype)}")
        cf.read_into(path, data, entry, start, out)
        beat()

    def state(self, server: int, user_key: Hashable) -> dict | None:
        """``server``'s optimizer state entry of ``user_key``, or None."""
        if server >= len(self.manifest["files"]):
            return None
        return self._open(server)[1]["_states"].get((type(user_key), user_key))

    def read_state(self, server: int, entry: dict, beat: Callable[[], None]) -> np.ndarray:
        """A whole state array of ``server``'s file, in its shape."""
        path, _, data = self._open(server)
        out = np.empty(entry["_size"], entry["_dtype"])
        cf.read_into(path, data, entry, 0, out)
        beat()
        return out.reshape(entry["shape"])

    def read_state_into(self, server: int, user_key: Hashable, i: int, start: int, out: np.ndarray,
                        beat: Callable[[], None]) -> None:
        """Elements ``start : start + out.size`` of ``server``'s state array ``i`` of ``user_key``."""
        path, _, data = self._open(server)
        cf.read_into(path, data, self.state(server, user_key)["arrays"][i], start, out)
        beat()

    def updater_scalars(self, rank: int) -> Any:
        """The updater's own scalars: those of the old server of this rank, else server 0's."""
        server = rank if rank < len(self.manifest["files"]) else 0
        return self._open(server)[1].get("updater")
