"""The scheduler: registration, ranks, the address book, barriers, liveness and orderly shutdown.

It listens on ``DMLC_PS_ROOT_PORT``. Every server and worker registers; once all of them have
(within ``PSLAUNCH_REGISTER_TIMEOUT``) ranks are given (``DMLC_WORKER_ID`` when a worker has one,
the rest ordered by (host, port)) and every node gets the address book. Then it answers heartbeats
and barriers, and watches: a node silent for ``PS_HEARTBEAT_TIMEOUT`` (or one that reports its own
failure) is announced to every other node as dead, naming its role, rank and host, and the
scheduler exits 1. When every worker has finished, the servers are told to shut down and the
scheduler exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from .env import EXIT_PEER_FAILED, NodeEnv
from .errors import PeerDiedError, ProtocolError, PSNodeError, RegistrationTimeoutError
from .node import PeerInfo, host_fingerprint, logger, setup_logging
from .protocol import FLAG_ERROR, GROUP_ROLES, Cmd, Group, pack_header, pack_json, unpack_header, unpack_json
from .transport import create_transport

__all__ = ["Scheduler", "run_scheduler"]

SCHEDULER_ID = b"scheduler"


@dataclass
class _Member:
    info: dict
    peer: PeerInfo | None = None
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False


class Scheduler:
    """One job's scheduler. ``run()`` returns the process exit code (0: every worker finished)."""

    def __init__(self, env: NodeEnv, transport: str = "zmq") -> None:
        setup_logging(env.verbose)
        self.env = env
        self.transport = create_transport(transport, SCHEDULER_ID)
        self.transport.bind(env.root_port)
        self.fingerprint = host_fingerprint()
        self.same_host = env.same_host
        self.members: dict[bytes, _Member] = {}
        self.malformed = 0
        self._barriers: dict[int, list[tuple[bytes, int]]] = {}
        self._last_check = 0.0  # when _check_alive last ran

    # ---- registration -------------------------------------------------------------------
    def _expected(self) -> dict[str, int]:
        return {"server": self.env.num_servers, "worker": self.env.num_workers}

    def _count(self, role: str) -> int:
        return sum(1 for m in self.members.values() if m.info["role"] == role)

    def register(self) -> None:
        """Wait for every node, give ranks, send the address book.

        Raises:
            RegistrationTimeoutError: not every node registered in time (the message names what is missing).
            PSNodeError: two workers asked for the same DMLC_WORKER_ID.
        """
        env = self.env
        deadline = time.monotonic() + env.register_timeout
        expected = self._expected()
        while any(self._count(r) < n for r, n in expected.items()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [f"{n - self._count(r)} {r}{'s' if n - self._count(r) > 1 else ''}" for r, n in expected.items() if self._count(r) < n]
                got = ", ".join(f"{self._count(r)} of {n} {r}s" for r, n in expected.items())
                message = (
                    f"registration timed out after {env.register_timeout:g} s (PSLAUNCH_REGISTER_TIMEOUT): "
                    f"{got} registered with the scheduler at {env.root_address}; missing: {', '.join(missing)}"
                )
                self._refuse_all(message)
                raise RegistrationTimeoutError(message)
            if not self.transport.poll(min(remaining, 0.5)):
                continue
            sender, frames = self.transport.recv()
            try:
                cmd, _, _, _ = unpack_header(frames[0])
                if cmd != Cmd.REGISTER:
                    continue  # heartbeats of early nodes: registration answers them all
                info = unpack_json(frames[1])
                self._add_member(sender, info)
            except (ProtocolError, IndexError, KeyError, TypeError, ValueError) as exc:
                self.malformed += 1
                logger.info("scheduler dropped a malformed registration from %r: %s", sender[:64], exc)
        self._assign_ranks()
        for uid, member in self.members.items():
            self.transport.connect(uid, self._endpoint(member.peer))
        nodes = [vars(m.peer) for m in self.members.values()]
        for uid, member in self.members.items():
            member.last_seen = time.monotonic()
            self.transport.send(uid, [pack_header(Cmd.ADDRBOOK), pack_json({"rank": member.peer.rank, "nodes": nodes})])
        logger.info("scheduler: %d servers and %d workers registered", env.num_servers, env.num_workers)

    def _add_member(self, sender: bytes, info: dict) -> None:
        role = info["role"]
        if sender in self.members:
            return
        if role not in self._expected() or sender != str(info["uid"]).encode():
            raise ProtocolError(f"registration of role {role!r} with uid {info.get('uid')!r}")
        int(info["port"])
        if self._count(role) >= self._expected()[role]:
            message = (
                f"a {role} at {info['host']}:{info['port']} registered, but the job already has all "
                f"{self._expected()[role]} {role}s (DMLC_NUM_{'WORKER' if role == 'worker' else 'SERVER'}="
                f"{self._expected()[role]})"
            )
            self._send_once(sender, info, Cmd.REGISTER_FAILED, {"error": message})
            logger.info("scheduler: %s", message)
            return
        self.members[sender] = _Member(info)

    def _assign_ranks(self) -> None:
        workers = [(u, m) for u, m in self.members.items() if m.info["role"] == "worker"]
        servers = [(u, m) for u, m in self.members.items() if m.info["role"] == "server"]
        fixed: dict[int, _Member] = {}
        for _, member in workers:
            wid = member.info.get("worker_id")
            if wid is None:
                continue
            if wid in fixed:
                other = fixed[wid].info
                message = (
                    f"two workers asked for DMLC_WORKER_ID={wid}: {other['host']}:{other['port']} and "
                    f"{member.info['host']}:{member.info['port']}"
                )
                self._refuse_all(message)
                raise PSNodeError(message)
            fixed[wid] = member
        free = iter(r for r in range(self.env.num_workers) if r not in fixed)
        ranks = {id(m): r for r, m in fixed.items()}
        for _, member in sorted(workers, key=lambda um: (um[1].info["host"], int(um[1].info["port"]))):
            if id(member) not in ranks:
                ranks[id(member)] = next(free)
        for rank, (_, member) in enumerate(sorted(servers, key=lambda um: (um[1].info["host"], int(um[1].info["port"])))):
            ranks[id(member)] = rank
        for _, member in workers + servers:
            i = member.info
            member.peer = PeerInfo(i["role"], ranks[id(member)], i["host"], int(i["port"]), i["uid"], i["fingerprint"],
                                   i["local_name"], int(i.get("shm_probe") or 0))

    def _endpoint(self, peer: PeerInfo) -> str:
        if self.same_host in ("ipc", "shm") and peer.fingerprint == self.fingerprint:
            return self.transport.same_host_endpoint(peer.local_name)
        return f"tcp://{peer.host}:{peer.port}"

    def _send_once(self, uid: bytes, info: dict, cmd: int, body: dict) -> None:
        try:
            self.transport.connect(uid, f"tcp://{info['host']}:{int(info['port'])}")
            self.transport.send(uid, [pack_header(cmd), pack_json(body)])
        except PSNodeError as exc:
            logger.info("scheduler could not tell %s: %s", uid, exc)

    def _refuse_all(self, message: str) -> None:
        for uid, member in self.members.items():
            self._send_once(uid, member.info, Cmd.REGISTER_FAILED, {"error": message})

    # ---- serving -------------------------------------------------------------------------
    def serve(self) -> None:
        """Answer heartbeats and barriers until every worker finished; then shut the servers down.

        Raises:
            PeerDiedError: a node died (every other node has been told).
        """
        env = self.env
        tick = 0.5 if env.heartbeat_interval <= 0 else min(0.5, env.heartbeat_interval / 2)
        self._last_check = time.monotonic()
        while not all(m.finished for m in self.members.values() if m.peer.role == "worker"):
            if self.transport.poll(tick):
                for _ in range(256):
                    sender, frames = self.transport.recv()
                    self._dispatch(sender, frames)
                    if not self.transport.poll(0):
                        break
            if env.heartbeat_interval > 0:
                self._check_alive()
        self._shutdown_servers()

    def _dispatch(self, sender: bytes, frames: list) -> None:
        member = self.members.get(sender)
        try:
            cmd, flags, req_id, arg = unpack_header(frames[0])
            if member is None:
                raise ProtocolError(f"{Cmd(cmd).name} from an unknown sender")
        except (ProtocolError, IndexError) as exc:
            self.malformed += 1
            logger.info("scheduler dropped a malformed message from %r: %s", sender[:64], exc)
            return
        member.last_seen = time.monotonic()
        if cmd == Cmd.HEARTBEAT:
            self.transport.send(sender, [pack_header(Cmd.HEARTBEAT_ACK, req_id)])
        elif cmd == Cmd.BARRIER:
            self._barrier(sender, member, req_id, arg)
        elif cmd == Cmd.FINISH:
            member.finished = True
            self.transport.send(sender, [pack_header(Cmd.FINISH_ACK, req_id)])
            note = pack_json({"rank": member.peer.rank, "node": member.peer.describe()})
            for uid, other in self.members.items():
                if other.peer.role == "server":  # rounds that still wait for this worker can never close
                    self.transport.send(uid, [pack_header(Cmd.WORKER_FINISHED), note])
            logger.info("scheduler: %s finished", member.peer.describe())
            self._fail_blocked_barriers()
        elif cmd == Cmd.NODE_DIED:
            reason = unpack_json(frames[1]).get("message", "it failed") if len(frames) > 1 else "it failed"
            self._announce_death(member, f"{member.peer.describe()} failed: {reason}")
        elif cmd == Cmd.REGISTER:
            pass  # a repeated registration
        else:
            self.malformed += 1

    def _group_members(self, group: int) -> list[bytes]:
        roles = GROUP_ROLES[Group(group)]
        return [u for u, m in self.members.items() if m.peer.role in roles]

    def _barrier(self, sender: bytes, member: _Member, req_id: int, group: int) -> None:
        """Count ``sender`` in ``group``'s barrier; answer everyone once every member arrived."""
        error = None
        if group not in GROUP_ROLES:
            error = f"unknown barrier group {group}; the groups are " + ", ".join(f"{g.name.lower()} ({int(g)})" for g in Group)
        elif member.peer.role not in GROUP_ROLES[Group(group)]:
            error = f"{member.peer.describe()} is not in the barrier group {Group(group).name.lower()}"
        if error is not None:
            self.transport.send(sender, [pack_header(Cmd.BARRIER_DONE, req_id, flags=FLAG_ERROR), pack_json({"error": error})])
            return
        members = self._group_members(group)
        waiting = self._barriers.setdefault(group, [])
        waiting.append((sender, req_id))
        if len({u for u, _ in waiting}) >= len(members):
            for uid, rid in waiting:
                self.transport.send(uid, [pack_header(Cmd.BARRIER_DONE, rid)])
            del self._barriers[group]
        else:
            self._fail_blocked_barriers()

    def _fail_blocked_barriers(self) -> None:
        """A barrier that waits for a finished node can never complete: say so instead of hanging."""
        for group, waiting in list(self._barriers.items()):
            arrived = {u for u, _ in waiting}
            gone = [self.members[u].peer for u in self._group_members(group) if u not in arrived and self.members[u].finished]
            if not gone:
                continue
            message = f"barrier of {Group(group).name.lower()} can never complete: {', '.join(p.describe() for p in gone)} already finished"
            for uid, rid in waiting:
                self.transport.send(uid, [pack_header(Cmd.BARRIER_DONE, rid, flags=FLAG_ERROR), pack_json({"error": message})])
            del self._barriers[group]

    def _check_alive(self) -> None:
        now = time.monotonic()
        stalled = now - self._last_check
        self._last_check = now
        if stalled > self.env.heartbeat_timeout / 2:
            # This process did not run (the job was stopped with Ctrl-Z, or the machine froze):
            # the others could not be heard meanwhile, so that time is not their silence.
            for member in self.members.values():
                member.last_seen += stalled
        for member in self.members.values():
            if member.finished:
                continue
            silent = now - member.last_seen
            if silent > self.env.heartbeat_timeout:
                self._announce_death(
                    member,
                    f"{member.peer.describe()} (pid {member.info.get('pid')}) died: no heartbeat for {silent:.1f} s "
                    f"(PS_HEARTBEAT_TIMEOUT={self.env.heartbeat_timeout:g})",
                )

    def _announce_death(self, dead: _Member, message: str) -> None:
        peer = dead.peer
        body = {"message": message, "role": peer.role, "rank": peer.rank, "host": peer.host}
        for uid, member in self.members.items():
            if member is not dead and not member.finished:
                try:
                    self.transport.send(uid, [pack_header(Cmd.NODE_DIED), pack_json(body)])
                except PSNodeError:
                    pass
        raise PeerDiedError(message, peer.role, peer.rank, peer.host)

    def _shutdown_servers(self) -> None:
        servers = {u for u, m in self.members.items() if m.peer.role == "server"}
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
            except (ProtocolError, IndexError):
                self.malformed += 1
        logger.info("scheduler: every worker finished; %d of %d servers confirmed shutdown", len(acked), len(servers))

    def close(self, linger: float = 0.0) -> None:
        """Close the sockets."""
        self.transport.close(linger)

    def run(self) -> int:
        """Register, serve, shut down; return the exit code (errors are printed on stderr): 0, 1, or
        ``EXIT_PEER_FAILED`` when another node failed (the line printed names it)."""
        try:
            self.register()
            self.serve()
            self.close()
            return 0
        except PeerDiedError as exc:
            print(f"psnode scheduler (pid {os.getpid()}): ended because a peer failed: {exc}", flush=True, file=sys.stderr)
            self.close(linger=0.5)
            return EXIT_PEER_FAILED
        except PSNodeError as exc:
            print(f"psnode scheduler (pid {os.getpid()}): error: {exc}", flush=True, file=sys.stderr)
            self.close(linger=0.5)
            return 1
        except BaseException:
            self.close()
            raise


def run_scheduler(env: NodeEnv) -> int:
    """Run the scheduler of the job ``env`` describes; return the exit code."""
    return Scheduler(env).run()
