"""Resuming training where it stopped: ``State`` checkpoints the model the servers hold, and a few scalars.

The servers hold the model (weights and optimizer state), so a training script needs three lines::

    state = kvcore.elastic.State(kv, epoch=0, step=0)   # after kv.init / set_optimizer
    state.restore()                                     # loads the newest checkpoint; a no-op on the first start
    for ...:
        ...
        state.epoch, state.step = e, s
        if s % K == 0:
            state.commit()

``commit()`` is a collective of the workers: each waits until the servers took its pushes, then
worker 0 has every server write its shards (values, optimizer state, key/shape/dtype) to a
temporary file, and returns: training goes on while each server syncs its file to disk and renames
it into place, and server 0 then writes the manifest with the scalars (worker 0's values); the
checkpoint is complete once the manifest is renamed in (``commit(wait=True)`` returns only then;
the job's end waits for it too). A commit that did not complete (a server died meanwhile) is
ignored by ``restore``, which loads the newest complete
checkpoint into the servers and its scalars into ``state``. A key restored keeps the checkpoint's
value also when ``kv.init`` comes after ``restore`` (shape and dtype must match); a job with another
number of servers gets the keys re-sharded. Checkpoints live in ``PSLAUNCH_CHECKPOINT_DIR``
(``pslaunch --checkpoint-dir DIR``); without one, ``restore`` finds nothing and ``commit`` keeps
nothing (with a warning). Details: docs/failures.md.

A worker pslaunch restarted alone (``--restart-scope worker``) does not load a checkpoint: the
servers, which never stopped, hold newer values. In ``dist_sync`` (and ``dist_device_sync``) it is a
replacement in place: setting a scalar marks the worker's place (sent to the servers before its
next push, no round trip), and a replacement's ``restore()`` returns the scalars its predecessor set
last, from where it redoes the steps exactly (no checkpoint directory needed). In ``dist_async`` it
restores the scalars of the newest checkpoint.

``State`` works with a ``dist_sync`` / ``dist_async`` / ``dist_device_sync`` KVStore and with a
'dist' shared model (``create_shared_model('dist')``, after ``model.init(devices)``; call
``restore()`` before ``init_key``, so that the keys start from the checkpoint).
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

import numpy as np

from .errors import CheckpointError, DTypeMismatchError, KVStoreError, ServerError, ShapeMismatchError
from .stores.base import KeyMeta

__all__ = ["State"]

_OWN = frozenset({"restore", "commit", "commit_alone", "wait", "scalars", "checkpoint_id", "restart_count",
                  "register_reset_callbacks", "on_reset"})
_NOTE_TEXT = 3000  # characters of an error message carried in a barrier note


class State:
    """The scalars a training script resumes from (``epoch``, ``step`` ...) and the model's checkpoints.

    Args:
        store: a distributed KVStore (``kvcore.create('dist_sync')`` ...) after its keys and optimizer
            are set up, or a 'dist' ``SharedModel`` after ``init(devices)``.
        **scalars: names and starting values (JSON values: numbers, strings, booleans, lists, dicts);
            read and set them as attributes.

    Thread-safety: ``commit`` and ``restore`` are collectives; call them from the one thread that
    drives the store, between steps, on every worker.

    Raises:
        TypeError: ``store`` is neither; ValueError: a scalar's name is one of ``State``'s own.
    """

    def __init__(self, store: Any, **scalars: Any) -> None:
        model, kv = _store_of(store)
        for name in scalars:
            if name in _OWN or name.startswith("_"):
                raise ValueError(f"a scalar may not be called {name!r}: State uses that name itself")
        self._model = model
        self._kv = kv
        self._names = tuple(scalars)
        self._next: int | None = None  # worker 0: the id of the next commit
        self._warned = False
        self._manifest: dict = {}  # worker 0: the manifest it restored
        self._completing: tuple[int, Any] | None = None  # worker 0: (id, future) of a commit not known complete
        self.checkpoint_id: int | None = None
        """The id of the checkpoint restored or committed last (None before either)."""
        for name, value in scalars.items():
            object.__setattr__(self, name, value)
        kv.note_scalars(self.scalars)  # the starting place: a replacement that finds no later mark begins here
        self._reset_callbacks: list = []  # an elastic job's: called at the step boundary after a change
        if model is None and hasattr(kv, "script_state"):
            kv.script_state = self  # a preempted job's worker 0 commits it alone (kvcore.preempting); resets

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in self.__dict__.get("_names", ()):  # a scalar: where a replacement in place would resume
            self._kv.note_scalars(self.scalars)

    @property
    def scalars(self) -> dict[str, Any]:
        """The scalars' current values, by name."""
        return {name: getattr(self, name) for name in self._names}

    @property
    def restart_count(self) -> int:
        """How many times pslaunch restarted the job before this start (``PSLAUNCH_RESTART_COUNT``)."""
        return self._kv.job.restart_count

    # ---- restore ----------------------------------------------------------------------------------
    def restore(self) -> bool:
        """Load the newest complete checkpoint into the servers and its scalars into this state.

        Blocking and collective: every worker calls it (before its first push). Returns True when a
        checkpoint was restored, False when there is none (the first start) or no checkpoint
        directory. A worker replaced in place (``dist_sync`` under ``--restart-scope worker``) loads
        no checkpoint: it takes the scalars its predecessor set last (True; False when it set none)
        and redoes its steps from there, alone.

        Raises:
            ShapeMismatchError, DTypeMismatchError: a key initialised here differs from the
                checkpoint's (naming both shapes). CheckpointError: the checkpoint cannot be read or
                loaded (the message names the file and why). Every worker raises the same error.
        """
        kv = self._kv
        if getattr(kv, "joined", False):  # joined the running elastic job: the members' scalars at its start
            scalars = kv.joined_scalars()
            for name, value in scalars.items():
                if name in self._names:
                    setattr(self, name, value)
            return bool(scalars)
        if kv.rejoined and kv.type != "dist_async":  # replaced in place: its predecessor's last mark
            resumed = kv.resumed_scalars()
            if resumed is None:
                return False
            for name, value in resumed.items():
                if name in self._names:
                    setattr(self, name, value)
            kv.resume_barriers()  # from here on it is where its predecessor was
            return True
        if kv.job.checkpoint_dir is None:
            return False
        if kv.rejoined:  # restarted alone: the servers hold newer values; only the scalars come back
            newest = self._ask(0, {"op": "scan"}).get("newest")
            if newest is None:
                return False
            manifest = self._ask(0, {"op": "read", "id": newest})["manifest"]
            for name, value in manifest["scalars"].items():
                if name in self._names:
                    setattr(self, name, value)
            self.checkpoint_id = newest
            return True
        kv.wait_pushes()
        note = None
        if kv.rank == 0:
            note = self._guarded(self._restore_on_servers)
        result = self._agree(note)
        ckpt_id = result["id"]
        if ckpt_id is None:
            return False
        manifest = self._manifest if kv.rank == 0 else self._ask(0, {"op": "read", "id": ckpt_id})["manifest"]
        self._take(manifest)
        return True

    def _restore_on_servers(self) -> dict:
        kv = self._kv
        found = self._ask(0, {"op": "scan"})
        newest, highest = found.get("newest"), found.get("highest")
        self._next = (highest + 1) if isinstance(highest, int) else 1
        if newest is None:
            return {"id": None}
        manifest = self._ask(0, {"op": "read", "id": newest})["manifest"]
        parts: dict[int, list] = {s: [] for s in range(kv.num_servers)}
        # the checkpoint's keys not initialised yet are placed as one call (kvcore.stores.placement); their
        # init later keeps that placement, and the servers read each range from wherever it was
        kv.place([(e["key"], tuple(e["shape"]), np.dtype(e["dtype"])) for e in manifest["keys"]])
        for entry in manifest["keys"]:
            key, shape, dtype = entry["key"], tuple(entry["shape"]), np.dtype(entry["dtype"])
            meta = kv.key_meta(key)
            if meta is not None and (meta.shape != shape or meta.dtype != dtype):
                kind = ShapeMismatchError if meta.shape != shape else DTypeMismatchError
                raise kind(f"key {key!r} is initialised with shape {meta.shape} and dtype {meta.dtype}, but checkpoint "
                           f"{newest} holds shape {shape} and dtype {dtype} for it")
            for part in kv.layout_for(key, shape, dtype).parts:
                parts[part.server].append([part.id, key, part.start, part.stop])
        self._run({s: {"op": "restore", "id": newest, "parts": p} for s, p in parts.items()},
                  f"restoring checkpoint {newest}")
        self._manifest = manifest
        return {"id": newest}

    def _take(self, manifest: dict) -> None:
        """This worker's side of a restore: the scalars, and the keys the servers now hold."""
        for name, value in manifest["scalars"].items():
            if name in self._names:
                setattr(self, name, value)
        for entry in manifest["keys"]:
            self._kv.note_restored(entry["key"], KeyMeta(tuple(entry["shape"]), np.dtype(entry["dtype"])))
        self.checkpoint_id = manifest["id"]

    # ---- commit -------------------------------------------------------------------------------------
    def commit(self, wait: bool = False) -> int | None:
        """Checkpoint the model and the scalars (worker 0's values); return the checkpoint's id.

        Blocking and collective: every worker calls it between steps, once it pushed what the step
        pushes (in ``dist_sync`` every worker must have pushed every key equally often). It returns
        once every server wrote its file; the servers then sync their files to disk and server 0
        completes the checkpoint (its manifest) while training goes on, so a failure in the
        moment after a commit may restore the one before it. ``wait=True`` returns only once the
        checkpoint is complete and on disk. Either way the job does not end before it is. Returns
        None, with a warning the first time, when the job has no checkpoint directory.

        Raises:
            TypeError: a scalar is not a JSON value. CheckpointError: a server could not write its
                file, or the previous commit could not be completed (naming the file and why); the
                checkpoint is then not complete and ``restore`` ignores it. Every worker raises the
                same error.
        """
        kv = self._kv
        scalars = self.scalars
        try:
            if json.loads(json.dumps(scalars)) != scalars:
                raise TypeError("it does not read back equal")
        except (TypeError, ValueError) as exc:
            raise TypeError(f"State's scalars must be JSON values (numbers, strings, booleans, lists, dicts): "
                            f"{scalars!r}: {exc}") from None
        if kv.job.checkpoint_dir is None:
            if not self._warned:
                self._warned = True
                warnings.warn("State.commit(): the job has no checkpoint directory (pslaunch --checkpoint-dir DIR, "
                              "PSLAUNCH_CHECKPOINT_DIR), so nothing is kept", RuntimeWarning, stacklevel=2)
            return None
        if self._model is not None:
            self._model.barrier()  # the model's rounds in flight are answered
        kv.wait_pushes()
        kv.barrier()  # every worker's pushes are in
        note = None
        # worker 0 writes the checkpoint, unless it is a replacement in place redoing a commit its
        # predecessor completed (the servers hold later values now): the outcome barrier has its note
        if kv.rank == 0 and not kv.outcome_known():
            note = self._guarded(lambda: self._commit_on_servers(scalars, wait))
        self.checkpoint_id = self._agree(note)["id"]
        return self.checkpoint_id

    def register_reset_callbacks(self, callbacks: Any) -> None:
        """Call each of ``callbacks`` (no arguments) when an elastic job's membership changed (a worker
        left), in the training thread at this worker's next step boundary (its next push after the
        step's pulls), once ``kv.num_workers`` says the new count: rescale a learning rate, split the
        data again. Horovod's ``register_reset_callbacks``."""
        self._reset_callbacks.extend(callbacks if isinstance(callbacks, (list, tuple)) else [callbacks])

    def on_reset(self) -> None:
        """The membership changed: run the reset callbacks (``kvcore.leaving`` calls it)."""
        for callback in list(self._reset_callbacks):
            callback()

    def commit_alone(self) -> int:
        """Worker 0 of a preempted job, at a step boundary: checkpoint the model and the scalars now,
        without the other workers (no round of the next step can close without this worker's push, so
        the servers hold exactly the values after this step), and wait until it is complete.

        Raises:
            CheckpointError: a server could not write its file (naming it and why).
        """
        note = self._guarded(lambda: self._commit_on_servers(self.scalars, True, preempted=True))
        if "error" in note:
            raise CheckpointError(f"the checkpoint of the preempted job could not be written: {note['error']}")
        self.checkpoint_id = note["id"]
        return self.checkpoint_id

    def wait(self) -> int | None:
        """Block until the last commit is complete and on disk; its id (None: none was made).

        Collective: every worker calls it (at the end of training, say, to learn whether the last
        commit completed; the job's end waits for it anyway, but only this raises its error).

        Raises:
            CheckpointError: it could not be completed (naming the file and why), on every worker.
        """
        if self._kv.job.checkpoint_dir is None:
            return None
        note = None
        if self._kv.rank == 0:
            note = self._guarded(lambda: self._complete() or {"id": self.checkpoint_id})
        return self._agree(note)["id"]

    def _commit_on_servers(self, scalars: dict, wait: bool, preempted: bool = False) -> dict:
        kv, env = self._kv, self._kv.job
        self._complete()  # the previous commit's outcome first: an error of it is this call's
        if self._next is None:
            highest = self._ask(0, {"op": "scan"}).get("highest")
            self._next = (highest + 1) if isinstance(highest, int) else 1
        ckpt_id = self._next
        replies = self._run({s: {"op": "save", "id": ckpt_id, "preempted": preempted} for s in range(kv.num_servers)},
                            f"writing checkpoint {ckpt_id}")
        files = []
        for server in range(kv.num_servers):
            reply = replies.get(server)
            if not isinstance(reply, dict) or not isinstance(reply.get("name"), str) or not isinstance(reply.get("bytes"), int):
                raise CheckpointError(f"server {server} answered the write of checkpoint {ckpt_id} with {str(reply)[:200]}")
            files.append({"server": server, "name": reply["name"], "bytes": reply["bytes"]})
        manifest = {"format": 1, "id": ckpt_id, "num_servers": kv.num_servers, "store": kv.type,
                    "job_id": env.job_id, "restart_count": env.restart_count, "created": time.time(),
                    "bigarray_bound": env.bigarray_bound, "files": files, "keys": self._key_table(),
                    "scalars": scalars}
        self._next = ckpt_id + 1
        # Server 0 answers once the checkpoint is complete; the worker's close waits for that answer.
        future, _ = self._kv.send_checkpoint_requests({0: {"op": "commit", "id": ckpt_id, "manifest": manifest}})
        self._completing = (ckpt_id, future)
        if wait:
            self._complete()
        return {"id": ckpt_id}

    def _complete(self) -> None:
        """Worker 0: wait until the last commit is complete.

        Raises:
            CheckpointError: it could not be completed (server 0's reason).
        """
        if self._completing is None:
            return
        ckpt_id, future = self._completing
        self._completing = None
        self._wait(future, f"completing checkpoint {ckpt_id}")

    def _key_table(self) -> list[dict]:
        """Every key the servers hold (initialised, or restored and not initialised yet) and where."""
        kv = self._kv
        metas = kv.held_keys()
        table = []
        for key, meta in metas.items():
            lay = kv.layout_for(key, meta.shape, meta.dtype)
            table.append({"key": key, "shape": list(meta.shape), "dtype": meta.dtype.str, "row_size": lay.row_size,
                          "parts": [[p.server, p.id, p.start, p.stop] for p in lay.parts]})
        return table

    # ---- plumbing ------------------------------------------------------------------------------------
    def _ask(self, server: int, body: dict) -> dict:
        return self._run({server: body}, f"checkpoint request {body['op']!r}")[server]

    def _run(self, bodies: dict[int, dict], what: str) -> dict[int, Any]:
        """Send checkpoint requests to servers and wait for every answer (no time limit: liveness
        is checked, a dead server fails it); ``{server: reply}``.

        Raises:
            CheckpointError: a server refused (its message says why).
        """
        future, replies = self._kv.send_checkpoint_requests(bodies)
        self._wait(future, what)
        return dict(replies)

    def _wait(self, future: Any, what: str) -> None:
        """Wait for a checkpoint request's answers (no time limit: liveness is checked).

        Raises:
            CheckpointError: a server refused (its message says why).
        """
        try:
            self._kv.wait_for(future)
        except ServerError as exc:  # a refusal: its message says why
            raise CheckpointError(f"{what} failed: {exc}") from exc

    def _guarded(self, run: Any) -> dict:
        """Worker 0's part, its outcome as a barrier note (an error travels as its kind and message)."""
        try:
            return run()
        except (KVStoreError, TypeError, ValueError) as exc:
            return {"error": str(exc)[:_NOTE_TEXT], "kind": type(exc).__name__}

    def _agree(self, note: dict | None) -> dict:
        """Every worker learns worker 0's outcome (a barrier with its note) and raises its error alike."""
        notes = self._kv.barrier_with_note(note)
        outcome = next((n for n in notes if isinstance(n, dict)), None)
        if outcome is None:
            raise CheckpointError("worker 0 left no outcome of the checkpoint operation in the barrier")
        if "error" in outcome:
            kinds = {cls.__name__: cls for cls in (ShapeMismatchError, DTypeMismatchError, CheckpointError, TypeError,
                                                   ValueError)}
            raise kinds.get(str(outcome.get("kind")), CheckpointError)(str(outcome["error"]))
        return outcome


def _store_of(store: Any) -> tuple[Any, Any]:
    """``(shared model or None, distributed KVStore)`` behind ``store``."""
    from .shared_model import SharedModel
    from .stores.distributed import DistKVStore

    if isinstance(store, DistKVStore):
        return None, store
    if isinstance(store, SharedModel):
        dist = store.dist_store
        if store.kind != "dist" or dist is None:
            raise TypeError(f"State needs a 'dist' shared model after init(devices); this one is {store.kind!r}"
                            f"{'' if dist is not None else ' and has no distributed store yet'}")
        return store, dist
    raise TypeError(f"State checkpoints a distributed store (kvcore.create('dist_sync'), 'dist_async', "
                    f"'dist_device_sync') or a 'dist' shared model, got {type(store).__name__}")
