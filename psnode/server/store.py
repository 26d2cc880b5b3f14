"""A server's keys: the stored shards, their rounds, and the updater.

Each key part a server holds is a ``Shard``: the stored value (flat), and a ``rounds.Round`` that
merges its pushes (``dist_sync``: one push of every worker per round; ``dist_async``: every push on
its own) and holds the pulls that must wait for a round. When a round is full the shard applies it:
the user's updater runs once (``updater(key, merged, stored)``), or without one the sum replaces the
stored value.

Values sent to workers are never changed under ZeroMQ's feet: when a reply may still be reading a
stored array, the next update writes a fresh copy instead (copy on write).

*Replay* (``dist_sync`` under ``PSLAUNCH_RESTART_SCOPE=worker``): a worker that died is replaced in
place and redoes its steps since its last mark (``psnode.server.marks``). Its rounds are versioned
(``rounds``): a push its predecessor made already is dropped, and a pull is answered with the value
after its round, from ``Shard.history`` when later rounds closed meanwhile. An update keeps the value
it replaces while a replacement may ask for it (at or above the marks' floor).

Everything here runs on the server's one thread; nothing is locked. Refusals raise
``RequestRefused``, whose message goes back to the worker that asked. The store also counts what
heartbeats report (``held_bytes``, ``pushed_bytes``, ``updates``: plain integers).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable

import numpy as np

from psnode.errors import ProtocolError, RequestRefused
from psnode.node.protocol import pack_counts
from psnode.node.values import MAX_DIMS, VALUE_DTYPES, dtype_of, is_int, is_shape
from psnode.server.marks import Mark, Marks, marks_reply
from psnode.server.rounds import Round, run_updater
from psnode.server.shard_memory import HostMemory

__all__ = ["Shard", "ServerStore", "Answer", "PastValue", "init_value"]

def init_value(spec: Any, data_frames: list) -> tuple[int, Hashable, np.ndarray, int]:
    """``(key id, user key, value, row size)`` of one INIT spec (a JSON object from the network),
    every field checked.

    Raises:
        ProtocolError: a field missing, of the wrong type or out of range (the message names it).
    """
    if not isinstance(spec, dict):
        raise ProtocolError(f"an INIT spec is a {type(spec).__name__}, not an object")
    key, user_key, shape = spec.get("key"), spec.get("user_key"), spec.get("shape")
    frame, offset, row_size = spec.get("frame"), spec.get("offset", 0), spec.get("row_size", 1)
    if not is_int(key) or not 0 <= key < 1 << 64:
        raise ProtocolError(f"INIT key id {key!r} is not a 64-bit unsigned integer")
    if not (isinstance(user_key, str) or is_int(user_key)):
        raise ProtocolError(f"INIT of key id {key:#x}: the key {user_key!r} is neither int nor str")
    where = f"INIT of key {user_key!r}"
    if not is_shape(shape):
        raise ProtocolError(f"{where}: shape {shape!r} is not a list of at most {MAX_DIMS} sizes")
    dtype = dtype_of(spec.get("dtype"))
    if dtype is None:
        raise ProtocolError(f"{where}: dtype {spec.get('dtype')!r} is not a dtype")
    if dtype not in VALUE_DTYPES:
        known = ", ".join(sorted(str(d) for d in VALUE_DTYPES))
        raise RequestRefused(f"{where}: dtype {dtype} is not one a key may have ({known})")
    if not is_int(frame) or not 0 <= frame < len(data_frames):
        raise ProtocolError(f"{where}: data frame {frame!r} is not one of the message's {len(data_frames)}")
    if not is_int(offset) or offset < 0 or not is_int(row_size) or row_size < 1:
        raise ProtocolError(f"{where}: offset {offset!r} or row size {row_size!r} is out of range")
    count = 1
    for n in shape:
        count *= n
    buffer = data_frames[frame].buffer
    if offset + count * dtype.itemsize > len(buffer):
        raise ProtocolError(f"{where}: {count} values of {dtype} reach past its data frame of {len(buffer)} bytes")
    value = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)
    return key, user_key, value, row_size


Answer = Callable[[int, int, int, "Shard"], None]
"""``answer(worker, req_id, index, shard)``: reply to part ``index`` of pull ``req_id`` with the shard's value."""


class Shard:
    """One key part held by this server: its stored value, its round, and what replies still read."""

    __slots__ = ("key_id", "user_key", "shape", "dtype", "nbytes", "row_size", "sync", "stored", "round",
                 "trackers", "error", "group", "history")

    def __init__(self, key_id: int, user_key: Hashable, shape: tuple, stored: Any, round_: Round, sync: bool,
                 row_size: int) -> None:
        self.key_id = key_id
        self.user_key = user_key
        self.shape = shape  # the key's shape (a split key's parts are flat; the updater gets views)
        self.dtype = np.dtype(stored.dtype)
        self.nbytes = int(stored.nbytes)
        self.row_size = row_size
        self.sync = sync
        self.stored = stored
        self.round = round_
        self.trackers: list = []  # sends that may still read ``stored``
        self.error: str | None = None  # why the last round's updater failed, for the key's pullers
        self.group: Any = None  # the server_groups.Group handling this key, if any
        self.history: dict[int, Any] = {}  # replay: round number -> the value after it (older than ``stored``)

    @property
    def size(self) -> int:
        """Elements held."""
        return self.nbytes // self.dtype.itemsize


class PastValue:
    """What a pull of an earlier round is answered with: a shard's value after round ``version``,
    kept in its history (``replies`` reads the same fields as of a ``Shard``; nothing writes it)."""

    __slots__ = ("key_id", "user_key", "nbytes", "stored", "error", "trackers")

    def __init__(self, shard: Shard, stored: Any) -> None:
        self.key_id = shard.key_id
        self.user_key = shard.user_key
        self.nbytes = shard.nbytes
        self.stored = stored
        self.error = None
        self.trackers: list = []


class ServerStore:
    """Every shard of one server, and how rounds are applied to them (see the module docstring)."""

    def __init__(self, num_workers: int, memory: Any = None) -> None:
        self.num_workers = num_workers
        self.memory = memory or HostMemory()
        self.shards: dict[int, Shard] = {}
        self.updater: Any = None
        self.finished: dict[int, str] = {}  # workers that left the job: rank -> description
        self.left: set[int] = set()  # an elastic job's workers that left it at a step boundary
        self.held_bytes = 0  # bytes of the stored values
        self.pushed_bytes = 0  # bytes of the pushes taken (decoded)
        self.updates = 0  # rounds applied, one per key part (a group's round counts each of its keys)
        self.timeline: Any = None  # PSLAUNCH_TIMELINE (set with ``trace``)
        # From a checkpoint (``server_checkpoint``): values of keys not initialised yet (key id ->
        # (user key, flat value)), the key ids whose value came from one, and optimizer state no
        # updater has taken yet.
        self.pending: dict[int, tuple[Hashable, np.ndarray]] = {}
        self.restored: set[int] = set()
        self.restored_state: dict | None = None
        self.replay = False  # dist_sync keys get versioned rounds (PSLAUNCH_RESTART_SCOPE=worker)
        # PSLAUNCH_SERVER_REPLICAS: every value is also held by replicas, fed round for round by the
        # workers; only dist_sync keys (versioned) can be, and each key keeps its value before the
        # last round, for a pull a lost server left unanswered and its replica answers a round later
        self.replicated = False
        self.marks = Marks()  # every worker's newest marks (replay)
        self.kept_bytes = 0  # bytes of values kept for replay (``Shard.history``)

    def trace(self, timeline: Any) -> None:
        """Record each push's merge and each round's update as timeline events (``psnode.node.timeline``):
        the traced methods replace ``push`` and ``_apply`` on this store only, so a store without a
        timeline runs the plain ones."""
        self.timeline = timeline
        self.push = self._traced_push  # type: ignore[method-assign]
        self._apply = self._traced_apply  # type: ignore[method-assign]

    def _traced_push(self, shard: "Shard", worker: int, data: Any, answer: "Answer", borrowed: bool = False,
                     seq: int = 0) -> None:
        start = time.monotonic_ns()
        try:
            ServerStore.push(self, shard, worker, data, answer, borrowed, seq)
        finally:
            self.timeline.add("merge", shard.user_key, start, time.monotonic_ns())

    def _traced_apply(self, shard: "Shard", full: Round) -> None:
        start = time.monotonic_ns()
        try:
            ServerStore._apply(self, shard, full)
        finally:
            self.timeline.add("update", shard.user_key, start, time.monotonic_ns())

    # ---- init / updater ------------------------------------------------------------------
    def holds_alike(self, key_id: int, user_key: Hashable, value: np.ndarray) -> bool:
        """True when key part ``key_id`` is here already, of ``user_key`` with ``value``'s dtype and size
        (an init that a worker 0 replaced in place redoes); False when it is not here.

        Raises:
            RequestRefused: it is here, but of another key, dtype or size.
        """
        shard = self.shards.get(key_id)
        if shard is None:
            return False
        if shard.user_key != user_key or shard.dtype != value.dtype or shard.size != value.size:
            raise RequestRefused(f"key {user_key!r} is initialised again with {value.size} values of {value.dtype}, "
                                 f"but this server holds {shard.size} values of {shard.dtype} of key {shard.user_key!r}")
        return True

    def init(self, key_id: int, user_key: Hashable, value: np.ndarray, sync: bool, row_size: int) -> None:
        """Create a shard from its initial value.

        Raises:
            RequestRefused: the key is already initialised.
        """
        if key_id in self.shards:
            raise RequestRefused(f"key {user_key!r} is already initialised on this server")
        if self.replicated and not sync:
            raise RequestRefused(f"key {user_key!r} of a dist_async store cannot be replicated: replicas "
                                 "(--server-replicas, PSLAUNCH_SERVER_REPLICAS) hold dist_sync and dist_device_sync keys")
        restored = self.pending.get(key_id)
        if restored is not None:  # the checkpoint's value wins over the initial one
            if restored[0] != user_key or restored[1].dtype != value.dtype or restored[1].size != value.size:
                raise RequestRefused(
                    f"key {user_key!r} is initialised with {value.size} values of {value.dtype} (shape "
                    f"{tuple(value.shape)}), but the checkpoint restored {restored[1].size} values of "
                    f"{restored[1].dtype} of key {restored[0]!r} for it")
            value = restored[1].reshape(value.shape)
            del self.pending[key_id]
            self.restored.add(key_id)
        memory = self.memory
        stored = memory.place(value.reshape(-1))  # kept flat; the updater gets ``shape`` views
        quorum = self.num_workers - len(self.left) if sync else 1
        round_ = Round(self.num_workers, quorum, memory, memory.empty_like(stored))
        round_.versioned = self.replay and sync
        shard = Shard(key_id, user_key, tuple(value.shape), stored, round_, sync, row_size)
        self.shards[key_id] = shard
        self.held_bytes += shard.nbytes
        self._announce(shard)

    def _announce(self, shard: Shard) -> None:
        """Tell the updater of a key it holds now: ``init_key``, or ``restore_key`` for a restored one
        (which must keep its value)."""
        name = "restore_key" if shard.key_id in self.restored else "init_key"
        announce = getattr(self.updater, name, None)
        if announce is not None:
            with self.memory.context():
                announce(shard.user_key, shard.stored.reshape(shard.shape))

    def take_restored_state(self, state: dict | None) -> None:
        """Optimizer state from a checkpoint: loaded into the updater now if it can take it
        (``load_state_dict``), else kept for the updater that arrives next."""
        if state is None:
            return
        load = getattr(self.updater, "load_state_dict", None)
        if load is None:
            self.restored_state = state
            return
        self.restored_state = None
        try:
            with self.memory.context():
                load(state)
        except Exception as exc:  # the user's code
            raise RequestRefused(f"the updater's load_state_dict() raised {type(exc).__name__}: {exc}") from exc

    def set_updater(self, updater: Any) -> None:
        """Install ``updater(key, merged, stored)``; call its ``init_key`` (``restore_key``) for keys that
        already exist, and give it the restored optimizer state it can take.

        Raises:
            RequestRefused: ``updater`` is not callable.
        """
        if not callable(updater):
            raise RequestRefused(f"the updater must be callable, got {type(updater).__name__}")
        self.updater = updater
        for shard in self.shards.values():
            self._announce(shard)
        self.take_restored_state(self.restored_state)

    def worker_rejoined(self, rank: int) -> None:
        """Worker ``rank`` was started again. In ``dist_async`` it counts its pushes from zero: its
        predecessor's were applied on arrival (every round is one push), so none is pending. A
        versioned (``dist_sync``) round keeps its predecessor's count: the replacement counts on from
        a mark, and the pushes it redoes are dropped. Pulls its predecessor left waiting go."""
        self.finished.pop(rank, None)
        for shard in self.shards.values():
            if not shard.round.versioned:
                shard.round.received[rank] = 0
            shard.round.waiting = [w for w in shard.round.waiting if w[0] != rank]

    def worker_left(self, rank: int, answer: Answer) -> None:
        """An elastic job's worker ``rank`` left after its last push (``Round.leave``): rounds close
        without it from the open one on; the pulls that releases go to ``answer``."""
        self.left.add(rank)
        self.marks.forget(rank)
        for shard in self.shards.values():
            round_ = shard.round
            if shard.sync and round_.leave(rank):
                round_.close(self._apply, shard)
            if round_.waiting:
                for waiter, item in round_.release():
                    answer(waiter, item[0], item[1], shard)

    def touched(self) -> int:
        """The latest round a push reached on any ``dist_sync`` key here (0: none yet)."""
        return max((shard.round.touched() for shard in self.shards.values() if shard.sync), default=0)

    def unsettled(self) -> set[int]:
        """Ranks that left the job with a push still in an open round (not to be given to a joiner yet)."""
        return {rank for shard in self.shards.values() for rank in shard.round.leaving}

    def worker_joined(self, rank: int, start: int) -> None:
        """Worker ``rank`` joined the job (``psnode.server.joins``): each ``dist_sync`` key counts it from
        round ``start``, a key pushed less often than the others (more than a round behind the
        latest, ``start - 2``) from its next round no push reached; it counts its pushes from zero."""
        self.left.discard(rank)
        self.finished.pop(rank, None)
        for shard in self.shards.values():
            round_ = shard.round
            if not shard.sync:
                round_.received[rank] = 0
                continue
            touched = round_.touched()
            round_.join(rank, start if touched >= start - 3 else touched + 1)

    def add_mark(self, worker: int, mark: Mark) -> None:
        """Keep ``worker``'s newest mark; values below the new floor are let go at their next update."""
        self.marks.add(worker, mark)

    def worker_marks(self, worker: int) -> tuple[list[dict], list[bytes]]:
        """``worker``'s kept marks for a ``MARKS_REPLY`` (``marks.marks_reply``), and last the pushes of
        each versioned key part this server took from it (``MARK_COUNT`` records): a replacement's
        first push past them is the first its predecessor had not sent (``CAUGHT-UP``)."""
        shards = self.shards
        taken = {key_id: shard.round.received[worker] for key_id, shard in shards.items()
                 if shard.round.versioned and shard.round.received[worker]}

        def received(key_id: int) -> int:
            shard = shards.get(key_id)
            return shard.round.received[worker] if shard is not None else 0

        def versioned(key_id: int) -> bool:
            shard = shards.get(key_id)
            return shard is not None and shard.round.versioned
        listed, frames = marks_reply(self.marks.of(worker), received, versioned)
        return listed, [*frames, pack_counts(taken)]

    def shard(self, key_id: int) -> Shard:
        """The shard of ``key_id``.

        Raises:
            RequestRefused: this server holds no such key.
        """
        shard = self.shards.get(key_id)
        if shard is None:
            raise RequestRefused(f"key id {key_id:#x} was never initialised on this server")
        return shard

    # ---- push ----------------------------------------------------------------------------
    def push(self, shard: Shard, worker: int, data: Any, answer: Answer, borrowed: bool = False, seq: int = 0) -> None:
        """Take one worker's (decoded) push of ``shard``, its number ``seq`` (from 1; 0: not given);
        pulls it releases go to ``answer``.

        ``borrowed``: ``data`` lives in the worker's shared memory, which it reuses once this
        message is acknowledged, so nothing may keep a reference to it.

        Raises:
            RequestRefused: dist_async without an updater.
        """
        round_ = shard.round
        if round_.versioned and round_.duplicate(worker, seq):  # a replacement redoing its predecessor's push
            return
        if not shard.sync and self.updater is None:
            shard.round.count_refused(worker)
            raise RequestRefused(
                f"dist_async needs an optimizer on the servers, but key {shard.user_key!r} was pushed before "
                "set_optimizer(); call kv.set_optimizer(...) before the first push"
            )
        self.pushed_bytes += shard.nbytes
        if round_.push(worker, data, borrowed):
            round_.close(self._apply, shard)
            if round_.waiting:
                for waiter, item in round_.release():
                    answer(waiter, item[0], item[1], self.value_after(shard, item[2]) if round_.versioned else shard)

    def wrong_size(self, shard: Shard, worker: int, nbytes: int) -> RequestRefused:
        """Refuse ``worker``'s push of ``nbytes`` (decoded) bytes to ``shard``: the error to send back.

        The push still counts as received (see ``Round.count_refused``).
        """
        shard.round.count_refused(worker)
        return RequestRefused(f"key {shard.user_key!r}: a push of {nbytes} bytes, but this server holds {shard.nbytes}")

    def _apply(self, shard: Shard, full: Round) -> None:
        self.updates += 1
        busy = bool(shard.trackers) and any(not t.done for t in shard.trackers)
        shard.trackers = []
        before = shard.stored
        kept = full.versioned and self._keep(shard, full.closed)
        busy = busy or kept  # the value after round ``closed`` stays as it is, in the history
        try:
            self._update(shard, full, busy)
        finally:
            if kept:
                shard.history[full.closed] = before
                self.kept_bytes += shard.nbytes

    def _keep(self, shard: Shard, version: int) -> bool:
        """Whether the value after round ``version`` must be kept as the next round replaces it: a
        replacement may pull it (at or above the marks' floor). Lets go of older kept values."""
        floor = self.marks.floor(shard.key_id, (w for w in range(self.num_workers) if w not in self.finished))
        if self.replicated:  # the value after the round that closes now stays: a replica's late pull
            floor = version if floor is None else min(floor, version)
        history = shard.history
        if history and (floor is None or min(history) < floor):
            for old in [v for v in history if floor is None or v < floor]:
                del history[old]
                self.kept_bytes -= shard.nbytes
        return floor is not None and version >= floor

    def value_after(self, shard: Shard, version: int) -> "Shard | PastValue":
        """What a pull of round ``version`` is answered with: the shard itself when that is its last
        round, else the value kept after that round.

        Raises:
            RequestRefused: that value was let go (no mark of the worker's reached back to it).
        """
        if version >= shard.round.closed:
            return shard
        past = shard.history.get(version)
        if past is None:
            kept = f"rounds {min(shard.history)}..{shard.round.closed}" if shard.history else f"round {shard.round.closed}"
            raise RequestRefused(
                f"key {shard.user_key!r}: a pull of round {version} cannot be answered exactly, this server keeps "
                f"{kept} only: a worker replaced in place resumes from its last mark (the scalars of "
                "kvcore.elastic.State, set after each step), and no mark reached back to that round")
        return PastValue(shard, past)

    def _update(self, shard: Shard, full: Round, busy: bool) -> None:
        memory = self.memory
        with memory.context():
            if self.updater is None:
                if full.first is not None:
                    if busy:  # a reply still reads the old array: write a new one
                        shard.stored = memory.empty_like(shard.stored)
                    memory.load(shard.stored, full.first)
                else:  # the merged sum becomes the value: swap buffers instead of copying
                    shard.stored = full.swap_merge(memory.empty_like(shard.stored) if busy else shard.stored)
                shard.error = None
                return
            if full.first is not None:
                memory.load(full.merge, full.first)
            if busy:
                shard.stored = memory.copy(shard.stored)
            shard.error = run_updater(self.updater, shard.user_key, full.merge.reshape(shard.shape),
                                      shard.stored.reshape(shard.shape))

    # ---- pull ----------------------------------------------------------------------------
    def pull(self, shard: Shard, worker: int, req_id: int, index: int, seq: int, answer: Answer) -> None:
        """Answer a pull now, or once the pushes it must include have been applied.

        Raises:
            RequestRefused: the pull waits for a round that a finished worker never pushed to.
        """
        round_ = shard.round
        if round_.ready_for(worker, seq):
            answer(worker, req_id, index, self.value_after(shard, seq) if round_.versioned else shard)
            return
        stuck = self.stuck(shard.user_key, round_)
        if stuck:
            raise RequestRefused(stuck)
        round_.wait(worker, seq, (req_id, index, seq))

    def stuck(self, key: Hashable, round_: Round) -> str | None:
        """Why the open round of ``key`` can never close (a finished worker did not push), or None."""
        gone = round_.stuck_on(self.finished)
        if not gone:
            return None
        return (f"the current round of key {key!r} can never close: {', '.join(gone)} finished without pushing "
                "it (every worker must push a key the same number of times in dist_sync)")

    def rows(self, shard: Shard, rows: np.ndarray) -> np.ndarray:
        """The stored rows ``rows`` (ids local to the shard) as a host array.

        Raises:
            RequestRefused: a row id outside the shard.
        """
        count = shard.stored.size // shard.row_size
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= count):
            raise RequestRefused(f"key {shard.user_key!r}: row ids outside 0..{count - 1} on this server")
        return self.memory.rows(shard.stored, shard.row_size, rows)
