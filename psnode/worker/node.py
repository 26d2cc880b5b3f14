"""A worker node: sends key parts to servers and completes futures when the replies arrive.

The worker's API speaks in *parts*: ``(server rank, key id, array)``. Which parts a user key becomes
is decided above (``kvcore.stores.sharding``). Every call returns at once with a
``concurrent.futures.Future`` (or completes the one it is given). How pushes and pulls become
messages is ``worker_data.DataPath``'s.

``WorkerNode`` is a façade over parts that each own their state:

- ``node.Connection``: the transport, the address book, the scheduler link, the receive loop;
- ``worker_requests.RequestTable``: requests in flight, push counts, replies written into outs;
- ``worker_outbox.Outbox``: the priority send queue and the push held for the next pull;
- ``worker_receiver.Receiver``: the network thread, and which thread receives;
- ``worker_data.DataPath``: push and pull as messages, and the shared-memory regions of big parts;
- ``collectives.Engine``: collectives with the other workers (allreduce without servers).

Sends are queued by priority (higher first, then in call order) and leave as soon as the connection
takes them. Correctness does not depend on the order: a pull tells the server how many pushes of the
key it must include.

Thread-safety: every method may be called from any thread. Callbacks added to the futures run on
whichever thread receives the reply and must be quick.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import pickle
import time
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import numpy as np

from psnode.collectives import Engine
from psnode.collectives.watch import LEFT_GRACE
from psnode.compression.codecs import RAW
from psnode.env import MARKER_CAUGHT_UP, MARKER_FINISHED, MARKER_LEFT, MARKER_RESUMED, NodeEnv
from psnode.errors import ClosedError, NodeTimeoutError, ProtocolError, PSNodeError
from psnode.log import logger
from psnode.node.bulk import batches
from psnode.node.connection import Connection
from psnode.node.membership import PeerInfo, endpoint_of
from psnode.node.protocol import (
    FLAG_REDO,
    FLAG_SYNC,
    MARK_COUNT,
    OWN_FRAME,
    PACK_LIMIT,
    Cmd,
    Group,
    pack_codec_params,
    pack_counts,
    pack_header,
    pack_json,
    unpack_json,
)
from psnode.node.stats import stderr_line, worker_report
from psnode.transport import same_host
from psnode.transport.base import Transport
from psnode.worker.data_path import DataPath
from psnode.worker.elastic import ElasticMembers
from psnode.worker.outbox import Outbox
from psnode.worker.process import watch
from psnode.worker.receiver import Receiver
from psnode.worker.requests import RequestTable

__all__ = ["WorkerNode"]

_COLL = int(Cmd.COLL)
_INVITE = int(Cmd.PUSH_INVITE)
_STALLED = int(Cmd.STALLED)
_JOINED = int(Cmd.WORKER_JOINED)
_LEAVING = int(Cmd.LEAVING)


class WorkerNode:
    """This process's worker node (see the module docstring). Start it with ``start()``."""

    def __init__(self, env: NodeEnv, transport: Transport | None = None) -> None:
        self.env = env
        self.conn = Connection(env, "worker", self._on_reply, transport,
                               on_worker_finished=lambda rank, node: self.collectives.peer_left(rank, node))
        self.collectives = Engine(self.conn)  # before registration: a peer's first message may come at once
        self.collectives.await_workers = self._await_workers
        self.requests = RequestTable(self.conn.failure)
        if self.conn.data_lanes is not None:  # a pull reply on a data lane is read straight into its out
            self.conn.data_lanes.find_out = self.requests.lane_target
        self.outbox = Outbox(self.conn.transport, self.conn.members, self.requests.complete)
        self.receiver = Receiver(self.conn, self.outbox)
        replicated = env.server_replicas > 0
        # with replicas (PSLAUNCH_SERVER_REPLICAS) a push goes to a server and its replicas as one
        # message each: no offers (a replica would never invite) and no shared memory (a copy per reader)
        self.data = DataPath(self.requests, self.outbox, same_host.WorkerRegions(env.job_id), env.num_workers,
                             0 if replicated else env.push_window)
        if replicated:
            self.requests.replicated = self.outbox.replicated = True
            self.outbox.on_sent = self.requests.note_sent
            self.conn.link.on_server_lost = lambda rank, lost, by: self.outbox.server_lost(rank, lost, by, self.requests)
            self.conn.link.on_replica = self._replica_joined
        self.closed = False
        self._mark_id = 0  # the id of this worker's last mark (``mark``)
        self._resumed: tuple[dict[str, Any] | None] | None = None  # a replacement's mark, once looked up
        self._resumed_barriers: dict[int, int] | None = None  # its barrier counts, until the script resumes
        # set-up barriers (``setup_barrier``): this process's calls so far by name, the numbers they
        # had, and those of its predecessor's mark (a replacement in place redoes them by number)
        self._setup_calls: dict[str, int] = {}
        self._setup_barriers: dict[str, int] = {}
        self._redone_setup: dict[str, int] = {}
        self._before_close: list[Callable[[], None]] = []  # what must reach the servers before this worker finishes
        # a marker line for pslaunch (``RESUMED``, ``CAUGHT-UP``); a seam for tests, nothing unsupervised
        self.tell_launcher: Callable[[str], None] = stderr_line if env.supervised else (lambda text: None)
        self.conn.failure.on_failure(self.requests.fail_all)
        self.conn.failure.on_failure(self.collectives.fail_all)
        self.timeline = self.receiver.timeline = self.conn.timeline  # PSLAUNCH_TIMELINE; kvcore names its calls too
        if env.stats_interval > 0:
            self.conn.link.report = lambda: worker_report(self)
        self.elastic = ElasticMembers(self)  # an elastic job's joiners (this one, or others it tells their scalars)
        self.conn.link.on_join = self.elastic.on_control
        self.conn.link.on_worker_lost = self.elastic.on_lost

    def _replica_joined(self, cmd: int, peer: PeerInfo) -> None:
        """A replica joined the running job (``REPLICA_JOINED``): connect to it, then mark the point of
        this worker's stream to its server from which it gets copies (``Outbox.replica_joined``)."""
        if cmd != Cmd.REPLICA_JOINED:
            return
        conn = self.conn
        conn.transport.connect(peer.uid.encode(), endpoint_of(peer, conn.transport, conn.me.fingerprint,
                                                              self.env.same_host))
        self.outbox.replica_joined(peer)

    # ---- life cycle ----------------------------------------------------------------------
    def start(self, network_thread: bool = True) -> "WorkerNode":
        """Register (blocking, see ``Connection.register``) and start the network thread.

        ``network_thread=False``: no thread receives in the background; callers receive in
        ``wait_for`` only (a test that steers every step).
        """
        conn = self.conn
        conn.register()
        if self.env.same_host == "shm" and not self.outbox.replicated:
            self.data.regions.find_servers(conn.members.servers, conn.me.fingerprint)
            if self.data.regions.servers:  # a reply may name a server's region (psnode.server.shared_values)
                self.requests.server_memory = same_host.Attachments(self.data.regions.tag)
        if network_thread:
            self.receiver.start(f"psnode-worker-{conn.rank}")
        if conn.members.joined_at:  # joined a running elastic job
            self.elastic.started()
        return self

    def before_close(self, send: Callable[[], None]) -> None:
        """Call ``send()`` when this worker closes, before it waits for its requests and finishes (a
        store sends what it still holds back: ``kvcore.stores.deferred_init``). An error it raises is
        raised by ``close`` once the worker is closed."""
        self._before_close.append(send)

    def watch_process(self) -> "WorkerNode":
        """Make this process's end the worker's (``worker_process.watch``): close at exit, and an
        uncaught exception aborts the job naming it."""
        watch(self)
        return self

    def _flush_collectives(self) -> None:
        """Keep the connections until the peers read what this worker's last collectives sent them.

        That may still wait in this worker's queues behind a peer that reads slowly (4 workers on 2
        cores: hundreds of small messages); closing would drop it and fail that peer's collectives.
        Each peer answers a ``FLUSH`` once it read everything before it, or finishes the job; the
        wait lasts at most as long as a peer waits for a finished worker's last messages.
        """
        flush = self.collectives.flush()
        deadline = time.monotonic() + LEFT_GRACE
        try:
            while not flush.future.done() and time.monotonic() < deadline:
                self.receiver.wait_for(flush.future, 0.05)
                flush.retry()
        except PSNodeError:  # a peer failed after this worker finished: its failure, not this one's
            pass

    def abort(self, reason: str) -> None:
        """Tell the scheduler this worker failed (so every other node stops with ``reason``), then close."""
        if self.closed or self.conn.failure.error is not None:
            return
        self.conn.link.send(Cmd.NODE_DIED, body={"message": reason})
        self.closed = True
        self.requests.refuse_new(f"worker {self.rank} was closed")
        self.receiver.stop()
        self.collectives.close()
        self.requests.fail_all(ClosedError(f"worker {self.rank} aborted: {reason}"))
        self.conn.close(linger=1.0)
        if self.timeline is not None:
            self.timeline.close()

    def leave(self, timeout: float = 60.0) -> int:
        """Leave an elastic job (``PSLAUNCH_MIN_WORKERS``) now, at a step boundary: every push this worker
        made must be acknowledged. The scheduler tells every node, whose rounds after this worker's
        last pushes go on without it; then this node closes without a finish. Returns how many workers
        go on.

        Raises:
            PSNodeError: the job is not elastic (the scheduler's sentence), requests are in flight, or
                the node failed; NodeTimeoutError: no answer within ``timeout``.
        """
        self._check()
        if self.requests.pending:
            raise PSNodeError(f"worker {self.rank} cannot leave with {len(self.requests.pending)} requests in flight: "
                              "leave at a step boundary, after the step's pulls")
        self._wait(self.conn.link.ask(Cmd.LEAVE), timeout, "answer to its leave")
        self.tell_launcher(MARKER_LEFT)
        self._close_unfinished(f"worker {self.rank} left the job")
        return self.env.num_workers - len(self.conn.members.left) - 1

    def detach(self) -> None:
        """Close this node without finishing its part (a preempted job's worker 0, whose process ends
        while pslaunch stops the others): no finish is sent, and ``close`` does nothing after."""
        if not self.closed:
            self._close_unfinished(f"worker {self.rank} was detached: the job was preempted")

    def _close_unfinished(self, why: str) -> None:
        """Close without a finish (``leave``, ``detach``): new requests are refused with ``why``, and
        ``close`` (also at exit) does nothing after."""
        self.closed = True
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        self.requests.refuse_new(why)
        self.receiver.stop()
        self.collectives.close()
        self.conn.close(linger=0.5)
        if self.timeline is not None:
            self.timeline.close()

    def close(self, timeout: float | None = None) -> None:
        """Wait for requests in flight, tell the scheduler this worker finished, and close (idempotent).

        Raises:
            NodeTimeoutError: requests still in flight after ``timeout`` seconds (default: a minute, or
                the heartbeat timeout when that is longer); the node is closed anyway.
        """
        if self.closed:
            return
        error: BaseException | None = None
        if self.conn.failure.error is None:
            for send in self._before_close:
                try:
                    send()
                except Exception as exc:  # raised once the worker is closed
                    error = error or exc
        self.outbox.release_held()
        self.outbox.pump()
        self.closed = True
        self.requests.refuse_new(f"worker {self.rank} was closed")
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        env, failure = self.env, self.conn.failure
        limit = timeout if timeout is not None else max(60.0, env.heartbeat_timeout)
        try:
            if failure.error is None and self.rank >= 0:  # registered: the scheduler expects a finish
                self.requests.caught_up()  # a replacement that redid its steps to the end pushes nothing new
                self.requests.wait_idle(limit, lambda: failure.error is not None, f"worker {self.rank}")
                self.collectives.wait_idle(limit)
                if self.timeline is not None:
                    self.timeline.close()  # written out before the scheduler, which ends a timeline file, hears of the finish
                report = self.conn.link.report
                finished = self.conn.link.ask(Cmd.FINISH, body=None if report is None else {"s": report()})
                self._wait(finished, min(limit, max(5.0, env.heartbeat_timeout)), "the scheduler's answer to finish")
                self.tell_launcher(MARKER_FINISHED)  # killed from here on, this worker needs no replacement
                self._flush_collectives()
        except PSNodeError as exc:
            error = exc
        finally:
            self.receiver.stop()
            self.collectives.close()
            self.requests.fail_all(ClosedError("the worker was closed"))
            self.conn.close(linger=0.5 if error is None else 0.0)
            if self.timeline is not None:
                self.timeline.close()
        if error is not None and not isinstance(error, ClosedError) and failure.error is None:
            raise error

    # ---- facts -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank (-1 until registered)."""
        return self.conn.rank

    @property
    def num_workers(self) -> int:
        """Workers in the job now (an elastic job's less those that left it)."""
        return self.env.num_workers - len(self.conn.members.left)

    @property
    def num_servers(self) -> int:
        """Servers in the job."""
        return self.env.num_servers

    @property
    def servers(self) -> list[PeerInfo]:
        """The job's servers by rank (empty until registered)."""
        return self.conn.members.servers

    @property
    def joined(self) -> bool:
        """True when this worker joined a running elastic job (``psnode.worker.elastic``): like a
        rejoined one it takes the servers' values and skips the job's set-up collectives."""
        return self.conn.members.joined_at > 0

    @property
    def rejoined(self) -> bool:
        """True when this worker took the rank of one that died (``PSLAUNCH_RESTART_SCOPE=worker``): the
        others passed the job's set-up long ago, so it joins no set-up collective (``kvcore``)."""
        return self.conn.members.rejoined

    @property
    def failure(self) -> BaseException | None:
        """Why the node failed, or None."""
        return self.conn.failure.error

    def _check(self) -> None:
        error = self.conn.failure.error
        if error is not None:
            raise error
        if self.closed:
            raise ClosedError(f"worker {self.rank} was closed")

    # ---- waiting -------------------------------------------------------------------------------
    def _await_workers(self) -> None:
        """Ask the scheduler for every worker's address (once) and wait for them: collectives in a job
        with servers, whose book held the servers only."""
        self._wait(self.conn.link.ask_workers(), self.env.register_timeout, "answer with the workers' addresses")

    def _wait(self, future: concurrent.futures.Future, limit: float | None, what: str) -> None:
        if not self.receiver.wait_for(future, limit):
            raise NodeTimeoutError(f"worker {self.rank}: no {what} within {limit:g} s")
        future.result()

    def wait_for(self, future: concurrent.futures.Future, timeout: float | None = None) -> bool:
        """Block until ``future`` is done or ``timeout`` seconds passed; True when done. Meanwhile this
        thread receives for the node, unless another waiter does (``Receiver.wait_for``), so the
        reply wakes it directly. The future's own error is not raised here (read it from the future).

        Raises:
            PSNodeError: the node failed (the failure, e.g. ``PeerDiedError``) or was closed.
        """
        return self.receiver.wait_for(future, timeout)

    def barrier(self, group: "Group | int | str" = Group.WORKERS, timeout: float | None = None,
                note: Any = None) -> list:
        """Block until every node of ``group`` (workers or all) reached a barrier; no time limit unless
        ``timeout`` is given (see ``Connection.ask_barrier``). Returns the notes members left (a
        small JSON value each, ``note``), in no set order.

        Raises:
            ValueError: an unknown group; PSNodeError: not in ``group``, or the barrier can never
            complete (a member already finished); PeerDiedError: a node died; NodeTimeoutError: ``timeout``.
        """
        self._check()
        future, what = self.conn.ask_barrier(group, note)
        self._wait(future, timeout, what)
        return future.result() or []

    def setup_barrier(self, call: str, barriers: int = 1) -> None:
        """The ``barriers`` workers' barriers of a set-up call (``set_optimizer``,
        ``set_gradient_compression``), one after the other. Where barriers are numbered (a worker that
        may be replaced in place), each keeps its number in the marks, and a replacement redoes one
        its predecessor's mark names by that number: answered at once, wherever its script calls it
        (a Trainer sets its optimizer at its first step, after the scalars are restored), while one
        the mark does not name is the next, as its predecessor's was.

        Raises:
            as ``barrier``.
        """
        link = self.conn.link
        occurrence = self._setup_calls.get(call, 0)
        self._setup_calls[call] = occurrence + 1
        for i in range(barriers):
            if not link.number_barriers:
                self.barrier(Group.WORKERS)
                continue
            name = f"{call}#{occurrence}:{i}"
            number = self._redone_setup.get(name)
            if number is None:
                number = link.barrier_counts.get(int(Group.WORKERS), 0) + 1
                link.barrier_counts[int(Group.WORKERS)] = number
            self._setup_barriers[name] = number
            self._check()
            future, what = self.conn.ask_barrier(Group.WORKERS, number=number)
            self._wait(future, None, what)

    # ---- marks: where a replacement of this worker resumes (``psnode.server.marks``) ---------------
    def mark(self, scalars: dict[str, Any]) -> None:
        """Leave a mark with every server: the next id, ``scalars`` (a JSON object: what the script
        resumes from), the barriers this worker entered and how many pushes of each of the server's
        key parts it issued so far. Sent after what is queued, answered by nothing: it costs no
        round trip."""
        self._check()
        self._mark_id += 1
        barriers = {str(group): count for group, count in self.conn.link.barrier_counts.items()}
        body = pack_json({"id": self._mark_id, "scalars": scalars, "barriers": barriers, "setup": self._setup_barriers})
        by_server: dict[int, dict[int, int]] = {server: {} for server in range(self.num_servers)}
        for (key_id, server), seq in list(self.requests.push_counts.items()):
            by_server[server][key_id] = seq
        for server, counts in by_server.items():
            self.outbox.enqueue(server, [pack_header(Cmd.MARK), body, pack_counts(counts)], _LAST, -1)
        self.outbox.pump()

    def number_barriers(self) -> None:
        """Number this worker's barriers from now on (a store whose worker may be replaced in place:
        its replacement redoes barriers by number, ``resume_barriers``)."""
        self.conn.link.number_barriers = True

    def resume(self) -> dict[str, Any] | None:
        """A worker started in place of one that died (``rejoined``): where its predecessor was. Asks
        every server for the predecessor's kept marks, takes the newest that every server holds and
        took every counted push of, counts this worker's pushes on from it (the servers drop the
        pushes it redoes and answer its pulls with what its predecessor pulled) and returns its
        scalars; None when there is none (the replacement starts from the beginning). Looked up
        once, before the first push or pull; a worker that did not rejoin has nothing to resume.

        Raises:
            PSNodeError: a server did not answer (dead, or the worker failed), or answered malformed.
        """
        if self._resumed is not None:
            return self._resumed[0]
        if not self.rejoined:
            self._resumed = (None,)
            return None
        future: concurrent.futures.Future = concurrent.futures.Future()
        replies: list = []
        servers = range(self.num_servers)
        req = self.requests.track(future, self.num_servers, replies, "marks", frozenset(servers))
        for server in servers:
            self.outbox.enqueue(server, [pack_header(Cmd.MARKS, req, 1)], 0, req)
        self.outbox.pump()
        self._wait(future, max(60.0, self.env.heartbeat_timeout), "answer with the marks of its predecessor")
        chosen = common_mark([(server, listed, frames[:-1]) for server, listed, frames in replies], self.num_servers)
        scalars = mark_id = None
        if chosen is not None:
            mark_id, scalars = chosen.id, chosen.scalars
            self._mark_id = mark_id
            self._resumed_barriers = {int(group): count for group, count in chosen.barriers.items()}
            self._redone_setup = dict(chosen.setup)
            for server, records in chosen.counts.items():
                for key_id, seq in zip(records["key"].tolist(), records["seq"].tolist()):
                    self.requests.push_counts[(key_id, server)] = seq
        self.requests.redo_until(taken_counts(replies), self._caught_up)
        self._resumed = (scalars,)
        self.tell_launcher(f"{MARKER_RESUMED} {json.dumps({'mark': mark_id, 'scalars': scalars})}")
        return scalars

    def _caught_up(self) -> None:
        self.tell_launcher(MARKER_CAUGHT_UP)

    def resume_barriers(self) -> None:
        """A replacement reached the point its predecessor's mark was left at (the script restored
        its scalars): number its barriers on from the mark's, so that those it redoes are answered at
        once (``psnode.scheduler.roster.Barriers``). Its earlier barriers (the set-up before the mark)
        were numbered from 1, which the scheduler answered at once as well."""
        if self._resumed_barriers is not None:
            self.conn.link.barrier_counts.update(self._resumed_barriers)
            self._resumed_barriers = None

    def barrier_done_already(self, group: "Group | int" = Group.WORKERS, ahead: int = 1) -> bool:
        """True when this worker's barrier ``ahead`` barriers on (of ``group``) completed already: a
        replacement redoing a step its predecessor passed (``State.commit`` then leaves the
        checkpoint its predecessor wrote as it is)."""
        link = self.conn.link
        return link.barrier_counts.get(int(group), 0) + ahead <= link.barriers_completed.get(int(group), 0)

    # ---- the ledger: records worker 0 leaves for every worker (``psnode.scheduler.ledger``) -----
    def ledger_append(self, log: str, entry: bytes) -> concurrent.futures.Future:
        """Append ``entry`` to the scheduler's ledger log ``log`` (worker 0 only); returns at once:
        the future holds the entry's index, or fails with the scheduler's refusal."""
        self._check()
        return self.conn.link.ask(Cmd.LEDGER_APPEND, body={"log": log}, data=(entry,))

    def ledger_read(self, log: str, start: int, wait: bool) -> concurrent.futures.Future:
        """Read the ledger log ``log`` from index ``start``; returns at once: the future holds a
        ``LedgerPage`` (with ``wait``, once there is at least one entry from ``start`` on, or the log
        ended because worker 0 finished). A dead node fails it (liveness is checked)."""
        self._check()
        return self.conn.link.ask(Cmd.LEDGER_READ, arg=start, body={"log": log, "wait": wait})

    # ---- the API: init and updater -------------------------------------------------------------
    def init(self, parts: Sequence[tuple[int, int, Hashable, np.ndarray, int]], sync: bool, future: Any = None,
             redo: bool = False) -> Any:
        """Send initial values ``(server, key id, user key, value, row_size)``; the future is done when
        every server stored them. A server's parts travel in messages of at most ``INIT_PARTS`` specs
        and about ``PACK_LIMIT`` bytes, small values packed into the message's first frame, so a call
        of a million keys sends no message that grows with it. ``redo``: a worker 0 started again
        alone, whose predecessor may have initialised some of them (``FLAG_REDO``)."""
        future = future or concurrent.futures.Future()
        by_server: dict[int, list] = {}
        for part in parts:
            by_server.setdefault(part[0], []).append(part)
        messages = [(server, batch) for server, items in by_server.items()
                    for batch in batches(items, INIT_PARTS, PACK_LIMIT, lambda part: part[3].nbytes)]
        req = self.requests.track(future, len(messages), None, "init", frozenset(by_server))
        flags = (FLAG_SYNC if sync else 0) | (FLAG_REDO if redo else 0)
        for server, batch in messages:
            msg = [pack_header(Cmd.INIT, req, 1, flags), *_init_frames(batch)]
            self.outbox.enqueue(server, msg, 0, req)
        self.outbox.pump()
        return future

    def set_updater(self, updater: Any, future: Any = None, redo: bool = False) -> Any:
        """Ship a picklable updater to every server; the future is done when all installed it.
        ``redo``: a worker 0 started again alone: a server that has one keeps it (``FLAG_REDO``)."""
        future = future or concurrent.futures.Future()
        blob = pickle.dumps(updater, protocol=pickle.HIGHEST_PROTOCOL)
        req = self.requests.track(future, self.num_servers, None, "set_updater", frozenset(range(self.num_servers)))
        for server in range(self.num_servers):
            self.outbox.enqueue(server, [pack_header(Cmd.SET_UPDATER, req, 1, FLAG_REDO if redo else 0), blob], 0, req)
        self.outbox.pump()
        return future

    def checkpoint(self, bodies: dict[int, Any], future: Any = None) -> tuple[Any, list]:
        """Send checkpoint request ``bodies[server]`` (a JSON object, ``psnode.server.checkpoints``) to
        each server; returns the future (done once every server answered, or failed with the first
        refusal) and the list that gathers the ``(server, reply)`` pairs."""
        future = future or concurrent.futures.Future()
        replies: list = []
        req = self.requests.track(future, len(bodies), replies, "checkpoint", frozenset(bodies))
        for server, body in bodies.items():
            self.outbox.enqueue(server, [pack_header(Cmd.CHECKPOINT, req, 1), pack_json(body)], 0, req)
        self.outbox.pump()
        return future, replies

    def wait_pushes(self, timeout: float | None = None) -> None:
        """Block until every push this worker issued so far was answered by its server (receiving
        on this thread meanwhile); a refused push counts as answered.

        Raises:
            NodeTimeoutError: a push still unanswered after ``timeout`` seconds (default: a minute,
                or the heartbeat timeout when longer); PSNodeError: the worker failed or was closed.
        """
        self._check()
        self.outbox.release_held()
        self.outbox.pump()
        limit = timeout if timeout is not None else max(60.0, self.env.heartbeat_timeout)
        deadline = time.monotonic() + limit
        pushes = [r.future for r in list(self.requests.pending.values()) if r.what == "push"]
        for future in pushes:
            if not self.receiver.wait_for(future, max(0.0, deadline - time.monotonic())):
                raise NodeTimeoutError(f"worker {self.rank}: pushes still unanswered after {limit:g} s")
        self.conn.failure.check()

    def set_codec(self, codec: int, params: dict[str, Any], future: Any = None) -> Any:
        """Send codec ``codec``'s parameters (``{"threshold": t}``) to every server; the future is
        done when all took them, or fails with the first refusal (which names the bad value).

        Pushes in that codec sent after the future is done are decoded with these parameters; the
        caller makes sure no worker's push in it is still on the way when they change.
        """
        future = future or concurrent.futures.Future()
        body = pack_codec_params(codec, params)
        req = self.requests.track(future, self.num_servers, None, "set_codec", frozenset(range(self.num_servers)))
        for server in range(self.num_servers):
            self.outbox.enqueue(server, [pack_header(Cmd.SET_CODEC, req, 1), body], 0, req)
        self.outbox.pump()
        return future

    # ---- the API: push and pull (``worker_data.DataPath``) ------------------------------------------
    def push(self, parts: Sequence[tuple[int, int, np.ndarray]], priority: int = 0, copy: bool = True,
             future: Any = None, codec: int = RAW) -> Any:
        """Push ``(server, key id, value)`` parts; returns at once (``DataPath.push``): the future is
        done when every server has received its parts."""
        return self.data.push(parts, priority, copy, future, codec)

    def push_part(self, server: int, key_id: int, value: np.ndarray, priority: int = 0, future: Any = None,
                  codec: int = RAW, copy: bool = True) -> Any:
        """``push`` of one part, for callers with one part."""
        return self.data.push_part(server, key_id, value, priority, future, codec, copy)

    def pull(self, parts: Sequence[tuple[int, int, np.ndarray]], priority: int = 0, future: Any = None,
             codecs: Sequence[int] | None = None) -> Any:
        """Pull ``(server, key id, out)`` parts into the C-contiguous arrays ``out``; returns at once
        (``DataPath.pull``; ``codecs``: replies encoded at half width). Each value includes every push
        of the key this worker issued before."""
        return self.data.pull(parts, priority, future, codecs)

    def pull_part(self, server: int, key_id: int, out: np.ndarray, priority: int = 0, future: Any = None) -> Any:
        """``pull`` of one part, for callers with one part."""
        return self.data.pull_part(server, key_id, out, priority, future)

    def pull_rows(self, parts: Sequence[tuple[int, int, np.ndarray, np.ndarray]], priority: int = 0,
                  future: Any = None) -> Any:
        """Pull the rows ``rows`` (int64, local to the part) of ``(server, key id, rows, out)`` parts into ``out``."""
        return self.data.pull_rows(parts, priority, future)

    # ---- replies (the receiving thread) --------------------------------------------------------------
    def _on_reply(self, peer: PeerInfo, cmd: int, flags: int, req_id: int, arg: int, frames: list) -> None:
        if cmd == _COLL:  # another worker's collective: req_id and arg are its tag
            self.collectives.on_message(peer, req_id, arg, frames)
            return
        if cmd == _INVITE:  # a server asks for the value of a part offered to it
            if peer.role != "server":
                raise ProtocolError(f"an invitation from {peer.describe()}, which is no server")
            self.data.invited(peer.rank, req_id, arg)
            return
        if cmd == _JOINED:  # a worker joined the elastic job (each server says it)
            self.elastic.on_note(peer, frames)
            return
        if cmd == _LEAVING:  # a worker's next push is its last (each server relays it)
            self.elastic.on_leaving(peer, frames)
            return
        if cmd == _STALLED:  # a server's round this worker pushed to is stalled: say so here too
            body = unpack_json(frames[1]) if peer.role in ("server", "replica") and len(frames) > 1 else None
            if not isinstance(body, dict) or not isinstance(body.get("text"), str):
                raise ProtocolError(f"a malformed stall notice from {peer.describe()}")
            logger.warning("worker %d waits on server %d: %s", self.rank, peer.rank, body["text"][:1000])
            return
        self.requests.take_reply(peer, cmd, flags, req_id, arg, frames)
        if self.outbox.queue:  # a reply may mean a connection has room again
            self.outbox.pump()


INIT_PARTS = 4096  # specs in one INIT message (each is a small JSON object the server checks)
_LAST = -(1 << 62)  # a mark's priority: after every message queued before it


def taken_counts(replies: list) -> dict[tuple[int, int], int]:
    """``(key id, server) -> pushes the server took`` from the last frame of each ``MARKS_REPLY``
    ``(server, listed, frames)``.

    Raises:
        ProtocolError: a last frame that is not ``MARK_COUNT`` records.
    """
    taken: dict[tuple[int, int], int] = {}
    for server, _, frames in replies:
        if len(frames[-1]) % MARK_COUNT.itemsize:
            raise ProtocolError(f"server {server} sent taken counts of {len(frames[-1])} bytes, not MARK_COUNT records")
        records = np.frombuffer(frames[-1], MARK_COUNT)
        for key_id, seq in zip(records["key"].tolist(), records["seq"].tolist()):
            taken[(key_id, server)] = seq
    return taken


class ChosenMark(NamedTuple):
    """The mark a replacement resumes from (``common_mark``)."""

    id: int
    scalars: dict[str, Any]
    barriers: dict[str, int]  # barrier group (as text) -> barriers of it its predecessor had entered
    setup: dict[str, int]  # a set-up call's barrier -> its number (``WorkerNode.setup_barrier``)
    counts: dict[int, np.ndarray]  # server -> MARK_COUNT records: pushes of each key part issued


def common_mark(replies: list, num_servers: int) -> ChosenMark | None:
    """The newest mark every server listed as complete, from ``MARKS_REPLY`` answers ``(server,
    listed, count frames)``, or None when there is none.

    Raises:
        ProtocolError: an answer that is not a list of marks with their count frames.
    """
    complete: dict[int, dict[int, tuple[dict, dict, dict, np.ndarray]]] = {}
    for server, listed, frames in replies:
        for entry, frame in zip(listed, frames):
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), int) or len(frame) % MARK_COUNT.itemsize:
                raise ProtocolError(f"server {server} listed a malformed mark: {str(entry)[:100]}")
            barriers, setup = entry.get("barriers", {}), entry.get("setup", {})
            if (entry.get("complete") is True and isinstance(entry.get("scalars"), dict) and isinstance(barriers, dict)
                    and isinstance(setup, dict)):
                complete.setdefault(entry["id"], {})[server] = (entry["scalars"], barriers, setup,
                                                                np.frombuffer(frame, MARK_COUNT))
    for mark_id in sorted(complete, reverse=True):
        by_server = complete[mark_id]
        if len(by_server) == num_servers:
            scalars, barriers, setup, _ = next(iter(by_server.values()))
            return ChosenMark(mark_id, scalars, barriers, setup, {server: item[3] for server, item in by_server.items()})
    return None


def _init_frames(batch: list) -> list:
    """An INIT message's body and data frames: values under ``OWN_FRAME`` bytes packed into frame 0,
    each at an 8-byte aligned offset; bigger ones in frames of their own."""
    specs, small, own, packed_size = [], [], [], 0
    for _, key_id, user_key, value, row_size in batch:
        value = np.ascontiguousarray(value)
        spec = {"key": key_id, "user_key": user_key, "shape": list(value.shape), "dtype": value.dtype.str,
                "row_size": row_size}
        if value.nbytes >= OWN_FRAME:
            own.append(value)
            spec.update(frame=len(own), offset=0)
        else:
            spec.update(frame=0, offset=packed_size)
            small.append((packed_size, value))
            packed_size += value.nbytes + (-value.nbytes % 8)
        specs.append(spec)
    packed = np.zeros(packed_size, np.uint8)
    for offset, value in small:
        packed[offset:offset + value.nbytes] = value.reshape(-1).view(np.uint8)
    return [pack_json(specs), packed, *own]

