"""The scheduler: registration, ranks, the address book, barriers, liveness and orderly shutdown.

It listens on ``DMLC_PS_ROOT_PORT``. Every server and worker registers; once all of them have
(within ``PSLAUNCH_REGISTER_TIMEOUT``) ranks are given (``DMLC_WORKER_ID`` when a worker has one,
the rest ordered by (host, port)) and every node gets the address book. Then it answers heartbeats
and barriers, and watches: a node silent for ``PS_HEARTBEAT_TIMEOUT`` (or one that reports its own
failure) is announced to every other node as dead, naming its role, rank and host, and the
scheduler fails (with ``PSLAUNCH_RESTART_SCOPE=worker`` a dead worker is not announced: its rank
waits for the worker pslaunch starts again, which registers late and takes it back, ``_rejoin``).
When every worker has finished, the servers are told to shut down and the scheduler ends.

Parts: the ``Roster`` (who registered, their ranks and liveness) and the ``Barriers`` (who waits
in which group), both in ``roster``, the ``BarrierDesk`` (``barrier_desk``: barrier messages, their answers,
barriers that cannot end or that stall), the ``JobReport`` (``report``: the stats line for pslaunch, the timeline)
and the ``Scheduler`` façade that reads messages and drives them; it keeps each node's latest
heartbeat counters, checked as untrusted input (``stats.check_body``). Peers are described
and reached with ``membership.PeerInfo`` and ``endpoint_of``, as every node does. Single-threaded.
"""

from __future__ import annotations

import time

from psnode.env import MARKER_CAUGHT_UP, MARKER_RESUMED, NodeEnv, resolve_host
from psnode.errors import PeerDiedError, ProtocolError, PSNodeError, RegistrationTimeoutError, TransportError
from psnode.log import logger, setup_logging
from psnode.node.membership import SCHEDULER, PeerInfo, endpoint_of, host_fingerprint, unreachable
from psnode.node.protocol import FLAG_ERROR, Cmd, pack_header, pack_json, unpack_header, unpack_json
from psnode.node.stats import check_body, stderr_line
from psnode.scheduler.barrier_desk import BarrierDesk
from psnode.scheduler.comeback import Comeback, back_body
from psnode.scheduler.elastic import Elastic, ElasticError
from psnode.scheduler.ledger import Answer, Ledger
from psnode.scheduler.rendezvous import Rendezvous
from psnode.scheduler.report import JobReport
from psnode.scheduler.roster import Barriers, Member, Roster
from psnode.transport.base import Transport, node_transport
from psnode.transport.security import secure_or_loopback

__all__ = ["Scheduler", "Roster", "Barriers"]

#: The roles that hold keys: servers, and their replicas (PSLAUNCH_SERVER_REPLICAS).
_HOLDERS = ("server", "replica")
#: Seconds a server's (or replica's) connection stays closed before it counts as lost: a process that
#: died closes its sockets at once, and a connection that only blinked comes back within ZeroMQ's
#: reconnect interval (0.1 s).
_LOST_AFTER = 0.3

class Scheduler:
    """One job's scheduler. ``run()`` returns the process exit code (0: every worker finished)."""

    def __init__(self, env: NodeEnv, transport: Transport | None = None) -> None:
        setup_logging(env.verbose)
        env.bind_cpus()  # PSLAUNCH_CPU_BIND: before this node starts its threads
        self.env = env
        secure_or_loopback(env, {})
        # Nodes' advertised TCP addresses are tried before the address book goes out when the
        # scheduler runs the TCP transport itself (an injected one may not use those addresses).
        self._probe_tcp = transport is None and env.transport == "zmq"
        self.transport = transport or node_transport(env, SCHEDULER)
        self.transport.bind(env.root_port, None, None if env.bind_all else resolve_host(env.root_uri, "DMLC_PS_ROOT_URI"))
        self.fingerprint = host_fingerprint()
        self.roster = Roster(env.workers_at_start, env.num_servers, env.job_id, env.root_port, env.job_id_from,
                             env.server_replicas)
        self.rendezvous = Rendezvous()
        self.ledger = Ledger()
        self.malformed = 0
        self._last_check = 0.0  # when _check_alive last ran
        self.job_report = JobReport(env, self.fingerprint)  # PSLAUNCH_STATS, PSLAUNCH_TIMELINE
        self.desk = BarrierDesk(env, self.transport, self.roster, self.job_report)  # barriers: arrivals, answers, stalls
        self.barriers = self.desk.barriers
        self._books: dict[str, bytes | None] = {}  # encoded address book lists by role (``_book``)
        self._pending_joins: list[tuple[bytes, list]] = []  # replicas joining while a server's connection is down
        self.elastic = Elastic(env)  # PSLAUNCH_MIN_WORKERS: workers that leave or join the running job
        self._early_joins: list[tuple[bytes, list]] = []  # workers beyond PSLAUNCH_START_WORKERS, before the job formed

    # ---- registration -------------------------------------------------------------------
    def register(self) -> None:
        """Wait for every node, give ranks, send the address book.

        Raises:
            RegistrationTimeoutError: not every node registered in time (the message names what is missing).
            PSNodeError: two workers asked for the same DMLC_WORKER_ID.
        """
        env, roster = self.env, self.roster
        deadline = time.monotonic() + env.register_timeout
        while not roster.complete():
            self.job_report.tell(roster.members.values())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                message = (f"registration timed out after {env.register_timeout:g} s (PSLAUNCH_REGISTER_TIMEOUT): "
                           f"{roster.missing(f'with the scheduler at {env.root_address}')}")
                self._refuse_all(message, "timeout")
                raise RegistrationTimeoutError(message)
            if not self.transport.poll(min(remaining, 0.5)):
                continue
            sender, frames = self.transport.recv()
            try:
                cmd, _, _, _ = unpack_header(frames[0])
                if cmd != Cmd.REGISTER:
                    continue  # heartbeats of early nodes: registration answers them all
                info = unpack_json(frames[1])
                if not isinstance(info, dict):
                    raise ProtocolError(f"a registration body that is a {type(info).__name__}, not an object")
                if info.get("rejoin") is True and env.restart_scope == "worker" and not roster.members:
                    self._recover(sender, info, deadline)  # started in place: the job's nodes come back
                    return
                if (env.elastic and info.get("role") == "worker" and sender not in roster.members
                        and roster.count("worker") >= roster.expected["worker"]):
                    self._early_joins.append((sender, frames))  # more than the job starts with: it joins once formed
                    continue
                refusal = roster.add(sender, info)
                if refusal is not None:
                    self._send_once(sender, PeerInfo.from_record({**info, "rank": -1}), Cmd.REGISTER_FAILED,
                                    {"error": refusal})
                    logger.info("scheduler: %s", refusal)
            except (ProtocolError, IndexError, KeyError, TypeError, ValueError) as exc:
                self.malformed += 1
                logger.info("scheduler dropped a malformed registration from %r: %s", sender[:64], exc)
        try:
            roster.assign_ranks()
            self._check_reachable()
        except PSNodeError as exc:
            self._refuse_all(str(exc))
            raise
        for uid, member in roster.members.items():
            self.transport.connect(uid, endpoint_of(member.peer, self.transport, self.fingerprint, env.same_host))
            if (env.server_replicas and member.peer.role in _HOLDERS) or (env.elastic and member.peer.role == "worker"):
                self.transport.watch_liveness(uid)  # its end is seen at once (``_lost_servers``), not after heartbeats
        for uid, member in roster.members.items():
            member.last_seen = time.monotonic()
            self.transport.send(uid, [pack_header(Cmd.ADDRBOOK), self._book(member)])
        self.job_report.registered()
        logger.info("scheduler: %d servers and %d workers registered", env.num_servers, roster.expected["worker"])
        early, self._early_joins = self._early_joins, []
        for sender, frames in early:
            self._dispatch(sender, frames)
        if env.restart_count and env.restart_scope == "worker":
            self._tell_launcher_back()  # started in place before the job had formed: its nodes registered now

    def _recover(self, sender: bytes, info: dict | None, deadline: float) -> None:
        """This scheduler was started again in place (PSLAUNCH_RESTART_SCOPE=worker) while the job ran:
        take its nodes back (``comeback.Comeback``), then answer each with ``SCHEDULER_BACK``: they send
        again what they had asked, and what the scheduler keeps for the job (ledger entries,
        rendezvous values).

        Raises:
            RegistrationTimeoutError: not every rank came back in time (the message names the missing).
        """
        env, roster = self.env, self.roster
        comeback = Comeback()
        logger.warning("scheduler: started again in place; taking the job's nodes back")
        while True:
            if info is not None and info.get("rejoin") is not True:  # its address book was lost with the scheduler
                comeback.hold_unranked(roster, sender, info)
                info = None
            if info is not None:
                try:
                    member = comeback.take(roster, sender, info)
                    if member is not None:
                        self.transport.connect(sender, endpoint_of(member.peer, self.transport, self.fingerprint,
                                                                   env.same_host))
                except (ProtocolError, PSNodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                    self.malformed += 1
                    logger.info("scheduler dropped a registration from %r while taking the job back: %s", sender[:64],
                                exc)
                info = None
            for uid, member in comeback.rank_unranked(roster):
                logger.warning("scheduler: %s came without a rank (its address book was lost with the scheduler "
                               "before); it gets the rank the others' books give it", member.peer.describe())
                self.transport.connect(uid, endpoint_of(member.peer, self.transport, self.fingerprint, env.same_host))
            now = time.monotonic()
            if comeback.over(roster, now):
                break
            if now > deadline:
                raise RegistrationTimeoutError(
                    f"the scheduler started in place took {len(roster.members)} nodes back within "
                    f"{env.register_timeout:g} s (PSLAUNCH_REGISTER_TIMEOUT); missing: {', '.join(comeback.missing(roster))}")
            if not self.transport.poll(0.05):
                continue
            sender, frames = self.transport.recv()
            try:
                if unpack_header(frames[0])[0] == Cmd.REGISTER:
                    info = unpack_json(frames[1])
                    if not isinstance(info, dict):
                        raise ProtocolError("a registration that is not an object")
            except (ProtocolError, IndexError) as exc:
                self.malformed += 1
                logger.info("scheduler dropped a message while taking the job back: %s", exc)
                info = None
        comeback.close(roster, self.barriers)
        body = back_body(comeback.completed)
        self._books.clear()
        for uid, member in roster.members.items():
            member.last_seen = time.monotonic()
            if uid in comeback.ranked:  # it never had its book: the one the scheduler before sent the others
                self.transport.send(uid, [pack_header(Cmd.ADDRBOOK), self._book(member)])
                continue
            if member.info.get("rejoin") is not True:
                continue  # a worker that finished and left: a place-holder
            if env.server_replicas and member.peer.role in _HOLDERS:
                self.transport.watch_liveness(uid)
            self.transport.send(uid, [pack_header(Cmd.SCHEDULER_BACK), body])
        self.job_report.registered()
        logger.warning("scheduler: took the job back: %d nodes, %d workers finished before", len(roster.members),
                       len(comeback.finished))
        self._tell_launcher_back()

    def _tell_launcher_back(self) -> None:
        """pslaunch's record of this scheduler started in place: the job's nodes are with it from now on."""
        if self.env.supervised:
            stderr_line(f"{MARKER_RESUMED} {{\"mark\": null, \"scalars\": null}}")
            stderr_line(MARKER_CAUGHT_UP)

    def _join_replica(self, sender: bytes, frames: list) -> bool:
        """A replica registering while the job runs (a lost server's or replica's process started again):
        it backs the server with the fewest replicas (one on another host first), gets a book with the
        workers and that server (``late``), the server is told to send it its keys once every worker
        marked where its copies begin (``REPLICA_JOINING``), and the workers to copy to it from there
        (``REPLICA_JOINED``: psnode.server.snapshot). False when the registration is no such replica's.

        Raises:
            ProtocolError: a malformed registration (counted and dropped by the caller).
        """
        info = unpack_json(frames[1]) if len(frames) > 1 else None
        if not isinstance(info, dict) or info.get("role") != "replica" or info.get("rejoin") is True:
            return False
        if self.transport.down() and len(self._pending_joins) < 64:
            # a server's connection is closed: until it is back or called lost, the replica waits (it must not
            # be given the keys of a server that is gone)
            self._pending_joins.append((sender, frames))
            return True
        joined = self.roster.join_replica(sender, info)
        if joined is None:
            return False
        member, (server_uid, server) = joined
        peer, rank, members = member.peer, member.peer.rank, self.roster.members
        self._books.clear()
        self.transport.connect(sender, endpoint_of(member.peer, self.transport, self.fingerprint, self.env.same_host))
        self.transport.watch_liveness(sender)
        nodes = [m.peer.as_record() for m in members.values() if m.peer.role == "worker" and not m.finished]
        book = b'{"rank":%d,"nodes":%s,"late":true}' % (rank, pack_json(nodes + [server.peer.as_record()]))
        self.transport.send(sender, [pack_header(Cmd.ADDRBOOK), book])
        record = member.peer.as_record()
        self.transport.send(server_uid, [pack_header(Cmd.REPLICA_JOINING), pack_json({"node": record})])
        note = pack_json({"rank": rank, "node": record})
        for uid, other in members.items():
            if other.peer.role == "worker" and not other.finished:
                self.transport.send(uid, [pack_header(Cmd.REPLICA_JOINED), note])
        logger.warning("scheduler: %s:%d (pid %s) joined the job as a replica of server %d; it gets that server's "
                       "keys once every worker marked where its copies begin", peer.host, peer.port, info.get("pid"),
                       rank)
        return True

    def _back_again(self, sender: bytes, frames: list) -> bool:
        """A node registering again with its rank (``rejoin``: it saw the scheduler's connection end) once
        this scheduler runs: taken back if it is not known (a replica that came late), and answered
        ``SCHEDULER_BACK`` (again: its first answer may have crossed its next try). False when the
        registration is no such node's."""
        try:
            info = unpack_json(frames[1]) if len(frames) > 1 else None
        except ProtocolError as exc:
            self.malformed += 1
            logger.info("scheduler dropped a malformed registration from %r: %s", sender[:64], exc)
            return True
        if not isinstance(info, dict) or info.get("rejoin") is not True or self.env.restart_scope != "worker":
            return False
        try:
            member = self.roster.take_back(sender, info)
        except PSNodeError as exc:
            logger.info("scheduler: %s", exc)
            return True
        if member is not None:
            self.transport.connect(sender, endpoint_of(member.peer, self.transport, self.fingerprint,
                                                       self.env.same_host))
            if self.env.server_replicas and member.peer.role in _HOLDERS:
                self.transport.watch_liveness(sender)
            self._books.clear()
        self.transport.send(sender, [pack_header(Cmd.SCHEDULER_BACK), back_body(self.barriers.completed)])
        return True

    def _book(self, member: Member, rejoined: bool = False, extra: bytes = b"") -> bytes:
        """``member``'s address book: who it must reach. A server gets the workers (it answers and
        connects to them); a worker the servers, and the other workers only in a job without
        servers (its collectives are its work); in a job with servers a worker that runs
        collectives asks for them (``PEERS``). So the books of a job hold O(nodes x servers)
        records, not O(nodes^2). Each role's list is encoded once, not once per node."""
        role = member.peer.role
        if self._books.get(role) is None:
            wanted = (("worker",) if role in _HOLDERS else ("server", "replica") if self.env.num_servers
                      else ("server", "worker"))
            self._books[role] = pack_json([m.peer.as_record() for m in self.roster.members.values()
                                           if m.peer.role in wanted])
        more = b',"workers":"on-request"' if role == "worker" and self.env.num_servers else b""
        extra += b',"rejoined":true' if rejoined else b""
        return b'{"rank":%d,"nodes":%s%s%s}' % (member.peer.rank, self._books[role], more, extra)

    def _peers(self, sender: bytes, req_id: int) -> None:
        """Answer a worker's PEERS: every worker's record (encoded once until a worker rejoins)."""
        if self._books.get("workers") is None:
            self._books["workers"] = pack_json({"nodes": [m.peer.as_record() for m in self.roster.members.values()
                                                          if m.peer.role == "worker"]})
        self.transport.send(sender, [pack_header(Cmd.PEERS_REPLY, req_id), self._books["workers"]])

    def _check_reachable(self) -> None:
        """Every node's advertised address must be reachable from here, or the address book would
        never arrive there (and the node would look dead): say which address, and what to set.

        Raises:
            PSNodeError: naming each node that cannot be reached, its address and why.
        """
        if not self._probe_tcp:
            return
        peers = [m.peer for m in self.roster.members.values()]
        found = unreachable(peers, self.fingerprint, self.env.same_host, min(5.0, max(1.0, self.env.heartbeat_timeout)))
        if found:
            (first, why), *others = sorted(found, key=lambda f: (f[0].role, f[0].rank))
            also = ", ".join(f"{p.role} {p.rank} at {p.host}:{p.port} ({w})" for p, w in others[:5])
            more = f" and {len(others) - 5} more" if len(others) > 5 else ""
            raise PSNodeError(
                f"{first.role} {first.rank} advertised {first.host}:{first.port}, which the scheduler at "
                f"{self.env.root_uri} cannot reach ({why})" + (f"; nor {also}{more}" if others else "")
                + "; set --interface (DMLC_INTERFACE) to an interface on a network the scheduler is on")

    def _send_once(self, uid: bytes, peer: PeerInfo, cmd: int, body: dict) -> None:
        try:
            self.transport.connect(uid, f"tcp://{peer.host}:{peer.port}")
            self.transport.send(uid, [pack_header(cmd), pack_json(body)])
        except PSNodeError as exc:
            logger.info("scheduler could not tell %s: %s", uid, exc)

    def _refuse_all(self, message: str, kind: str = "refused") -> None:
        for uid, member in self.roster.members.items():
            self._send_once(uid, member.peer, Cmd.REGISTER_FAILED, {"error": message, "kind": kind})

    # ---- serving -------------------------------------------------------------------------
    def serve(self) -> None:
        """Answer heartbeats and barriers until every worker finished; then shut the servers down.

        Raises:
            PeerDiedError: a node died (every other node has been told).
        """
        env = self.env
        tick = 0.5 if env.heartbeat_interval <= 0 else min(0.5, env.heartbeat_interval / 2)
        if env.server_replicas:  # a lost server is looked for every tick: its replica takes over that much sooner
            tick = min(tick, 0.05)
        self._last_check = time.monotonic()
        while not self.roster.all_workers_finished():
            self.job_report.tell(self.roster.members.values())
            if self.transport.poll(tick):
                for _ in range(256):
                    sender, frames = self.transport.recv()
                    self._dispatch(sender, frames)
                    if not self.transport.poll(0):
                        break
            if env.server_replicas:
                self._lost_servers()
                if self._pending_joins and not self.transport.down():
                    pending, self._pending_joins = self._pending_joins, []
                    for sender, frames in pending:
                        self._dispatch(sender, frames)
            if env.heartbeat_interval > 0:
                self._check_alive()
            if self.desk.stall_clock.on and self.barriers.opened:
                self.desk.say_stalls()
            if self.elastic.short_since is not None:
                self._check_elastic()
            if self.elastic.retry_at is not None and time.monotonic() >= self.elastic.retry_at:
                self.elastic.start_next(self)
            if env.elastic:
                self._lost_workers()
        self._shutdown_servers()

    def _dispatch(self, sender: bytes, frames: list) -> None:
        member = self.roster.members.get(sender)
        try:
            cmd, flags, req_id, arg = unpack_header(frames[0])
            if member is None and cmd == Cmd.REGISTER and self.env.server_replicas and self._join_replica(sender, frames):
                return
            if member is None and cmd == Cmd.REGISTER and self.env.restart_scope == "worker":
                if self._back_again(sender, frames):
                    return
                self._rejoin(sender, frames)
                return
            if member is None and cmd == Cmd.REGISTER and self.env.elastic:  # a worker joins the running job
                self.elastic.register(self, sender, frames)
                return
            if member is None:
                raise ProtocolError(f"{Cmd(cmd).name} from an unknown sender")
        except (ProtocolError, IndexError) as exc:
            self.malformed += 1
            logger.info("scheduler dropped a malformed message from %r: %s", sender[:64], exc)
            return
        member.last_seen = time.monotonic()
        if cmd == Cmd.HEARTBEAT:
            self._heartbeat(sender, member, req_id, frames)
        elif cmd == Cmd.BARRIER:
            self.desk.arrive(sender, member, req_id, arg, frames)
        elif cmd == Cmd.FINISH:
            self._read_body(member, frames)  # the worker's last counters
            self._finished(sender, member, req_id)
        elif cmd in (Cmd.RDV_SET, Cmd.RDV_GET):
            self._rendezvous(sender, cmd, req_id, frames)
        elif cmd in (Cmd.LEDGER_APPEND, Cmd.LEDGER_READ):
            self._ledger(sender, member, cmd, req_id, arg, frames)
        elif cmd == Cmd.PEERS and member.peer.role == "worker":
            self._peers(sender, req_id)
        elif cmd == Cmd.NODE_DIED:
            try:
                body = unpack_json(frames[1]) if len(frames) > 1 else {}
                reason = str(body.get("message", "it failed")) if isinstance(body, dict) else "it failed"
            except ProtocolError:
                reason = "it failed"
            self._announce_death(member, f"{member.peer.describe()} failed: {reason}")
        elif cmd == Cmd.LEAVE:  # an elastic job's worker leaves at a step boundary
            self.elastic.leave(self, sender, member, req_id)
        elif cmd in (Cmd.JOIN_ROUND, Cmd.JOIN_SCALARS):  # a server's answer to a freeze; a provider's scalars
            self._join_message(sender, member, cmd, frames)
        elif cmd == Cmd.REGISTER:  # a repeated registration is harmless; one coming back is answered again
            self._back_again(sender, frames)
        else:
            self.malformed += 1

    def _join_message(self, sender: bytes, member: Member, cmd: int, frames: list) -> None:
        """A message of a worker joining the elastic job (``psnode.scheduler.elastic``); one that
        cannot be used is counted and dropped."""
        try:
            if cmd == Cmd.JOIN_ROUND and member.peer.role == "server":
                self.elastic.round_reply(self, sender, frames)
            elif cmd == Cmd.JOIN_SCALARS and member.peer.role == "worker":
                self.elastic.scalars(self, member, frames)
            else:
                raise ProtocolError(f"{Cmd(cmd).name} from {member.peer.describe()}")
        except (ProtocolError, IndexError, AttributeError, TypeError) as exc:
            self.malformed += 1
            logger.info("scheduler dropped a malformed message from %s: %s", member.peer.describe(), exc)

    def _heartbeat(self, sender: bytes, member: Member, req_id: int, frames: list) -> None:
        """Answer a heartbeat; keep the counters it carries, answer a clock probe."""
        ack = [pack_header(Cmd.HEARTBEAT_ACK, req_id)]
        clock = self._read_body(member, frames)
        if clock is not None:
            ack.append(self.job_report.clock(clock))
        self.transport.send(sender, ack)

    def _read_body(self, member: Member, frames: list) -> int | None:
        """Keep the counters of a message's body on ``member`` and return its clock probe
        (``stats.check_body``). A malformed body is counted and dropped (the message still counts as
        heard: its sender is an authenticated member)."""
        if len(frames) < 2:
            return None
        try:
            report, clock = check_body(member.peer.role, frames[1])
        except ProtocolError as exc:
            self.malformed += 1
            logger.info("scheduler dropped a malformed message body from %s: %s", member.peer.describe(), exc)
            return None
        if report is not None:
            member.report = report
        return clock

    def _rendezvous(self, sender: bytes, cmd: int, req_id: int, frames: list) -> None:
        """Set a rendezvous value (answering who waited for it) or answer / park a request for one."""
        try:
            body = unpack_json(frames[1]) if len(frames) > 1 else None
            if cmd == Cmd.RDV_SET:
                value, answer = self.rendezvous.set(body)
                answer.append((sender, req_id))
            else:
                value = self.rendezvous.get(sender, req_id, body)
                if value is None:
                    return
                answer = [(sender, req_id)]
        except ProtocolError as exc:
            self.malformed += 1
            self.transport.send(sender, [pack_header(Cmd.RDV_VALUE, req_id, flags=FLAG_ERROR), pack_json({"error": str(exc)})])
            return
        for uid, rid in answer:
            self.transport.send(uid, [pack_header(Cmd.RDV_VALUE, rid), pack_json({"value": value})])

    def _ledger(self, sender: bytes, member: Member, cmd: int, req_id: int, arg: int, frames: list) -> None:
        """Append to a ledger log (worker 0 only; answering the reads parked on it) or answer / park
        a read of one (``psnode.scheduler.ledger``). A refusal is answered, never dropped: the asker waits."""
        reply = Cmd.LEDGER_ACK if cmd == Cmd.LEDGER_APPEND else Cmd.LEDGER_ENTRIES
        try:
            peer = member.peer
            if peer.role != "worker":
                raise ProtocolError(f"{peer.describe()} asked the ledger; only workers keep one")
            body = unpack_json(frames[1]) if len(frames) > 1 else None
            if cmd == Cmd.LEDGER_APPEND:
                if peer.rank != 0:
                    raise ProtocolError(f"{peer.describe()} may not append to the ledger; worker 0 writes it")
                if len(frames) != 3:
                    raise ProtocolError(f"a ledger append of {len(frames)} frames, expected 3 (header, body, entry)")
                index, answers = self.ledger.append(body, frames[2].buffer)
                self.transport.send(sender, [pack_header(Cmd.LEDGER_ACK, req_id, index)])
            else:
                answer = self.ledger.read(sender, req_id, body, arg)
                answers = [] if answer is None else [answer]
        except ProtocolError as exc:
            self.malformed += 1
            self.transport.send(sender, [pack_header(reply, req_id, flags=FLAG_ERROR), pack_json({"error": str(exc)})])
            return
        self._answer_reads(answers)

    def _answer_reads(self, answers: list[Answer]) -> None:
        for answer in answers:
            try:
                self.transport.send(answer.node, [pack_header(Cmd.LEDGER_ENTRIES, answer.req_id, answer.start),
                                                  pack_json({"end": answer.end}), *answer.entries])
            except TransportError as exc:  # the reader is gone: its death is told on its own
                logger.info("scheduler could not answer a ledger read: %s", exc)

    def _rejoin(self, sender: bytes, frames: list) -> None:
        """``PSLAUNCH_RESTART_SCOPE=worker``: a worker started again after it died takes its rank back.

        It gets the address book (marked ``rejoined``, so its store skips the set-up collectives the
        others passed long ago) and the servers learn its new address (``WORKER_REJOINED``), which
        also resets what they counted of its pushes. Barriers its predecessor had entered forget it.

        Raises:
            ProtocolError: a malformed registration (counted and dropped by the caller).
        """
        info = unpack_json(frames[1]) if len(frames) > 1 else None
        if not isinstance(info, dict):
            raise ProtocolError("a late registration without an object body")
        try:
            new, old = self.roster.replace(sender, info)
        except PSNodeError as exc:
            self._send_once(sender, PeerInfo.from_record({**info, "rank": -1}), Cmd.REGISTER_FAILED, {"error": str(exc)})
            logger.info("scheduler: %s", exc)
            return
        self.transport.connect(sender, endpoint_of(new.peer, self.transport, self.fingerprint, self.env.same_host))
        self._books.clear()  # a worker's address changed
        self.transport.send(sender, [pack_header(Cmd.ADDRBOOK), self._book(new, rejoined=True)])
        note = pack_json({"old": old.peer.uid, "node": new.peer.as_record()})
        for uid in self.roster.of_roles(_HOLDERS):
            self.transport.send(uid, [pack_header(Cmd.WORKER_REJOINED), note])
        old_uid = old.peer.uid.encode()
        self.barriers.forget(old_uid)
        logger.info("scheduler: worker %d rejoined from %s:%d (pid %s)", new.peer.rank, new.peer.host, new.peer.port,
                    info.get("pid"))

    def _finished(self, sender: bytes, member: Member, req_id: int) -> None:
        member.finished = True
        self.roster.any_finished = True
        self.transport.send(sender, [pack_header(Cmd.FINISH_ACK, req_id)])
        note = pack_json({"rank": member.peer.rank, "node": member.peer.describe()})
        # servers: rounds that still wait for this worker can never close; workers: nor can collectives.
        # Workers that finished hear it too: one that is still flushing its last collective messages
        # waits for no answer from a worker that finished (``WorkerNode._flush_collectives``). One may
        # be gone already: its note is dropped rather than queued (never waited for).
        frames = [pack_header(Cmd.WORKER_FINISHED), note]
        for uid in self.roster.of_roles(("server", "replica", "worker")):
            if uid == sender:
                continue
            if not self.roster.members[uid].finished:
                self.transport.send(uid, frames)
                continue
            try:
                self.transport.send(uid, frames, block=False)
            except TransportError:
                pass
        logger.info("scheduler: %s finished", member.peer.describe())
        if member.peer.role == "worker" and member.peer.rank == 0:  # the ledger's writer: reads waiting for more get its end
            self._answer_reads(self.ledger.end())
        self.desk.fail_blocked()

    def _check_alive(self) -> None:
        now = time.monotonic()
        stalled = now - self._last_check
        self._last_check = now
        if stalled > self.env.heartbeat_timeout / 2:
            # This process did not run (the job was stopped with Ctrl-Z, or the machine froze):
            # the others could not be heard meanwhile, so that time is not their silence.
            for member in self.roster.members.values():
                member.last_seen += stalled
                if member.away_since is not None:
                    member.away_since += stalled
        for member in list(self.roster.members.values()):
            if member.finished:
                continue
            if member.away_since is not None:
                if now - member.away_since > self.env.heartbeat_timeout:  # it was not started again
                    self._announce_death(member, f"{member.peer.describe()} died and did not come back within "
                                                 f"{self.env.heartbeat_timeout:g} s (PS_HEARTBEAT_TIMEOUT)", final=True)
                continue
            silent = now - member.last_seen
            if silent > self.env.heartbeat_timeout and self.env.elastic and member.peer.role == "worker":
                uid = next(u for u, m in self.roster.members.items() if m is member)
                self.elastic.drop(self, uid, member, f"no heartbeat for {silent:.1f} s (PS_HEARTBEAT_TIMEOUT="
                                                     f"{self.env.heartbeat_timeout:g})")
            elif silent > self.env.heartbeat_timeout:
                self._announce_death(
                    member,
                    f"{member.peer.describe()} (pid {member.info.get('pid')}) died: no heartbeat for {silent:.1f} s "
                    f"(PS_HEARTBEAT_TIMEOUT={self.env.heartbeat_timeout:g})",
                )

    def _check_elastic(self) -> None:
        """An elastic job below its minimum of workers past its timeout fails: every node hears why."""
        try:
            self.elastic.check(self.roster.expected["worker"])
        except ElasticError as error:
            body = {"message": str(error), "role": "scheduler", "rank": 0, "host": self.env.root_uri}
            for uid in self.roster.members:
                try:
                    self.transport.send(uid, [pack_header(Cmd.NODE_DIED), pack_json(body)])
                except PSNodeError:
                    pass
            raise

    def _lost_servers(self) -> None:
        """Servers and replicas whose connection ended and stayed closed (``_LOST_AFTER``): lost."""
        for uid in self.transport.gone(_LOST_AFTER):
            member = self.roster.members.get(uid)
            if member is not None and member.peer.role in _HOLDERS:
                self._announce_death(member, f"{member.peer.describe()} (pid {member.info.get('pid')}) is gone: its "
                                             f"connection closed and stayed closed for {_LOST_AFTER:g} s")

    def _lost_workers(self) -> None:
        """An elastic job's workers whose connection ended and stayed closed (``_LOST_AFTER``) without a
        leave or a finish: dropped (``Elastic.drop``), the job goes on."""
        for uid in self.transport.gone(_LOST_AFTER):
            member = self.roster.members.get(uid)
            if member is not None and member.peer.role == "worker" and not member.finished:
                self.elastic.drop(self, uid, member, f"its connection closed and stayed closed for {_LOST_AFTER:g} s")

    def _server_lost(self, lost: Member, message: str) -> bool:
        """PSLAUNCH_SERVER_REPLICAS: a server or replica ``lost``. A replica of a lost server's rank
        takes its place and the job goes on (True); every node hears of it (``SERVER_LOST``). False
        when a server had no replica left (the job cannot go on without its keys)."""
        peer = lost.peer
        if peer.role == "server" and not any(m.peer.role == "replica" and m.peer.rank == peer.rank
                                             for m in self.roster.members.values()):
            return False
        taking = self.roster.server_lost(peer.uid.encode())
        self._books.clear()
        self.barriers.forget(peer.uid.encode())
        by = None if taking is None else taking.peer.uid
        said = (f"{message}; replica {by} holds its keys and serves as server {peer.rank} from now on" if by else
                f"{message}; server {peer.rank} goes on without this replica")
        logger.warning("scheduler: %s", said)
        body = pack_json({"rank": peer.rank, "lost": peer.uid, "by": by, "replica": peer.role == "replica",
                          "message": said})
        for uid, member in self.roster.members.items():
            if not member.finished or member.peer.role != "worker":
                try:
                    self.transport.send(uid, [pack_header(Cmd.SERVER_LOST), body])
                except PSNodeError:
                    pass
        try:  # a process cut off rather than dead must not serve on: it is told the job went on without it
            self.transport.send(peer.uid.encode(), [pack_header(Cmd.NODE_DIED), pack_json(
                {"message": f"{said} (this process was given up for lost)", "role": peer.role, "rank": peer.rank,
                 "host": peer.host})], block=False)
        except PSNodeError:
            pass
        self.transport.disconnect(peer.uid.encode())
        return True

    def _announce_death(self, dead: Member, message: str, final: bool = False) -> None:
        peer = dead.peer
        if peer.role in _HOLDERS and self.env.server_replicas:
            if self._server_lost(dead, message):
                return
            message += "; no replica of its keys is left (--server-replicas), so the job cannot go on"
        if peer.role == "replica":  # not one of the job's servers: the first thing a lost one's book names
            message += f" (a replica of server {peer.rank})"
        if peer.role == "worker" and self.env.restart_scope == "worker" and not final:
            # pslaunch starts it again alone once it has ended; the others go on, and its rank waits
            # for it one heartbeat timeout (a worker that hangs instead of ending is not restarted)
            if dead.away_since is None:
                dead.away_since = time.monotonic()
                logger.warning("scheduler: %s; waiting for it to be restarted (PSLAUNCH_RESTART_SCOPE=worker)", message)
            return
        body = {"message": message, "role": peer.role, "rank": peer.rank, "host": peer.host}
        for uid, member in self.roster.members.items():
            if member is not dead and not member.finished:
                try:
                    self.transport.send(uid, [pack_header(Cmd.NODE_DIED), pack_json(body)])
                except PSNodeError:
                    pass
        raise PeerDiedError(message, peer.role, peer.rank, peer.host)

    def _shutdown_servers(self) -> None:
        servers = set(self.roster.of_roles(_HOLDERS))
        for uid in servers:
            self.transport.send(uid, [pack_header(Cmd.SHUTDOWN)])
        deadline = time.monotonic() + max(5.0, self.env.heartbeat_timeout)
        acked: set[bytes] = set()
        while acked != servers and time.monotonic() < deadline:
            if not self.transport.poll(0.1):
                continue
            sender, frames = self.transport.recv()
            try:
                if unpack_header(frames[0])[0] == Cmd.SHUTDOWN_ACK and sender in servers:
                    acked.add(sender)
                    self._read_body(self.roster.members[sender], frames)  # the server's last counters
            except (ProtocolError, IndexError):
                self.malformed += 1
        logger.info("scheduler: every worker finished; %d of %d servers confirmed shutdown", len(acked), len(servers))
        self.job_report.ended(self.roster.members.values(), in_order=acked == servers)  # each node wrote its events first

    def run(self) -> int:
        """Register, serve, shut down; return the exit code (0: every worker finished).

        Raises:
            PSNodeError: the job failed (the message says how); the sockets are closed.
        """
        try:
            self.register()
            self.serve()
        except PSNodeError:
            self.close(linger=0.5)  # let the death notices leave
            raise
        except BaseException:
            self.close()
            raise
        self.close()
        return 0

    def close(self, linger: float = 0.0) -> None:
        """Close the sockets and the timeline."""
        self.transport.close(linger)
        self.job_report.close()
