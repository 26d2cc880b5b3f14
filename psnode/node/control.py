"""A node's side of the control plane: registration, heartbeats, barriers and the first failure.

``SchedulerLink`` is everything a server or worker says to the scheduler and hears from it:
it registers (and waits for the address book), sends heartbeats and notices a silent scheduler,
asks for barriers and for the end of the job, and handles what the scheduler announces (a node
died, a worker finished, shut down). With ``PSLAUNCH_STATS`` its heartbeats carry the node's
counters (``report``, ``psnode.node.stats``); with a timeline it measures the offset to the scheduler's
clock right after registration and writes the timeline out at every heartbeat
(``psnode.node.timeline``). ``FailureLatch`` keeps the node's first failure and tells the
parts that must react (pending requests fail, waiters wake) exactly once.

Thread-safety: ``handle`` and ``tick`` run on whichever thread receives for the node; ``ask``,
``send`` and ``FailureLatch.fail`` may be called from any thread.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from psnode.env import NodeEnv
from psnode.errors import (
    ClosedError,
    PeerDiedError,
    ProtocolError,
    PSNodeError,
    RefusedError,
    RegistrationTimeoutError,
)
from psnode.log import logger
from psnode.node.membership import SCHEDULER, Membership, PeerInfo, endpoint_of
from psnode.node.protocol import FLAG_ERROR, Cmd, pack_header, pack_json, unpack_header, unpack_json
from psnode.transport.base import Transport

__all__ = ["FailureLatch", "SchedulerLink", "LedgerPage", "CONTROL_CMDS"]

_REGISTER_AGAIN = 2.0  # seconds between registrations while no address book came (PSLAUNCH_RESTART_SCOPE=worker)

CONTROL_CMDS = frozenset(
    {Cmd.ADDRBOOK, Cmd.REGISTER_FAILED, Cmd.HEARTBEAT_ACK, Cmd.BARRIER_DONE, Cmd.FINISH_ACK, Cmd.SHUTDOWN,
     Cmd.NODE_DIED, Cmd.WORKER_FINISHED, Cmd.RDV_VALUE, Cmd.WORKER_REJOINED, Cmd.PEERS_REPLY, Cmd.LEDGER_ACK,
     Cmd.LEDGER_ENTRIES, Cmd.SERVER_LOST, Cmd.SCHEDULER_BACK, Cmd.REPLICA_JOINED, Cmd.REPLICA_JOINING,
     Cmd.BARRIER_STALLED, Cmd.LEAVE_ACK, Cmd.WORKER_LEFT, Cmd.JOIN_FREEZE, Cmd.WORKER_JOINED, Cmd.JOIN_THAW,
     Cmd.JOIN_SCALARS}
)
"""What only the scheduler sends to a node."""

_EARLY_LIMIT = 10000  # messages from peers kept while the address book is still on its way


@dataclass(frozen=True)
class LedgerPage:
    """A ledger read's answer (``psnode.scheduler.ledger``): the entries from index ``start`` on,
    and whether the log ended there (worker 0 finished: nothing more will come)."""

    start: int
    entries: list[bytes]
    end: bool


def _ledger_result(cmd: int, flags: int, arg: int, frames: list) -> "int | LedgerPage":
    """The result a ledger answer carries: an append's index, or a read's page.

    Raises:
        PSNodeError: the scheduler refused the request (its sentence); ProtocolError: a malformed answer.
    """
    if flags & FLAG_ERROR:
        body = unpack_json(frames[1]) if len(frames) > 1 else None
        raise PSNodeError(str(body.get("error") if isinstance(body, dict) else body))
    if cmd == Cmd.LEDGER_ACK:
        return arg
    body = unpack_json(frames[1]) if len(frames) > 1 else None
    if not isinstance(body, dict) or not isinstance(body.get("end"), bool):
        raise ProtocolError("a ledger answer without its 'end' flag")
    return LedgerPage(arg, [bytes(f.buffer if hasattr(f, "buffer") else f) for f in frames[2:]], body["end"])


class FailureLatch:
    """The first failure of a node (thread-safe); later failures are ignored.

    ``error`` is None until ``fail``; each listener added with ``on_failure`` is called once, on
    the failing thread, with the error.
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._listeners: list[Callable[[BaseException], None]] = []

    def on_failure(self, listener: Callable[[BaseException], None]) -> None:
        """Call ``listener(error)`` once the node fails."""
        self._listeners.append(listener)

    def fail(self, error: BaseException) -> bool:
        """Record ``error`` if it is the first failure and tell the listeners; True when it was."""
        with self._lock:
            if self.error is not None:
                return False
            self.error = error
        for listener in self._listeners:
            listener(error)
        return True

    def check(self) -> None:
        """Raise the failure, if any."""
        if self.error is not None:
            raise self.error


class SchedulerLink:
    """This node's conversation with the scheduler (see the module docstring).

    ``me``: this node's own record (rank -1 until the address book says). ``on_worker_finished(rank,
    description)`` is called when the scheduler says a worker left the job, ``on_worker_rejoined(rank)``
    when a restarted worker took its rank back (``PSLAUNCH_RESTART_SCOPE=worker``; the book is
    updated and the new worker connected first).
    """

    def __init__(self, env: NodeEnv, transport: Transport, me: PeerInfo, members: Membership, failure: FailureLatch,
                 on_worker_finished: Callable[[int, str], None] | None = None,
                 on_worker_rejoined: Callable[[int], None] | None = None) -> None:
        self.env = env
        self.transport = transport
        self.me = me
        self.members = members
        self.failure = failure
        self.on_worker_finished = on_worker_finished
        # ``on_worker_left(rank, version, dropped)``: an elastic job's worker left (``WORKER_LEFT``; ``dropped``:
        # it was lost, not a leave at a step boundary); ``version``: the scheduler's number of that change
        self.on_worker_left: Callable[[int, int, bool], None] | None = None
        # ``on_worker_lost(rank, version)``: the same for a lost worker, called before the book says it left (a
        # worker's script counts it until its servers name the round it is dropped from: psnode.worker.elastic)
        self.on_worker_lost: Callable[[int, int], None] | None = None
        # ``on_join(cmd, body)``: a worker joins an elastic job (JOIN_FREEZE, WORKER_JOINED, JOIN_THAW to a
        # server; JOIN_SCALARS to the joiner); the body is a checked-to-be object
        self.on_join: Callable[[int, dict], None] | None = None
        self.on_worker_rejoined = on_worker_rejoined
        # ``on_server_lost(rank, lost uid, taking-over uid or None)``: a server's process (or a replica) of
        # the job is gone (PSLAUNCH_SERVER_REPLICAS); it updates the book and drops the lost peer's
        # connection (without it the connection is dropped here)
        self.on_server_lost: Callable[[int, str, str | None], None] | None = None
        # ``on_replica(cmd, peer)``: a replica joins the running job (``REPLICA_JOINED`` to a worker,
        # ``REPLICA_JOINING`` to the server of its rank: psnode.server.snapshot)
        self.on_replica: Callable[[int, PeerInfo], None] | None = None
        # ``on_connected(peers)``: the peers of the first address book are connected (before anything is sent to them)
        self.on_connected: Callable[[list[PeerInfo]], None] | None = None
        self.shutdown_requested = False
        self.malformed = 0
        # A scheduler started again in place (PSLAUNCH_RESTART_SCOPE=worker): this node notices its
        # connection end, registers again with its rank (``_rejoin``) and, once the new scheduler
        # answers (``SCHEDULER_BACK``), sends again what it had asked (``_asked``), after what the
        # scheduler keeps for the job that this node gave it (``_kept``: ledger entries, rendezvous
        # values). ``rejoin_info()`` adds to the registration what the scheduler must learn again
        # (a server: the workers that finished).
        self.rejoin_scheduler = env.restart_scope == "worker"
        self.rejoining_since: float | None = None
        self.rejoin_info: Callable[[], dict] | None = None
        self._asked: dict[int, tuple] = {}  # req_id -> (cmd, arg, body, data) of an unanswered request
        self._kept: list[tuple] = []  # (req_id, cmd, arg, body, data) of ledger appends and rendezvous values sent
        # Barriers numbered by group (a dist_sync worker under PSLAUNCH_RESTART_SCOPE=worker): how many this node
        # entered, and how many of the group the scheduler said were complete in its last answer. A
        # replacement in place counts on from its predecessor's mark, so the barriers it redoes are
        # answered at once (psnode.scheduler.roster.Barriers).
        self.number_barriers = False  # set by a store whose worker may be replaced in place (kvcore)
        self.barrier_counts: dict[int, int] = {}
        self.barriers_completed: dict[int, int] = {}
        self._last_heard = time.monotonic()
        self._last_tick = 0.0  # when tick last ran: a long gap means this process was stopped
        self._next_heartbeat = 0.0
        self._waiters: dict[int, concurrent.futures.Future] = {}  # req_id -> barrier / finish future
        self._waiters_lock = threading.Lock()
        self._workers_asked: concurrent.futures.Future | None = None  # the PEERS request, once asked
        self._workers_lock = threading.Lock()
        self._req_ids = itertools.count(1 << 62)  # apart from the data requests' ids
        self.report: Callable[[], dict] | None = None  # the counters heartbeats carry (PSLAUNCH_STATS)
        self.timeline: Any = None  # this node's psnode.node.timeline.Timeline, if any
        failure.on_failure(self._fail_waiters)

    # ---- registration -------------------------------------------------------------------
    def register(self) -> list[tuple[bytes, list]]:
        """Register with the scheduler and wait for the address book (blocking); connect to the peers.

        Returns the messages peers sent before the book arrived (a peer that got it first may
        already send requests), for the caller to dispatch.

        Raises:
            RegistrationTimeoutError: the scheduler reported a timeout, or never answered.
            TransportError: the scheduler's address cannot be connected to.
        """
        env, me = self.env, self.me
        self.transport.connect(SCHEDULER, f"tcp://{env.root_uri}:{env.root_port}", watch=True)
        info = {**me.as_record(), "worker_id": env.worker_id if me.role == "worker" else None, "job_id": env.job_id,
                "job_from": env.job_id_from or None}
        del info["rank"]
        self.send(Cmd.REGISTER, body=info)
        logger.info("%s registering with the scheduler at %s", me.uid, env.root_address)
        limit = env.register_timeout + max(5.0, env.heartbeat_timeout)
        deadline = time.monotonic() + limit
        early: list[tuple[bytes, list]] = []
        resend = time.monotonic() + _REGISTER_AGAIN
        while True:
            if self.rejoin_scheduler and time.monotonic() > resend:
                # a scheduler started in place before the job formed never got the first one (harmless twice)
                self.send(Cmd.REGISTER, body=info)
                resend = time.monotonic() + _REGISTER_AGAIN
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RegistrationTimeoutError(
                    f"{me.role} at {me.host}:{me.port} got no address book from the scheduler at "
                    f"{env.root_address} within {limit:.0f} s; "
                    "is the scheduler running and reachable (DMLC_PS_ROOT_URI / DMLC_PS_ROOT_PORT)?"
                )
            if not self.transport.poll(min(remaining, 0.5)):
                why = self.transport.refused(SCHEDULER)
                if why is not None:
                    raise RefusedError(
                        f"the scheduler at {env.root_address} {why}: this {me.role} is of job {env.job_id!r}; "
                        "is another job using that port, or are the processes' PSLAUNCH_JOB_KEY different?"
                        + (f" Without PSLAUNCH_JOB_ID each process derives the job id from the scheduler's address as "
                           f"it is given (here {env.job_id_from!r}): every process must name it alike"
                           if env.job_id_from else ""))
                continue
            sender, frames = self.transport.recv()
            if sender != SCHEDULER:
                if len(early) < _EARLY_LIMIT:
                    early.append((sender, frames))
                continue
            try:
                cmd, _, _, _ = unpack_header(frames[0])
                if cmd == Cmd.REGISTER_FAILED:
                    body = unpack_json(frames[1])
                    kind = RegistrationTimeoutError if body.get("kind") == "timeout" else RefusedError
                    raise kind(str(body["error"]))
                if cmd == Cmd.ADDRBOOK:
                    self._connect(unpack_json(frames[1]))
                    if self.rejoin_scheduler:  # its end is noticed at once: a scheduler started in place
                        self.transport.watch_liveness(SCHEDULER)
                    if self.timeline is not None:
                        self._probe_clock(early)
                    return early
            except (ProtocolError, IndexError, KeyError, TypeError) as exc:
                self.note_malformed(sender, exc)

    def _connect(self, book: Any) -> None:
        peers = self.members.apply(book)
        for peer in peers:
            endpoint = endpoint_of(peer, self.transport, self.me.fingerprint, self.env.same_host)
            self.transport.connect(peer.uid.encode(), endpoint)
            logger.info("%s %d connected to %s at %s", self.me.role, self.members.rank, peer.describe(), endpoint)
        if self.on_connected is not None:
            self.on_connected(peers)
        self._last_heard = self._last_tick = time.monotonic()

    def _probe_clock(self, early: list[tuple[bytes, list]]) -> None:
        """Measure the offset to the scheduler's clock for the timeline (a few heartbeats that ask
        for its clock, at most a second each); other messages meanwhile go to ``early``."""
        timeline = self.timeline
        boot = self.me.fingerprint.split(":")[0]
        for _ in range(timeline.CLOCK_PROBES):
            sent = time.monotonic_ns()
            self.send(Cmd.HEARTBEAT, body={"clock": sent})
            deadline = time.monotonic() + 1.0
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.transport.poll(remaining):
                    return  # no answer: the timeline says its clock is not aligned
                sender, frames = self.transport.recv()
                received = time.monotonic_ns()
                try:
                    cmd = unpack_header(frames[0])[0]
                    body = unpack_json(frames[1]) if sender == SCHEDULER and cmd == Cmd.HEARTBEAT_ACK else None
                except (ProtocolError, IndexError) as exc:
                    self.note_malformed(sender, exc)
                    continue
                if body is None:
                    if len(early) < _EARLY_LIMIT:
                        early.append((sender, frames))
                    continue
                if not isinstance(body, dict) or body.get("clock") != sent or type(body.get("now")) is not int:
                    continue  # an answer to an earlier probe
                same_boot = body.get("boot") == boot
                timeline.clock_sample(sent, body["now"], received, same_boot)
                if same_boot:
                    return
                break

    # ---- liveness --------------------------------------------------------------------------
    def tick(self, now: float) -> float:
        """Send a heartbeat when one is due and fail the node if the scheduler went silent.

        Returns the monotonic time of the next heartbeat (infinity when heartbeats are off).
        """
        interval = self.env.heartbeat_interval
        if interval <= 0 or self.failure.error is not None:
            return float("inf")
        stalled = now - self._last_tick
        self._last_tick = now
        if stalled > self.env.heartbeat_timeout / 2:
            self._last_heard += stalled  # this process was stopped (Ctrl-Z): not the scheduler's silence
        silent = now - self._last_heard
        if self.rejoin_scheduler and self.members.rank >= 0:
            if self.rejoining_since is None and self.transport.dropped(SCHEDULER):
                self._rejoin(now)  # the scheduler's connection ended: pslaunch starts it again in place
            if self.rejoining_since is not None:
                return self._rejoining(now)
        if silent > self.env.heartbeat_timeout:
            env = self.env
            self.failure.fail(PeerDiedError(
                f"the scheduler at {env.root_address} died or is unreachable: no message from it for "
                f"{silent:.1f} s (PS_HEARTBEAT_TIMEOUT={env.heartbeat_timeout:g})",
                "scheduler", 0, env.root_uri,
            ))
            return float("inf")
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + interval
            report = self.report
            self.send(Cmd.HEARTBEAT, body=None if report is None else {"s": report()})
            if self.timeline is not None:
                self.timeline.flush()
        return self._next_heartbeat

    def _rejoin(self, now: float) -> None:
        """Register again with a scheduler started in place (its connection ended): this node keeps its
        rank; every second until the scheduler answers (``SCHEDULER_BACK``)."""
        if self.rejoining_since is None:
            self.rejoining_since = now
            logger.info("%s %d: the scheduler's connection ended; registering again with the scheduler "
                           "started in its place (PSLAUNCH_RESTART_SCOPE=worker)", self.me.role, self.members.rank)
        info = {**self.me.as_record(), "rank": self.members.rank, "rejoin": True, "job_id": self.env.job_id,
                "worker_id": self.members.rank if self.me.role == "worker" else None,
                "barriers": {str(g): n for g, n in self.barriers_completed.items()}}
        if self.rejoin_info is not None:
            info.update(self.rejoin_info())
        self.send(Cmd.REGISTER, body=info)
        self._next_heartbeat = now + 1.0

    def _rejoining(self, now: float) -> float:
        """While no scheduler answered: register again each second, and fail once none answered
        within the heartbeat timeout plus the registration timeout (pslaunch did not start one)."""
        env = self.env
        waited = now - self.rejoining_since
        if waited > env.heartbeat_timeout + env.register_timeout:
            self.failure.fail(PeerDiedError(
                f"the scheduler at {env.root_address} died and no scheduler took its place within {waited:.0f} s "
                f"(PS_HEARTBEAT_TIMEOUT + PSLAUNCH_REGISTER_TIMEOUT)", "scheduler", 0, env.root_uri))
            return float("inf")
        if now >= self._next_heartbeat:
            self._rejoin(now)
        return self._next_heartbeat

    def _scheduler_back(self, body: Any) -> None:
        """The scheduler started in place took this node back: send it again what it keeps for the job
        (this node's ledger entries and rendezvous values, in their order) and then every request it
        had not answered, under their ids."""
        if not isinstance(body, dict):
            raise ProtocolError(f"a SCHEDULER_BACK body that is a {type(body).__name__}, not an object")
        completed = body.get("barriers")
        if isinstance(completed, dict):
            for group, count in completed.items():
                if str(group).isdigit() and type(count) is int:
                    self.barriers_completed[int(group)] = max(count, self.barriers_completed.get(int(group), 0))
        if self.rejoining_since is None:
            return  # an answer to a registration sent twice
        logger.info("%s %d: the scheduler started in place took this node back after %.1f s", self.me.role,
                       self.members.rank, time.monotonic() - self.rejoining_since)
        self.rejoining_since = None
        self.heard()
        with self._waiters_lock:
            kept, asked = list(self._kept), sorted(self._asked.items())
        for req_id, cmd, arg, body_, data in kept:
            self.send(cmd, req_id, arg, body_, data)  # an answer nobody waits for any more is dropped
        for req_id, (cmd, arg, body_, data) in asked:
            if cmd not in (Cmd.LEDGER_APPEND, Cmd.RDV_SET):  # those went again above
                self.send(cmd, req_id, arg, body_, data)

    def beat(self) -> None:
        """Between chunks of long work on the receiving thread (a checkpoint's files): send a heartbeat
        when one is due. Nothing is received meanwhile, so the time is not counted as the scheduler's
        silence."""
        now = time.monotonic()
        self._last_heard += now - self._last_tick
        self._last_tick = now
        interval = self.env.heartbeat_interval
        if interval > 0 and now >= self._next_heartbeat and self.failure.error is None:
            self._next_heartbeat = now + interval
            self.send(Cmd.HEARTBEAT)

    def heard(self) -> None:
        """The scheduler just sent something: it is alive."""
        self._last_heard = time.monotonic()

    # ---- messages ----------------------------------------------------------------------------
    def send(self, cmd: int, req_id: int = 0, arg: int = 0, body: Any = None, data: tuple = ()) -> None:
        """Send a control message to the scheduler (thread-safe), its ``data`` frames after the body;
        a closed transport drops it."""
        frames = [pack_header(cmd, req_id, arg)]
        if body is not None:
            frames.append(pack_json(body))
        frames.extend(data)
        try:
            self.transport.send(SCHEDULER, frames)
        except ClosedError:
            pass

    def ask(self, cmd: int, arg: int = 0, body: Any = None, data: tuple = ()) -> concurrent.futures.Future:
        """Send ``cmd`` (a barrier, finish, rendezvous or ledger request) and return the future the
        scheduler's answer completes: a barrier's holds the notes its members left
        (``Connection.ask_barrier``), a rendezvous value's the value, a ledger append's the entry's
        index, a ledger read's ``LedgerPage``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        req_id = next(self._req_ids)
        with self._waiters_lock:
            if self.failure.error is not None:
                future.set_exception(self.failure.error)
                return future
            self._waiters[req_id] = future
        if self.rejoin_scheduler:
            with self._waiters_lock:
                self._asked[req_id] = (cmd, arg, body, data)
                if cmd in (Cmd.LEDGER_APPEND, Cmd.RDV_SET):
                    self._kept.append((req_id, cmd, arg, body, data))
        self.send(cmd, req_id, arg, body, data)
        return future

    def handle(self, cmd: int, flags: int, req_id: int, frames: list, arg: int = 0) -> None:
        """Handle a control message from the scheduler.

        Raises:
            ProtocolError, IndexError, KeyError, TypeError, ValueError: a malformed body.
        """
        if cmd == Cmd.HEARTBEAT_ACK:
            return
        if cmd == Cmd.NODE_DIED:
            info = unpack_json(frames[1])
            self.failure.fail(PeerDiedError(str(info["message"]), str(info.get("role", "")),
                                            int(info.get("rank", -1)), str(info.get("host", ""))))
        elif cmd == Cmd.WORKER_FINISHED:
            info = unpack_json(frames[1])
            if self.on_worker_finished is not None:
                self.on_worker_finished(int(info["rank"]), str(info["node"]))
        elif cmd == Cmd.WORKER_LEFT:  # an elastic job's worker left at a step boundary
            info = unpack_json(frames[1])
            rank = int(info["rank"])
            version = info.get("version", 0)
            if not 0 <= rank < self.env.num_workers or type(version) is not int:
                raise ProtocolError(f"a WORKER_LEFT of worker {rank} (change {version!r}), which the job does not have")
            dropped = info.get("dropped") is not None  # lost, not a leave at a step boundary (Elastic.drop)
            if dropped and self.on_worker_lost is not None and version > self.members.version_of(rank):
                self.on_worker_lost(rank, version)
            if self.members.change(rank, False, version):
                logger.info("%s %d: %s left the job; %d workers go on", self.me.role, self.members.rank,
                            str(info["node"])[:200], self.env.num_workers - len(self.members.left))
                if self.on_worker_left is not None:
                    self.on_worker_left(rank, version, dropped)
        elif cmd in (Cmd.JOIN_FREEZE, Cmd.WORKER_JOINED, Cmd.JOIN_THAW, Cmd.JOIN_SCALARS):
            body = unpack_json(frames[1]) if len(frames) > 1 else {}
            if not isinstance(body, dict):
                raise ProtocolError(f"a {Cmd(cmd).name} body that is a {type(body).__name__}, not an object")
            if self.on_join is None:
                raise ProtocolError(f"a {Cmd(cmd).name} to a {self.me.role}, which takes no part in joins")
            self.on_join(cmd, body)
        elif cmd == Cmd.WORKER_REJOINED:
            info = unpack_json(frames[1])
            peer = PeerInfo.from_record(info["node"])
            self.members.replace_worker(str(info["old"]), peer)
            self.transport.connect(peer.uid.encode(), endpoint_of(peer, self.transport, self.me.fingerprint,
                                                                 self.env.same_host))
            logger.info("%s %d: worker %d rejoined at %s:%d", self.me.role, self.members.rank, peer.rank, peer.host,
                        peer.port)
            if self.on_worker_rejoined is not None:
                self.on_worker_rejoined(peer.rank)
        elif cmd == Cmd.SERVER_LOST:
            self._server_lost(unpack_json(frames[1]))
        elif cmd == Cmd.BARRIER_STALLED:  # a barrier this node waits in is stalled: say so here too
            text = unpack_json(frames[1])["text"]
            if not isinstance(text, str):
                raise ProtocolError("a stall notice whose text is no string")
            logger.warning("%s %d waits on the scheduler: %s", self.me.role, self.members.rank, text[:1000])
        elif cmd in (Cmd.REPLICA_JOINED, Cmd.REPLICA_JOINING):
            body = unpack_json(frames[1])
            if not isinstance(body, dict):
                raise ProtocolError(f"a {Cmd(cmd).name} body that is a {type(body).__name__}, not an object")
            peer = PeerInfo.from_record(body.get("node"))
            if self.on_replica is not None:
                self.on_replica(cmd, peer)
        elif cmd == Cmd.SCHEDULER_BACK:
            self._scheduler_back(unpack_json(frames[1]) if len(frames) > 1 else {})
        elif cmd == Cmd.SHUTDOWN:
            self.shutdown_requested = True
            if self.timeline is not None:
                self.timeline.close()  # written out before the scheduler, which ends a timeline file, hears back
            self.send(Cmd.SHUTDOWN_ACK, req_id, body=None if self.report is None else {"s": self.report()})
        elif cmd == Cmd.PEERS_REPLY:
            with self._waiters_lock:
                waiter = self._waiters.pop(req_id, None)
                self._asked.pop(req_id, None)
            self._take_workers(unpack_json(frames[1]))
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif cmd in (Cmd.LEDGER_ACK, Cmd.LEDGER_ENTRIES):
            with self._waiters_lock:
                waiter = self._waiters.pop(req_id, None)
                self._asked.pop(req_id, None)
            if waiter is not None and not waiter.done():
                try:
                    waiter.set_result(_ledger_result(cmd, flags, arg, frames))
                except PSNodeError as exc:  # a refusal, or a malformed answer: the asker must not wait on
                    waiter.set_exception(exc)
        elif cmd in (Cmd.BARRIER_DONE, Cmd.FINISH_ACK, Cmd.RDV_VALUE, Cmd.LEAVE_ACK):
            with self._waiters_lock:
                waiter = self._waiters.pop(req_id, None)
                self._asked.pop(req_id, None)
            if waiter is not None and not waiter.done():
                if flags & FLAG_ERROR:
                    waiter.set_exception(PSNodeError(str(unpack_json(frames[1])["error"])))
                elif cmd == Cmd.RDV_VALUE:
                    body = unpack_json(frames[1]) if len(frames) > 1 else None
                    value = body.get("value") if isinstance(body, dict) else None
                    if isinstance(value, str):
                        waiter.set_result(value)
                    else:  # the asker must not wait on: fail it, naming what came
                        waiter.set_exception(ProtocolError(
                            f"the scheduler answered a rendezvous request with a {type(value).__name__}, not a string"))
                else:
                    body = unpack_json(frames[1]) if len(frames) > 1 else {}
                    notes = body.get("notes", []) if isinstance(body, dict) else []
                    if cmd == Cmd.BARRIER_DONE and isinstance(body, dict):
                        group, completed = body.get("group"), body.get("completed")
                        if type(group) is int and type(completed) is int:
                            self.barriers_completed[group] = max(completed, self.barriers_completed.get(group, 0))
                    waiter.set_result(notes if isinstance(notes, list) else [])

    def _server_lost(self, info: Any) -> None:
        """The scheduler says a server's process is lost (``Cmd.SERVER_LOST``); the body is checked."""
        if not isinstance(info, dict):
            raise ProtocolError(f"a SERVER_LOST body that is a {type(info).__name__}, not an object")
        rank, lost, by = info.get("rank"), info.get("lost"), info.get("by")
        if type(rank) is not int or not isinstance(lost, str) or not (by is None or isinstance(by, str)):
            raise ProtocolError(f"a SERVER_LOST of rank {rank!r}, lost {str(lost)[:80]!r}, by {str(by)[:80]!r}")
        logger.info("%s %d: %s", self.me.role, self.members.rank, str(info.get("message", "a server was lost"))[:500])
        if self.on_server_lost is not None:  # a worker: its book and its requests in flight change together
            self.on_server_lost(rank, lost, by)
        else:
            self.transport.disconnect(lost.encode())

    def ask_workers(self) -> concurrent.futures.Future:
        """Ask the scheduler for every worker's record, once (a worker of a job with servers gets
        the servers only at registration: ``Membership.complete``); the future is done once they
        are in the book."""
        with self._workers_lock:
            if self._workers_asked is None and not self.members.complete:
                self._workers_asked = self.ask(Cmd.PEERS)
            asked = self._workers_asked
        if asked is None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return done
        return asked

    def _take_workers(self, body: Any) -> None:
        if not isinstance(body, dict) or not isinstance(body.get("nodes"), list):
            raise ProtocolError("a PEERS reply is not an object with a list of nodes")
        self.members.take_workers(body["nodes"])
        logger.info("%s %d learnt the %d workers' addresses", self.me.role, self.members.rank, len(self.members.workers))

    def note_malformed(self, sender: bytes, exc: BaseException) -> None:
        """Count and log a message this node could not use."""
        self.malformed += 1
        logger.info("%s %d dropped a malformed message from %r (%d so far): %s", self.me.role, self.members.rank,
                    sender[:64], self.malformed, exc)

    def _fail_waiters(self, error: BaseException) -> None:
        with self._waiters_lock:
            waiters, self._waiters = list(self._waiters.values()), {}
        for waiter in waiters:
            try:
                waiter.set_exception(error)
            except concurrent.futures.InvalidStateError:  # completed meanwhile
                pass
