"""What servers and workers share: a bound transport, their own record, the address book, the scheduler
link and the receive loop.

``Connection`` binds the node's receiving endpoint (on the transport it is given, or on the job's
``PSLAUNCH_TRANSPORT``), names the node (``role@host:port``), registers through its
``SchedulerLink`` and from then on runs ``process(timeout)``: it receives a batch of messages,
gives the scheduler's control messages to the link and every peer's data message to the node's
handler, and keeps heartbeats going. A message that cannot be used is counted and dropped.

Who calls ``process``: the server's one thread; for a worker, whichever thread holds its receiving
role (``worker_receiver``). Everything else here may be called from any thread.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

from psnode.env import NodeEnv
from psnode.errors import ClosedError, NodeTimeoutError, ProtocolError, PSNodeError
from psnode.log import logger, setup_logging
from psnode.node import data_lanes
from psnode.node.control import CONTROL_CMDS, FailureLatch, SchedulerLink
from psnode.node.futures import is_done
from psnode.node.membership import SCHEDULER, Membership, PeerInfo, host_fingerprint, on_this_host
from psnode.node.protocol import GROUP_ROLES, Cmd, Group, parse_group, unpack_header
from psnode.node.timeline import open_timeline
from psnode.transport import message_heap, same_host, streams
from psnode.transport.base import Transport, node_transport
from psnode.transport.lanes import MAGIC as LANE_MAGIC, Lanes
from psnode.transport.security import secure_or_loopback

__all__ = ["Connection", "Deferred", "DataHandler"]

_IDLE_DELAY = 0.0002  # how long deferred work waits for a message to ride along with before it runs
_BATCH = 256  # messages handled between two heartbeat checks
_BATCH_SECONDS = 0.5  # and at most this long: a batch of heavy messages (an init of 4,096 keys each) must not starve them
_HELD_LIMIT = 4096  # collective messages kept while the workers' addresses are asked for
_EARLY_LIMIT = 256  # messages of workers started again alone, kept until the scheduler says who they are
_OPENING_THREADS = 32  # a worker's streams to its servers opened at once at most

DataHandler = Callable[[PeerInfo, int, int, int, int, list], None]
"""``handle(peer, cmd, flags, req_id, arg, frames)``: a data message from a peer of the job.

It raises ``ProtocolError`` (or IndexError, KeyError, TypeError, ValueError) for a message it cannot
use; the loop counts and drops that message."""

class Deferred(Protocol):
    """Work a node holds back to send with a later message (the server's push acknowledgements).

    ``due``: the monotonic time by which ``run`` must happen anyway (None: no deadline);
    ``when_idle``: run it as soon as no message arrived for a moment.
    """

    due: float | None
    when_idle: bool

    def run(self) -> None:
        """Send what was held back."""


class Connection:
    """One server's or worker's connection to the job (see the module docstring).

    ``handle`` receives the peers' data messages, ``after_batch`` is called after each batch of
    them, ``deferred`` is held-back work (optional); ``on_worker_finished(rank, description)``
    hears that a worker left the job, ``on_worker_rejoined(rank)`` that a restarted one took its
    rank back.
    """

    def __init__(self, env: NodeEnv, role: str, handle: DataHandler, transport: Transport | None = None,
                 after_batch: Callable[[], None] | None = None, deferred: Deferred | None = None,
                 on_worker_finished: Callable[[int, str], None] | None = None,
                 on_worker_rejoined: Callable[[int], None] | None = None) -> None:
        setup_logging(env.verbose)
        env.bind_cpus()  # PSLAUNCH_CPU_BIND: before this node starts its threads
        self.env = env
        if role != "scheduler" and env.malloc_tuning and (env.same_host != "shm" or not env.local):
            # big messages (gradients, ring segments) may come through ZeroMQ: no page faults per message
            message_heap.keep_message_memory()
        host = env.advertised_host()
        secure_or_loopback(env, {"DMLC_NODE_HOST / the advertised address": host})
        self.transport = transport or node_transport(env, b"")
        job = re.sub(r"[^A-Za-z0-9_.-]", "_", env.job_id)[:40]
        local_name = f"{job}-{role}-{os.getpid()}-{os.urandom(3).hex()}"
        port = self.transport.bind(0, local_name, None if env.bind_all else host)
        self.probe = same_host.probe(env.job_id) if env.same_host == "shm" else None
        uid = f"{role}@{host}:{port}"
        self.transport.identity = uid.encode()
        self.lanes = self._open_lanes(role, host, uid)
        data_listener = self._open_data_lanes(role, host, uid)
        # a server's port for its workers' streams (psnode.transport.streams); a worker opens them
        self.stream_listener = self._listen_lanes(role, host, uid, "workers' streams", magic=streams.MAGIC) if (
            role == "server" and self._streams_wanted(role)) else None
        # and its Unix socket for those of workers on its host (no TCP stack: 12% off a small round trip)
        stream_socket = f"pslaunch-streams-{local_name}"
        self.local_streams = self._listen_local_streams(uid, stream_socket) if (
            self.stream_listener is not None and env.same_host in ("ipc", "shm")) else None
        self.me = PeerInfo(role, -1, host, port, uid, host_fingerprint(), local_name,
                           self.probe.ref if self.probe is not None else 0, os.getpid(),
                           self.lanes.port if self.lanes is not None else 0,
                           data_listener.port if data_listener is not None else 0,
                           self.stream_listener.port if self.stream_listener is not None else 0,
                           stream_socket if self.local_streams is not None else "")
        self.members = Membership(role)
        self.members.left = set(range(env.workers_at_start, env.num_workers))  # ranks an elastic job may give joiners
        self.failure = FailureLatch()
        self.link = SchedulerLink(env, self.transport, self.me, self.members, self.failure, on_worker_finished,
                                  on_worker_rejoined)
        # PSLAUNCH_TIMELINE: this node's events (psnode.node.timeline); None when off, and nothing is wrapped
        self.timeline = self.link.timeline = open_timeline(env, role)
        self._handle = handle
        self._after_batch = after_batch
        self._deferred = deferred
        self._next_heartbeat = 0.0
        self._held: list[tuple[bytes, list]] = []  # collectives of workers not in the book yet (``dispatch``)
        self._early: list[tuple[float, bytes, list]] = []  # a restarted worker's, before its WORKER_REJOINED came
        # big pushes and pull replies on TCP streams of their own (psnode.node.data_lanes); None: all on ZeroMQ
        self.data_lanes: data_lanes.DataLanes | None = None
        if data_listener is not None:
            self.data_lanes = data_lanes.DataLanes(data_listener, self.transport, self.members, self.me,
                                                   env.same_host, env.max_message, self.link.note_malformed)
            self.data_lanes.start()
        if self._streams_wanted(role):
            self.transport.stream_refused = lambda peer, why: self.link.note_malformed(peer, ProtocolError(why))
            for listener in (self.stream_listener, self.local_streams):  # a server's: over TCP, on this host
                if listener is not None:
                    listener.serve(self, self._stream_known)
            if role == "worker":
                self.link.on_connected = self._open_streams

    def _open_lanes(self, role: str, host: str, uid: str) -> Lanes | None:
        """A worker's lanes for big collective messages (``psnode.transport.lanes``), or None: not a worker, lanes
        off (``PSLAUNCH_LANES``), encrypted connections (a lane's bytes are in the clear), a transport
        other than ZeroMQ, or a port that cannot be bound (said in the log)."""
        env = self.env
        if role != "worker" or not env.lanes or env.encrypt or env.transport != "zmq":
            return None
        return self._listen_lanes(role, host, uid, "collectives")

    def _open_data_lanes(self, role: str, host: str, uid: str) -> Lanes | None:
        """The listening side of this node's data lanes (``psnode.node.data_lanes``), or None: not
        wanted in this job (``data_lanes.wanted``), a transport without another way in, or a port
        that cannot be bound (said in the log)."""
        if not data_lanes.wanted(self.env, role) or not hasattr(self.transport, "inject"):
            return None
        return self._listen_lanes(role, host, uid, "big pushes and pull replies", in_order=True)

    def _streams_wanted(self, role: str) -> bool:
        """Whether this node's messages to and from its servers or workers go on streams
        (``psnode.transport.streams``): a worker or server over ZeroMQ, ``PSLAUNCH_STREAMS`` on, connections
        not encrypted (a stream's bytes are in the clear), a job that needs no order across two ways
        (``data_lanes.needs_one_way``)."""
        env = self.env
        return (role in ("worker", "server") and env.streams and not env.encrypt and env.transport == "zmq"
                and hasattr(self.transport, "adopt_stream") and not data_lanes.needs_one_way(env))

    def _stream_known(self, uid: bytes) -> PeerInfo | None:
        peer = self.members.peers.get(uid)
        return peer if peer is not None and peer.role == "worker" else None

    def adopt(self, peer: PeerInfo, sock: Any) -> None:
        """A worker's stream, its handshake done (the stream listener's thread): the transport carries
        that worker's messages on it from now on."""
        self.transport.adopt_stream(peer.uid.encode(), sock)

    def _open_streams(self, peers: list[PeerInfo]) -> None:
        """Open this worker's streams to the servers among ``peers`` that take them, all at once (before
        this worker sends them anything: their messages then keep one order; a server that does not
        answer costs one connect timeout, not one each). One that cannot be opened is said in the log,
        and that server's messages go through ZeroMQ."""
        servers = [peer for peer in peers if peer.role == "server" and peer.stream_port]
        if not servers:
            return
        with ThreadPoolExecutor(max_workers=min(_OPENING_THREADS, len(servers))) as pool:
            opened = list(pool.map(self._open_stream, servers))
        for peer, sock in zip(servers, opened):
            if sock is not None:
                self.transport.adopt_stream(peer.uid.encode(), sock)

    def _open_stream(self, peer: PeerInfo) -> Any:
        """This worker's stream to server ``peer``, or None (said in the log): on the server's Unix
        socket when the two share a host (``on_this_host``), else, or when that fails, over TCP."""
        env = self.env
        proof = (env.security().lane_key(), env.job_id.encode(), self.me.uid.encode(), peer.uid.encode())
        if peer.stream_socket and on_this_host(peer, self.me.fingerprint, env.same_host):
            try:
                return streams.connect_stream("\0" + peer.stream_socket, *proof)
            except (OSError, EOFError, ProtocolError) as exc:
                logger.info("%s has no stream to %s on its Unix socket (%s); trying TCP", self.describe(),
                            peer.describe(), exc)
        try:
            return streams.connect_stream((peer.host, peer.stream_port), *proof)
        except (OSError, EOFError, ProtocolError) as exc:
            logger.warning("%s has no stream to %s (port %d: %s); their messages go through ZeroMQ", self.describe(),
                           peer.describe(), peer.stream_port, exc)
            return None

    def _listen_lanes(self, role: str, host: str, uid: str, what: str, in_order: bool = False,
                      magic: bytes = LANE_MAGIC) -> Lanes | None:
        """Lanes for ``what`` listening on ``host`` (``Lanes.listen``), or None when the port cannot be
        bound: said in the log, and ``what`` then goes through ZeroMQ."""
        env = self.env
        try:
            return Lanes.listen("" if env.bind_all else host, uid.encode(), env.job_id, env.security().lane_key(),
                                what=what, in_order=in_order, magic=magic)
        except OSError as exc:
            logger.warning("this %s has no lanes for %s (cannot listen on %s: %s); they go through ZeroMQ",
                           role, what, host, exc)
            return None

    def _listen_local_streams(self, uid: str, name: str) -> Lanes | None:
        """A server's listener for the streams of workers on its host, on the abstract Unix socket
        ``name`` (``Lanes.listen_local``), or None where there is none (said in the log at
        ``PS_VERBOSE=1``: those workers then open theirs over TCP)."""
        env = self.env
        try:
            return Lanes.listen_local(name, uid.encode(), env.job_id, env.security().lane_key(),
                                      what="workers' streams", magic=streams.MAGIC)
        except OSError as exc:
            logger.info("this server takes its workers' streams over TCP only (no Unix socket %r: %s)", name, exc)
            return None

    def close(self, linger: float) -> None:
        """Close the transport (``linger`` seconds for what it still holds) and the lanes."""
        if self.lanes is not None:
            self.lanes.close()
        if self.data_lanes is not None:
            self.data_lanes.lanes.close()
        if self.stream_listener is not None:
            self.stream_listener.close()
        if self.local_streams is not None:
            self.local_streams.close()
        self.transport.close(linger=linger)

    def serve_with(self, after_batch: Callable[[], None] | None = None, deferred: Deferred | None = None) -> None:
        """Set ``after_batch`` and ``deferred`` (for parts built after the connection, which they use)."""
        self._after_batch = after_batch
        self._deferred = deferred

    @property
    def rank(self) -> int:
        """This node's rank (-1 until registered)."""
        return self.members.rank

    def describe(self) -> str:
        """``worker 1``: how this node names itself in errors."""
        return f"{self.me.role} {self.members.rank}"

    def register(self) -> None:
        """Register with the scheduler, wait for the address book, connect to the peers (blocking).

        Raises:
            RegistrationTimeoutError, TransportError: see ``SchedulerLink.register``.
        """
        timeline = self.timeline
        start = timeline.now() if timeline is not None else 0
        early = self.link.register()
        if timeline is not None:
            timeline.add("register", None, start, timeline.now())
            timeline.name_process(self.members.rank, self.me.host)
        for sender, frames in early:
            self.dispatch(sender, frames)

    # ---- the loop ------------------------------------------------------------------------
    def process(self, timeout: float, until: Any = None) -> None:
        """Handle messages for up to ``timeout`` seconds (returns after the first batch); keep heartbeats.

        ``until``: a future; the batch ends as soon as it is done (a waiting caller returns at once).
        """
        now = time.monotonic()
        wait = timeout
        if now >= self._next_heartbeat:
            self._next_heartbeat = self.link.tick(now)
        if self._next_heartbeat < now + wait:
            wait = max(0.0, self._next_heartbeat - now)
        transport = self.transport
        deferred = self._deferred
        if deferred is not None:
            due = deferred.due
            if due is not None:
                if now >= due:
                    deferred.run()  # held-back work whose time is up, whether messages come or not
                else:
                    wait = min(wait, due - now)
            if deferred.when_idle and not transport.poll(min(wait, _IDLE_DELAY)):
                deferred.run()  # nothing came for a moment: send what was held back to share a message
                return
        if not transport.poll(wait):
            return
        failure = self.failure
        try:
            # drain what is queued, but let heartbeats run between batches; a caller waiting for
            # ``until`` returns once it is done
            ends = now + _BATCH_SECONDS
            for _ in range(_BATCH):
                sender, frames = transport.recv()
                self.dispatch(sender, frames)
                if failure.error is not None or (until is not None and is_done(until)) or not transport.poll(0):
                    break
                if time.monotonic() > ends:
                    break
        finally:
            if self._after_batch is not None:
                self._after_batch()

    def dispatch(self, sender: bytes, frames: list) -> None:
        """Give one received message to the scheduler link or the data handler; drop what cannot be used."""
        link = self.link
        try:
            cmd, flags, req_id, arg = unpack_header(frames[0])
        except (ProtocolError, IndexError) as exc:
            link.note_malformed(sender, exc)
            return
        if self.env.verbose >= 2:
            logger.debug("%s <- %s: %s req %d (%d frames)", self.describe(), sender.decode(errors="replace"),
                         Cmd(cmd).name, req_id, len(frames))
        if sender == SCHEDULER:
            link.heard()
            if cmd in CONTROL_CMDS:
                try:
                    link.handle(cmd, flags, req_id, frames, arg)
                except (ProtocolError, IndexError, KeyError, TypeError, ValueError) as exc:
                    link.note_malformed(sender, exc)
                if cmd == Cmd.PEERS_REPLY and self._held:  # the workers are known now: what they sent
                    held, self._held = self._held, []
                    for early_sender, early_frames in held:
                        self.dispatch(early_sender, early_frames)
                if cmd in (Cmd.WORKER_REJOINED, Cmd.WORKER_JOINED) and self._early:
                    self._take_early()
                return
        peer = self.members.peers.get(sender)
        if peer is None:
            if cmd == Cmd.COLL and not self.members.complete and len(self._held) < _HELD_LIMIT:
                # a worker's collective before this worker asked for the workers' addresses: ask now,
                # and take the message once they came (every member is authenticated by the transport)
                self._held.append((sender, frames))
                link.ask_workers()
                return
            if ((self.env.restart_scope == "worker" or self.env.elastic) and sender.startswith(b"worker@")
                    and len(self._early) < _EARLY_LIMIT):
                # A worker started again alone (or joining an elastic job) gets its address book while
                # this node gets WORKER_REJOINED (WORKER_JOINED): its first request may come first. Kept until then.
                self._early.append((time.monotonic(), sender, frames))
                return
            link.note_malformed(sender, ProtocolError(f"message {Cmd(cmd).name} from an unknown sender"))
            return
        try:
            self._handle(peer, cmd, flags, req_id, arg, frames)
        except ClosedError:
            raise
        except Exception as exc:  # a message from the network must never end the node: count it, go on
            link.note_malformed(sender, exc)

    def _take_early(self) -> None:
        """A worker rejoined: handle what it sent before this node knew it; keep what other senders
        sent a while longer (their notices may be on the way), and drop what waited a heartbeat
        timeout, as messages from an unknown sender."""
        early, self._early = self._early, []
        now, limit = time.monotonic(), max(5.0, self.env.heartbeat_timeout)
        for since, sender, frames in early:
            if self.members.peers.get(sender) is not None:
                self.dispatch(sender, frames)
            elif now - since < limit:
                self._early.append((since, sender, frames))
            else:
                self.link.note_malformed(sender, ProtocolError("a message from an unknown sender"))

    def ask_barrier(self, group: "Group | int | str", note: Any = None,
                    number: int | None = None) -> tuple[concurrent.futures.Future, str]:
        """Enter a barrier of ``group`` (workers, servers or all): the future its end completes, and
        what to call it in a timeout message. ``note`` (a small JSON value) reaches every member: the
        future's result is the list of the members' notes that are not None.

        Liveness-checked: a node of the job that dies meanwhile fails the future naming that node.

        Raises:
            ValueError: an unknown group (the message lists the groups).
            PSNodeError: this node is not in ``group``; the node's failure, if it failed.
        """
        group = parse_group(group)
        if self.me.role not in GROUP_ROLES[group]:
            raise PSNodeError(f"{self.describe()} is not in the barrier group {group.name.lower()}")
        self.failure.check()
        body: dict[str, Any] | None = None if note is None else {"note": note}
        if self.link.number_barriers:  # a replacement in place redoes some: numbered, they are answered at once
            if number is None:  # the next; else a set-up barrier redone by its predecessor's number
                number = self.link.barrier_counts.get(int(group), 0) + 1
                self.link.barrier_counts[int(group)] = number
            body = {**(body or {}), "n": number}
        return self.link.ask(Cmd.BARRIER, int(group), body), f"end of the {group.name.lower()} barrier"

    def wait(self, future: concurrent.futures.Future, limit: float | None, what: str) -> None:
        """Receive on this thread until ``future`` is done (single-threaded nodes), then raise its error.

        Raises:
            PSNodeError: the node failed; NodeTimeoutError: not done within ``limit`` seconds.
        """
        deadline = None if limit is None else time.monotonic() + limit
        while not future.done():
            self.failure.check()
            step = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if step <= 0:
                raise NodeTimeoutError(f"{self.describe()}: no {what} within {limit:g} s")
            self.process(step)
        future.result()
