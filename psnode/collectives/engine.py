"""The collectives of one worker: tags, the ops in flight, early messages, sends and failure.

``Engine`` belongs to a worker node (``WorkerNode.collectives``) and shares its connection: the
same transport, address book, scheduler link and failure latch, so registration, heartbeats and
the news of a dead node come from what every node has. The worker gives it every ``COLL`` message
(``on_message``, on the thread that receives for the node).

**Order.** Every collective has a tag, ``(key id, version)``: the version counts the collectives
of that key this worker started before. Messages carry the tag, so workers may start collectives
in different orders (prioritised asynchronous pushes do): a message for a collective this worker
has not started yet waits in the early buffer (bounded: ``EARLY_BYTES``, ``EARLY_MESSAGES``) until
it starts. Collectives of one key run one at a time on each worker, in call order. Workers must
still run the same collectives: one that never comes is reported by a stall warning
(``PSLAUNCH_STALL_WARN``) that names the tag and the workers it waits for (Horovod's stall check), and
ends when a worker leaves or dies.

**Failure.** A dead or stopped worker is announced by the scheduler (heartbeats): every op in
flight fails with that ``PeerDiedError``, and so does every later one. A worker that finished the
job while an op still waits for it fails that op naming it (after ``watch.LEFT_GRACE`` seconds,
for its last messages to arrive). Workers that disagree on a collective's shape or dtype all raise
``MismatchError``; a malformed message fails the op it names on every worker (``ERROR``
messages), never leaves it waiting. A message that names no op is counted and dropped.

**Threads.** Ops start on the calling thread and advance on the receiving thread. The
``watch.Watcher``'s thread (started with the first op) completes ops whose zero-copy sends are
still leaving, fails ops that wait for a worker that left, and warns about stalls. ``_lock``
guards the tables; each op has its own; the watcher has its own.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

from psnode import devices
from psnode.errors import (
    ClosedError,
    MismatchError,
    NodeTimeoutError,
    PeerDiedError,
    ProtocolError,
    PSNodeError,
    TransportError,
)
from psnode.log import logger
from psnode.node.futures import chain, is_done, set_error, set_result, when_all_done
from psnode.node.membership import PeerInfo, endpoint_of

from . import wire
from .base import Op, Tag, Topology, algorithm, choose
from .flush import NOTHING, Flush
from .lane_path import LanePath
from .tags import Label, describe, error_flags, key_id_of, told_error
from .watch import Watcher
from .wire import Desc, Kind, Record

__all__ = ["Engine", "key_id_of", "EARLY_BYTES", "EARLY_MESSAGES"]

EARLY_BYTES = 1 << 30  # data held for collectives not started here yet, at most
EARLY_MESSAGES = 100_000
_TOLD = 1024  # errors kept for ops not started here yet


class Engine:
    """One worker's collectives (see the module docstring).

    ``conn`` is the worker's ``node.Connection``; ``topology`` is built from the address book at
    the first collective unless given (tests describe several hosts inside one process that way).
    """

    def __init__(self, conn: Any, topology: Topology | None = None) -> None:
        self.conn = conn
        #: blocks until the book holds every worker (a job with servers sends only the servers at
        #: registration); the worker node sets it to ask the scheduler and wait with liveness checks
        self.await_workers: Callable[[], None] | None = None
        self._topology = topology
        self._lock = threading.Lock()
        self.ops: dict[Tag, Op] = {}
        self.early: dict[Tag, list[tuple[int, Record, Any]]] = {}
        self.early_bytes = 0
        self.early_messages = 0
        self.told: OrderedDict[Tag, tuple[str, int]] = OrderedDict()
        self.versions: dict[int, int] = {}
        # counted for the heartbeats' report (psnode.node.stats), under _lock where the version is taken:
        self.summed_bytes = 0  # bytes of the values this worker's collectives took part with
        self.rounds = 0  # collectives of its most used key
        self.last: dict[int, concurrent.futures.Future] = {}
        self.failure: BaseException | None = None
        self.malformed = 0
        self.malformed_reason = ""  # the last dropped message's, for logs and tests
        self._connected: set[int] = set()
        self._left: set[int] = set()  # workers that finished the job
        self._flush: Flush | None = None  # this worker's flush as it finishes (``flush``)
        self.watcher = Watcher(self)
        self._shared: Any = None
        self._gpu: Any = None
        self._choice: dict[Desc, Any] = {}  # the algorithm chosen for each value's description
        lanes = getattr(conn, "lanes", None)
        self.lane_path = LanePath(self, lanes) if lanes is not None else None  # big segments over plain TCP
        if self.lane_path is not None:
            self.lane_path.start()

    # ---- facts -----------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self.conn.members.rank

    @property
    def size(self) -> int:
        """Workers in the job (from the contract: in a job with servers the workers' addresses come
        only on the first collective, after its arguments were checked against this)."""
        return self.conn.env.num_workers

    @property
    def topology(self) -> Topology:
        """Where the workers run (built from the address book on first use)."""
        if self._topology is None:
            workers = self.conn.members.workers
            shm = self.conn.env.same_host == "shm" and all(w.shm_probe for w in workers)
            self._topology = Topology.of(self.rank, [w.fingerprint for w in workers], shm)
        return self._topology

    @property
    def shared(self) -> Any:
        """This worker's shared-memory regions and those of its host's workers it mapped (``local``)."""
        if self._shared is None:
            from .local import SharedRegions

            self._shared = SharedRegions(self.conn.members.workers, self.conn.env.job_id)
        return self._shared

    def describe_worker(self, rank: int) -> str:
        """``worker 1 on 10.0.0.2:4567``."""
        workers = self.conn.members.workers
        return workers[rank].describe() if 0 <= rank < len(workers) else f"worker {rank}"

    # ---- the collectives ---------------------------------------------------------------------------
    def allreduce(self, key: Any, array: Any, out: Any = None, label: str | None = None,
                  algorithm_name: str | None = None, future: Any = None, after: Sequence[Any] = ()) -> Any:
        """Sum ``array`` over every worker into ``out`` (``array`` itself when None); returns a future at once.

        ``key`` (a str, int, bytes or tuple of them) names the collective on every worker; its
        version is counted here. ``array`` must not change, and ``out`` must stay untouched, until
        the future is done (C-contiguous arrays are used in place; others are copied first). A CuPy
        array is summed by ``nccl.GpuCollectives``. ``algorithm_name`` picks an algorithm
        (``base.algorithm_names``); by default ``base.choose`` does. ``future``: a future to complete
        instead of a new one; ``after``: futures that must be done before this one starts (the
        previous collective of ``key`` always is).

        Raises:
            TypeError: a dtype collectives do not sum. ValueError: ``out`` of another shape or dtype,
            an unknown algorithm. PSNodeError: the worker failed or was closed.
        """
        if type(array) is not np.ndarray and devices.device_of(array).is_gpu:
            return self.gpu.allreduce(key, array, out, label, future, after)
        desc = describe(array)  # refuses an unsupported dtype here, on the caller's thread
        if out is not None and (out.shape != array.shape or out.dtype != desc.dtype):
            raise ValueError(f"allreduce of {desc} into an out of {np.dtype(out.dtype).name} of shape {tuple(out.shape)}")
        target = array if out is None else out
        usable = target.flags.c_contiguous and target.flags.writeable
        buf = target.reshape(-1) if usable else np.empty(desc.total, desc.dtype)
        if not (usable and target is array):
            np.copyto(buf.reshape(desc.shape), array)
        if algorithm_name is None:
            factory = self._choice.get(desc)
            if factory is None:
                factory = self._choice[desc] = algorithm(choose(desc.nbytes, self.topology))
        else:
            factory = algorithm(algorithm_name)
        if usable:
            return self._submit(key, lambda tag: factory(self, tag, desc, label or Label("allreduce", key), buf),
                                future, after)
        # the caller's future completes only once the sum was copied back into its array
        inner = self._submit(key, lambda tag: factory(self, tag, desc, label or Label("allreduce", key), buf),
                             None, after)
        return chain(inner, future if future is not None else concurrent.futures.Future(),
                     lambda: np.copyto(target, buf.reshape(desc.shape)))

    def broadcast(self, key: Any, array: np.ndarray, root: int = 0, label: str | None = None, future: Any = None,
                  after: Sequence[Any] = ()) -> Any:
        """Copy worker ``root``'s ``array`` into every worker's ``array`` (C-contiguous, writable); at once."""
        from .gather import Broadcast

        desc = describe(array)
        if not (array.flags.c_contiguous and array.flags.writeable):
            raise ValueError("broadcast needs a C-contiguous, writable array")
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast from worker {root}, but the job has workers 0..{self.size - 1}")
        return self._submit(key, lambda tag: Broadcast(self, tag, desc, label or Label("broadcast", key),
                                                       array.reshape(-1), root), future, after)

    def allgather(self, key: Any, array: np.ndarray, out: np.ndarray, label: str | None = None,
                  future: Any = None) -> Any:
        """Gather every worker's ``array`` into ``out[rank]`` (``out``: shape ``(workers,) + array.shape``)."""
        from .gather import Allgather

        desc = describe(array)
        if tuple(out.shape) != (self.size,) + desc.shape or np.dtype(out.dtype) != desc.dtype or not out.flags.c_contiguous:
            raise ValueError(f"allgather of {desc} over {self.size} workers needs a C-contiguous out of shape "
                             f"{(self.size,) + desc.shape}, got {np.dtype(out.dtype).name} of shape {tuple(out.shape)}")
        out[self.rank] = array
        flat = out.reshape(self.size, -1)
        return self._submit(key, lambda tag: Allgather(self, tag, desc, label or Label("allgather", key), flat),
                            future)

    # ---- ops in flight ---------------------------------------------------------------------------------
    def _submit(self, key: Any, make: Callable[[Tag], Op], future: Any = None, after: Sequence[Any] = ()) -> Any:
        """Give the op the key's next version and start it once the key's previous op (and ``after``) is done."""
        if self.failure is not None:
            raise self.failure
        if not self.conn.members.complete and self.await_workers is not None:
            self.await_workers()  # a job with servers: the workers' addresses come on first use
        key_id = key_id_of(key)
        with self._lock:
            version = self.versions.get(key_id, 0)
            self.versions[key_id] = version + 1
            op = make((key_id, version))
            self.summed_bytes += op.desc.nbytes
            if version >= self.rounds:
                self.rounds = version + 1
            op.future = future if future is not None else concurrent.futures.Future()
            previous = self.last.get(key_id)
            self.last[key_id] = op.future  # one entry per key: the latest op's future
        if previous is not None and is_done(previous):
            previous = None
        waits = [previous] if previous is not None else []
        if after:
            waits += [f for f in after if not is_done(f)]
        if not waits:
            self._start(op)
            return op.future
        when_all_done(waits, lambda _errors: self._start(op))  # the ops before it fail on their own
        return op.future

    def next_tag(self, key: Any) -> Tag:
        """``key``'s tag for its next collective on this worker: its id and how many came before."""
        key_id = key_id_of(key)
        with self._lock:
            version = self.versions.get(key_id, 0)
            self.versions[key_id] = version + 1
        return key_id, version

    def _start(self, op: Op) -> None:
        if not self.watcher.started:
            self.watcher.start()
        with op.lock:
            with self._lock:
                failure = self.failure
                told = self.told.pop(op.tag, None) if self.told else None
                early = self.early.pop(op.tag, None) if self.early else None
                if early:
                    for _, _, data in early:
                        self.early_bytes -= 0 if data is None else len(data)
                    self.early_messages -= len(early)
                if failure is None and told is None:
                    self.ops[op.tag] = op
            if failure is not None:
                set_error(op.future, failure)
                return
            if told is not None:
                op.finished = True
                set_error(op.future, told_error(*told))
                return
            try:
                op.start()
                for src, record, data in early or ():
                    if op.finished:
                        break
                    self._feed(op, src, record, data)
            except PSNodeError as exc:
                self.abort(op, exc, tell=not isinstance(exc, (ClosedError, PeerDiedError)))
            except Exception as exc:  # a bug must fail the op, not leave every worker waiting
                self.abort(op, PSNodeError(f"{op.describe()} failed on worker {self.rank}: {type(exc).__name__}: {exc}"))
            self._drop_if_finished(op)

    def on_message(self, peer: PeerInfo, key_id: int, version: int, frames: list) -> None:
        """Take one ``COLL`` message of worker ``peer`` from the transport (the receiving thread)."""
        tag = (key_id, version)
        if peer.role != "worker" or not 0 <= peer.rank < len(self.conn.members.workers):
            self._malformed(peer, f"a collective message from {peer.describe()}, not a worker of the job")
            return
        try:
            record, data = wire.unpack(frames)
        except ProtocolError as exc:
            self.refuse(peer, tag, str(exc))
            return
        self.take(peer, tag, record, data)

    def refuse(self, peer: PeerInfo, tag: Tag | None, why: str) -> None:
        """A malformed message of ``peer``: fail the op it names on every worker, else count it."""
        with self._lock:
            op = self.ops.get(tag) if tag is not None else None
        if op is None:
            self._malformed(peer, why)
        else:
            self.abort(op, ProtocolError(f"worker {peer.rank} sent a malformed message for {op.describe()}: {why}"))

    def destination(self, src: int, tag: Tag, record: Record) -> np.ndarray | None:
        """Where the op ``tag`` wants the data of ``record`` from worker ``src`` read (``Op.destination``), or None."""
        with self._lock:
            op = self.ops.get(tag)
        if op is None:
            return None
        with op.lock:
            return None if op.finished else op.destination(src, record)

    def take(self, peer: PeerInfo, tag: Tag, record: Record, data: Any) -> bool:
        """Take one checked message of worker ``peer`` (from the transport or a lane); True when it
        finished its op."""
        src = peer.rank
        if record.kind == Kind.GO:
            self.gpu.on_go(src, tag, record)
            return False
        if record.kind in (Kind.FLUSH, Kind.FLUSHED):
            self._flush_message(src, record.kind)
            return False
        with self._lock:
            op = self.ops.get(tag)
            if op is None:
                self._keep_early(tag, src, record, data)
                return False
        with op.lock:
            if op.finished:
                self._malformed(peer, f"a message for {op.describe()}, which expects no more")
                return False
            try:
                self._feed(op, src, record, data)
            except PSNodeError as exc:  # a death is announced to every worker by the scheduler
                self.abort(op, exc, tell=not isinstance(exc, PeerDiedError))
            except Exception as exc:
                self.abort(op, PSNodeError(f"{op.describe()} failed on worker {self.rank}: {type(exc).__name__}: {exc}"))
        self._drop_if_finished(op)
        return op.finished

    def _feed(self, op: Op, src: int, record: Record, data: Any) -> None:
        if record.kind == Kind.ERROR:
            error = told_error(bytes(data).decode(errors="replace"), record.flags)
            self.abort(op, error, tell=False)
            return
        desc = op.desc
        why = None if (record.dtype == desc.code and record.total == desc.total and record.shape == desc.crc) \
            else desc.mismatch(record)
        if why is not None:
            self.abort(op, MismatchError(
                f"{op.describe()}: worker {src} passed {why}, but worker {self.rank} passed {op.desc}; "
                "every worker must pass the same shape and dtype"))
            return
        op.on_message(src, record, data)

    def _keep_early(self, tag: Tag, src: int, record: Record, data: Any) -> None:
        """Hold a message for an op not started here yet (``_lock`` held)."""
        if record.kind == Kind.ERROR:
            self.told[tag] = (bytes(data).decode(errors="replace"), record.flags)
            while len(self.told) > _TOLD:
                self.told.popitem(last=False)
            return
        size = 0 if data is None else len(data)
        if self.early_bytes + size > EARLY_BYTES or self.early_messages >= EARLY_MESSAGES:
            error = PSNodeError(
                f"worker {src} sent more for collectives worker {self.rank} has not started than it holds "
                f"({self.early_messages} messages, {self.early_bytes} bytes; at most {EARLY_MESSAGES} and "
                f"{EARLY_BYTES}): the workers run different collectives")
            threading.Thread(target=self.conn.failure.fail, args=(error,), daemon=True).start()
            return
        self.early.setdefault(tag, []).append((src, record, data))
        self.early_bytes += size
        self.early_messages += 1

    def _drop_if_finished(self, op: Op) -> None:
        if op.finished:
            with self._lock:
                if self.ops.get(op.tag) is op:
                    del self.ops[op.tag]

    def _malformed(self, peer: PeerInfo, why: str) -> None:
        self.malformed += 1
        self.malformed_reason = why
        logger.info("worker %d dropped a collective message from %s (%d so far): %s", self.rank, peer.describe(),
                    self.malformed, why)

    # ---- sending and completing ---------------------------------------------------------------------
    def send(self, rank: int, frames: list, track: bool, block: bool = True) -> Any:
        """Send ``frames`` to worker ``rank`` (connecting on first use); a tracker when ``track``.

        Raises:
            TransportError, ClosedError: as the transport does (``WouldBlock``: a full queue, ``block=False``).
        """
        peer = self.conn.members.workers[rank]
        if track and self.lane_path is not None:
            tracker = self.lane_path.send(peer, frames)
            if tracker is not None:  # its op completes once it was written: no flush needed
                return tracker
        if rank not in self._connected:
            self._connect(peer)
            self._connected.add(rank)
        return self.conn.transport.send(peer.uid.encode(), frames, track=track, block=block)

    def _connect(self, peer: PeerInfo) -> None:
        """Connect the transport to ``peer`` (nothing when it is already)."""
        transport = self.conn.transport
        transport.connect(peer.uid.encode(), endpoint_of(peer, transport, self.conn.me.fingerprint,
                                                         self.conn.env.same_host))

    def send_on_transport(self, peer: PeerInfo, frames: list) -> None:
        """Send ``frames`` to the worker ``peer`` (the process the lane was opened to, not whoever holds
        its rank now) through the node's transport, copied: a lane gave them back.

        Raises:
            TransportError, ClosedError: as the transport does.
        """
        self._connect(peer)
        self.conn.transport.send(peer.uid.encode(), frames, track=False)

    def complete(self, op: Op) -> None:
        """Complete ``op``'s future now, or once its tracked sends have left (the helper thread)."""
        if op.trackers:
            op.trackers = [t for t in op.trackers if not t.done]
        if not op.trackers:
            set_result(op.future)
            return
        self.watcher.complete_when_sent(op)

    def finish(self, op: Op) -> None:
        """Complete ``op``'s future: its tracked sends have left (the watcher)."""
        set_result(op.future)

    def ops_snapshot(self) -> list[Op]:
        """The ops in flight now."""
        with self._lock:
            return list(self.ops.values())

    def abort(self, op: Op, error: PSNodeError, tell: bool = True) -> None:
        """Fail ``op`` here and, with ``tell``, on every other worker."""
        op.finished = True
        with self._lock:
            if self.ops.get(op.tag) is op:
                del self.ops[op.tag]
        if tell:
            text = str(error).encode()[:wire.MAX_ERROR]
            frames = wire.pack(op.tag[0], op.tag[1], Kind.ERROR, op.desc, flags=error_flags(error))
            for rank in range(self.size):
                if rank != self.rank:
                    try:
                        self.send(rank, frames + [text], False)
                    except PSNodeError:
                        pass
        set_error(op.future, error)

    # ---- failure and leaving ------------------------------------------------------------------------
    def fail_all(self, error: BaseException) -> None:
        """The worker failed: fail every op in flight and every later one with ``error``."""
        with self._lock:
            self.failure = error
            ops = list(self.ops.values())
            self.ops.clear()
            flush = self._flush
        if flush is not None:  # a failed worker closes at once
            flush.end()
        ops += self.watcher.take_all()
        for op in ops:
            op.finished = True
            set_error(op.future, error)
        if self._gpu is not None:
            self._gpu.fail_all(error)
        self.watcher.stop()

    def peer_left(self, rank: int, description: str) -> None:
        """Worker ``rank`` finished the job: ops still waiting for it fail soon (``watch.LEFT_GRACE``)."""
        with self._lock:
            self._left.add(rank)
            flush = self._flush
        if flush is not None:
            flush.answered(rank)
        self.watcher.peer_left(rank, description)

    def flush(self) -> "Flush":
        """Ask every worker this one sent collective messages to, and that has not finished, to say
        once it read them all (``FLUSH``, answered ``FLUSHED``): what a worker's last collectives
        sent may still wait in its queues behind a peer that reads slowly, and closing the
        connections would drop it. The caller waits on ``Flush.future`` and calls ``Flush.retry``
        meanwhile (a queue that was full takes the question later)."""
        with self._lock:
            self._flush = flush = Flush(self, self._connected - self._left)
        flush.retry()
        return flush

    def _flush_message(self, src: int, kind: Kind) -> None:
        """A ``FLUSH`` (answered at once: every message of ``src`` before it was read) or ``FLUSHED``."""
        if kind == Kind.FLUSHED:
            flush = self._flush
            if flush is not None:
                flush.answered(src)
            return
        try:
            self.send(src, wire.pack(0, 0, Kind.FLUSHED, NOTHING), False, block=False)
        except TransportError:  # its queue is full or it is gone: it stops waiting by itself
            pass

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def wait_idle(self, limit: float) -> None:
        """Wait until no collective of this worker is in flight (the network thread advances them).

        Raises:
            NodeTimeoutError: some still ran after ``limit`` seconds (naming them).
        """
        deadline = time.monotonic() + limit
        while True:
            pending = [op for op in self.ops_snapshot() + self.watcher.pending() if not op.future.done()]
            if not pending or self.failure is not None:
                return
            if time.monotonic() > deadline:
                raise NodeTimeoutError(f"worker {self.rank}: {len(pending)} collectives still ran after {limit:g} s "
                                       f"({', '.join(op.describe() for op in pending[:3])})")
            concurrent.futures.wait([op.future for op in pending], timeout=0.1)

    def close(self) -> None:
        """Stop the watcher and the GPU launcher (the worker is closing)."""
        self.watcher.stop()
        if self._gpu is not None:
            self._gpu.close()

    # ---- GPUs ------------------------------------------------------------------------------------------
    @property
    def gpu(self) -> Any:
        """This worker's NCCL collectives (``nccl.GpuCollectives``), made on first use."""
        if self._gpu is None:
            from .nccl import GpuCollectives

            with self._lock:
                if self._gpu is None:
                    self._gpu = GpuCollectives(self)
        return self._gpu
