"""Who the scheduler knows: the ``Roster`` (who registered, their ranks, liveness and what they
reported) and the ``Barriers`` (who waits in which group). Parts of ``scheduler.Scheduler``, which
reads the messages and drives them; neither sends anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from psnode.errors import ProtocolError, PSNodeError
from psnode.node.membership import PeerInfo

__all__ = ["Member", "Roster", "Barriers"]

_ROLES = ("server", "worker", "replica")
_REFUSALS_KEPT = 10  # refusals a timeout message counts (the first is quoted)


@dataclass
class Member:
    """A registered node: what it said of itself, its place in the book once ranked, and liveness."""

    info: dict
    peer: PeerInfo
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False
    report: dict | None = None  # the counters of its latest heartbeat (PSLAUNCH_STATS), checked
    away_since: float | None = None  # a worker that died under PSLAUNCH_RESTART_SCOPE=worker: since when


class Roster:
    """The registered nodes and their ranks (see ``Scheduler``)."""

    def __init__(self, num_workers: int, num_servers: int, job_id: str = "", port: int = 0, job_from: str = "",
                 replicas: int = 0) -> None:
        self.expected = {"server": num_servers, "worker": num_workers}
        if replicas:  # PSLAUNCH_SERVER_REPLICAS: that many replicas of each server register too
            self.expected["replica"] = replicas * num_servers
        self.job_id = job_id
        self.job_from = job_from  # the scheduler's address as it was given, when the job id was derived from it
        self.port = port
        self.refusals: list[str] = []  # the first registrations refused, for the timeout's message
        self.members: dict[bytes, Member] = {}
        self.any_finished = False  # a worker said it finished: a barrier may now wait for it in vain

    def count(self, role: str) -> int:
        """Registered nodes of ``role``."""
        return sum(1 for m in self.members.values() if m.peer.role == role)

    def complete(self) -> bool:
        """True once every expected node registered."""
        return all(self.count(r) >= n for r, n in self.expected.items())

    def missing(self, where: str) -> str:
        """``0 of 2 servers, 1 of 2 workers registered <where>; missing: ...``: what registration lacks."""
        got = ", ".join(f"{self.count(r)} of {n} {r}s" for r, n in self.expected.items())
        short = [f"{n - self.count(r)} {r}{'s' if n - self.count(r) > 1 else ''}"
                 for r, n in self.expected.items() if self.count(r) < n]
        refused = ""
        if self.refusals:
            refused = (f"; {len(self.refusals)}{'+' if len(self.refusals) >= _REFUSALS_KEPT else ''} registration"
                       f"{'s' if len(self.refusals) > 1 else ''} refused, the first: {self.refusals[0]}")
        return f"{got} registered {where}; missing: {', '.join(short)}{refused}"

    def _refused(self, why: str) -> str:
        if len(self.refusals) < _REFUSALS_KEPT:
            self.refusals.append(why)
        return why

    def _other_job(self, peer: PeerInfo, info: dict, job: Any) -> str:
        """Why a node of job ``job`` may not join; when both ids were derived from the scheduler's
        address (no ``PSLAUNCH_JOB_ID``), the two spellings of it that made them differ."""
        theirs = info.get("job_from")
        if isinstance(theirs, str) and self.job_from and len(theirs) <= 300:
            return (f"a {peer.role} at {peer.host}:{peer.port} derived job id {job!r} from the scheduler address it "
                    f"was given, {theirs!r}, and this scheduler derived {self.job_id!r} from {self.job_from!r}: a job "
                    "started without PSLAUNCH_JOB_ID needs every process to name the scheduler alike "
                    "(DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT), or PSLAUNCH_JOB_ID set alike in all")
        return (f"a {peer.role} of job {job!r} at {peer.host}:{peer.port} tried to join; port {self.port} belongs "
                f"to job {self.job_id!r}")

    def add(self, sender: bytes, info: Any) -> str | None:
        """Register ``sender`` from its REGISTER body; the refusal sentence when the job is full.

        Raises:
            ProtocolError: the body is malformed, or its uid is not the sender's identity.
        """
        if sender in self.members:
            return None
        peer = PeerInfo.from_record({**info, "rank": -1}) if isinstance(info, dict) else PeerInfo.from_record(info)
        if peer.role not in self.expected or sender != peer.uid.encode():
            raise ProtocolError(f"registration of role {peer.role!r} with uid {peer.uid!r} from {sender[:64]!r}")
        worker_id = info.get("worker_id")
        if worker_id is not None and not isinstance(worker_id, int):
            raise ProtocolError(f"registration with worker_id {worker_id!r}, not an integer")
        job = info.get("job_id")
        if self.job_id and job is not None and job != self.job_id:
            return self._refused(self._other_job(peer, info, job))
        expected = self.expected[peer.role]
        if self.count(peer.role) >= expected:
            variable = {"worker": "DMLC_NUM_WORKER", "server": "DMLC_NUM_SERVER"}.get(
                peer.role, "PSLAUNCH_SERVER_REPLICAS x DMLC_NUM_SERVER")
            return self._refused(f"a {peer.role} at {peer.host}:{peer.port} registered, but the job already has all "
                                 f"{expected} {peer.role}s ({variable}={expected})")
        self.members[sender] = Member(info, peer)
        return None

    def replace(self, sender: bytes, info: Any) -> tuple[Member, Member]:
        """A worker started again (``PSLAUNCH_RESTART_SCOPE=worker``) takes the place of the member of
        its rank (``worker_id``); returns ``(new member, old member)``.

        Raises:
            ProtocolError: the body is malformed, not a worker's, or its uid is not the sender.
            PSNodeError: another job's node, no ``worker_id``, or its rank already finished.
        """
        peer = PeerInfo.from_record({**info, "rank": -1})
        worker_id = info.get("worker_id")
        if peer.role != "worker" or sender != peer.uid.encode():
            raise ProtocolError(f"a late registration of role {peer.role!r} with uid {peer.uid!r} from {sender[:64]!r}")
        job = info.get("job_id")
        if self.job_id and job is not None and job != self.job_id:
            raise PSNodeError(self._other_job(peer, info, job))
        if not isinstance(worker_id, int) or not 0 <= worker_id < self.expected["worker"]:
            raise PSNodeError(f"a worker at {peer.host}:{peer.port} registered after the job started without a "
                              f"DMLC_WORKER_ID of 0..{self.expected['worker'] - 1} ({worker_id!r}); only a restarted "
                              "worker may, taking its rank back")
        old_uid, old = next((u, m) for u, m in self.members.items()
                            if m.peer.role == "worker" and m.peer.rank == worker_id)
        if old.finished:
            raise PSNodeError(f"worker {worker_id} registered again at {peer.host}:{peer.port}, but worker "
                              f"{worker_id} already finished the job")
        del self.members[old_uid]
        new = Member(info, replace(peer, rank=worker_id))
        self.members[sender] = new
        return new, old

    def take_back(self, sender: bytes, info: dict) -> Member | None:
        """A node of the running job registers again with a scheduler started in place, with its rank
        (``rejoin``); its member (None when it was taken back already).

        Raises:
            ProtocolError: a malformed record, or not a rank of the job.
            PSNodeError: another job's node, or a rank another node holds.
        """
        if sender in self.members:
            return None
        peer = PeerInfo.from_record(info)
        if peer.role not in self.expected or sender != peer.uid.encode():
            raise ProtocolError(f"a node coming back as a {peer.role!r} with uid {peer.uid!r} from {sender[:64]!r}")
        job = info.get("job_id")
        if self.job_id and job is not None and job != self.job_id:
            raise PSNodeError(self._other_job(peer, info, job))
        limit = self.expected["worker"] if peer.role == "worker" else self.expected["server"]
        if not 0 <= peer.rank < limit:
            raise ProtocolError(f"a {peer.role} coming back with rank {peer.rank}, not one of 0..{limit - 1}")
        if peer.role != "replica" and any(m.peer.role == peer.role and m.peer.rank == peer.rank
                                          for m in self.members.values()):
            raise PSNodeError(f"two {peer.role}s came back with rank {peer.rank}")
        member = self.members[sender] = Member(info, peer)
        return member

    def missing_ranks(self, finished: dict[int, str]) -> list[str]:
        """``server 1``, ``worker 0``: the ranks no node came back for yet (a finished worker counts)."""
        missing = []
        for role in ("server", "worker"):
            held = {m.peer.rank for m in self.members.values() if m.peer.role == role}
            if role == "worker":
                held |= set(finished)
            missing += [f"{role} {rank}" for rank in range(self.expected[role]) if rank not in held]
        return missing

    def add_finished(self, finished: dict[int, str]) -> None:
        """Place-holders for the workers that finished the job before this scheduler was started in
        place and did not come back (they ended): counted as finished, never sent anything."""
        for rank, node in finished.items():
            if any(m.peer.role == "worker" and m.peer.rank == rank for m in self.members.values()):
                for member in self.members.values():
                    if member.peer.role == "worker" and member.peer.rank == rank:
                        member.finished = True
                continue
            uid = f"finished-worker-{rank}"
            self.members[uid.encode()] = Member({"finished": node}, PeerInfo("worker", rank, "", 0, uid, "", ""),
                                                finished=True)
        self.any_finished = self.any_finished or bool(finished)

    def assign_ranks(self) -> None:
        """Give every node its rank: workers by DMLC_WORKER_ID, the rest by (host, port).

        Raises:
            PSNodeError: two workers asked for the same DMLC_WORKER_ID (the message names both).
        """
        workers = [m for m in self.members.values() if m.peer.role == "worker"]
        servers = [m for m in self.members.values() if m.peer.role == "server"]
        fixed: dict[int, Member] = {}
        for member in workers:
            wid = member.info.get("worker_id")
            if wid is None:
                continue
            if wid in fixed:
                other = fixed[wid].peer
                raise PSNodeError(f"two workers asked for DMLC_WORKER_ID={wid}: {other.host}:{other.port} and "
                                  f"{member.peer.host}:{member.peer.port}")
            fixed[wid] = member
        free = iter(r for r in range(self.expected["worker"]) if r not in fixed)
        ranks = {id(m): r for r, m in fixed.items()}
        for member in sorted(workers, key=lambda m: (m.peer.host, m.peer.port)):
            if id(member) not in ranks:
                ranks[id(member)] = next(free)
        ordered = sorted(servers, key=lambda m: (m.peer.host, m.peer.port))
        for rank, member in enumerate(ordered):
            ranks[id(member)] = rank
        replicas = sorted((m for m in self.members.values() if m.peer.role == "replica"),
                          key=lambda m: (m.peer.host, m.peer.port))
        for member, rank in zip(replicas, _replica_ranks([m.peer.host for m in ordered],
                                                          [m.peer.host for m in replicas])):
            ranks[id(member)] = rank
        for member in workers + servers + replicas:
            member.peer = replace(member.peer, rank=ranks[id(member)])

    def join_replica(self, sender: bytes, info: dict) -> tuple[Member, tuple[bytes, Member]] | None:
        """A replica registering while the job runs: it backs the server with the fewest replicas (one
        on another host first, then the lowest rank); its member and that server's ``(uid, member)``,
        or None when the job has no server.

        Raises:
            ProtocolError: a malformed registration, or another job's.
        """
        peer = PeerInfo.from_record({**info, "rank": -1})
        if peer.role != "replica" or sender != peer.uid.encode():
            raise ProtocolError(f"a replica's registration with uid {peer.uid!r} from {sender[:64]!r}")
        job = info.get("job_id")
        if self.job_id and job is not None and job != self.job_id:
            raise ProtocolError(f"a replica of job {str(job)[:40]!r} registered with job {self.job_id!r}")
        servers = {m.peer.rank: (uid, m) for uid, m in self.members.items() if m.peer.role == "server"}
        if not servers:
            return None
        held = {rank: sum(1 for m in self.members.values() if m.peer.role == "replica" and m.peer.rank == rank)
                for rank in servers}
        rank = min(servers, key=lambda r: (held[r], servers[r][1].peer.host == peer.host, r))
        member = self.members[sender] = Member({**info, "late": True}, replace(peer, rank=rank))  # late: see server_lost
        return member, servers[rank]

    def server_lost(self, uid: bytes) -> Member | None:
        """Server (or replica) ``uid`` is lost: forget it, and when it was a server, make the first
        replica of its rank the server of that rank; that replica's member (None: a replica was
        lost, or the server had none left)."""
        lost = self.members.pop(uid)
        if lost.peer.role != "server":
            return None
        # a replica that holds the keys since the job began first: one that joined later may still wait for them
        candidates = sorted((m for m in self.members.values() if m.peer.role == "replica" and m.peer.rank == lost.peer.rank),
                            key=lambda m: m.info.get("late") is True)
        taking = candidates[0] if candidates else None
        if taking is not None:
            taking.peer = replace(taking.peer, role="server")
        return taking

    def of_roles(self, roles: tuple[str, ...]) -> list[bytes]:
        """The identities of the members with one of ``roles``."""
        return [u for u, m in self.members.items() if m.peer.role in roles]

    def size_of(self, roles: tuple[str, ...]) -> int:
        """How many members have one of ``roles`` (every one expected: a barrier runs once all registered)."""
        return sum(self.expected.get(role, 0) for role in roles)

    def leave(self, uid: bytes) -> Member:
        """An elastic job's worker ``uid`` left it: it is no member any more, and the job expects one
        worker fewer (barriers, the job's end). Returns its member."""
        member = self.members.pop(uid)
        self.expected["worker"] -= 1
        return member

    def check_joiner(self, sender: bytes, info: Any) -> PeerInfo:
        """A worker registering with an elastic job that runs already: its peer record (rank -1 yet).

        Raises:
            ProtocolError: a malformed body, not a worker's, or its uid is not the sender.
            PSNodeError: another job's node.
        """
        if not isinstance(info, dict):
            raise ProtocolError(f"a registration body that is a {type(info).__name__}, not an object")
        peer = PeerInfo.from_record({**info, "rank": -1})
        if peer.role != "worker" or sender != peer.uid.encode():
            raise ProtocolError(f"a registration of role {peer.role!r} with uid {peer.uid!r} from {sender[:64]!r} "
                                "while the job runs")
        job = info.get("job_id")
        if self.job_id and job is not None and job != self.job_id:
            raise PSNodeError(self._other_job(peer, info, job))
        return peer

    def free_worker_ranks(self, limit: int) -> list[int]:
        """The ranks below ``limit`` (DMLC_NUM_WORKER) no worker holds: left, or never taken."""
        held = {m.peer.rank for m in self.members.values() if m.peer.role == "worker"}
        return [rank for rank in range(limit) if rank not in held]

    def join(self, sender: bytes, info: dict, peer: PeerInfo, rank: int) -> Member:
        """Worker ``peer`` joins the running elastic job with the free ``rank``: a member, one more expected."""
        member = self.members[sender] = Member(info, replace(peer, rank=rank))
        self.expected["worker"] += 1
        return member

    def all_workers_finished(self) -> bool:
        """True once every worker said it finished."""
        return all(m.finished for m in self.members.values() if m.peer.role == "worker")


def _replica_ranks(server_hosts: list[str], replica_hosts: list[str]) -> list[int]:
    """The server rank each replica holds the keys of: every server gets ``len(replica_hosts) //
    len(server_hosts)`` replicas, each on another host than the server's where one is free (a host
    lost then loses no server's keys), the others in order."""
    count = len(server_hosts)
    if not count:
        return []
    per_server = len(replica_hosts) // count
    wanted = {rank: per_server for rank in range(count)}
    ranks: list[int | None] = [None] * len(replica_hosts)
    for strict in (True, False):
        for i, host in enumerate(replica_hosts):
            if ranks[i] is not None:
                continue
            # the rank after this replica's position first, so replicas spread over the servers
            for step in range(count):
                rank = (i + 1 + step) % count
                if wanted[rank] and not (strict and server_hosts[rank] == host):
                    ranks[i] = rank
                    wanted[rank] -= 1
                    break
    return [r if r is not None else i % count for i, r in enumerate(ranks)]


class Barriers:
    """The open barriers: who arrived in which group (with the note each left), answered once every
    member did. An arrival costs the same with 4 members as with 4,096 (the members who arrived are
    a set, the group's size a count).

    Each group counts its completed barriers (``completed``) and keeps the notes of the last
    ``KEPT_NOTES``: a worker replaced in place (``PSLAUNCH_RESTART_SCOPE=worker``) numbers its
    barriers on from its predecessor's mark, and one it redoes that completed already is answered at
    once with that barrier's notes (``replayed``)."""

    KEPT_NOTES = 4

    def __init__(self) -> None:
        self.waiting: dict[int, list[tuple[bytes, int]]] = {}
        self.arrived: dict[int, set[bytes]] = {}
        self.notes: dict[int, list] = {}
        self.completed: dict[int, int] = {}
        self._past_notes: dict[int, dict[int, list]] = {}  # group -> {barrier number: its notes}
        self.opened: dict[int, float] = {}  # group -> when its open barrier's first member arrived (stalls)

    def arrive(self, group: int, sender: bytes, req_id: int, size: int, note: Any = None
               ) -> tuple[list[tuple[bytes, int]], list] | None:
        """Count ``sender`` in ``group`` of ``size`` members; ``(every waiter (uid, req_id), the
        notes)`` when the group is complete, else None."""
        waiting = self.waiting.setdefault(group, [])
        if not waiting:
            self.opened[group] = time.monotonic()
        waiting.append((sender, req_id))
        arrived = self.arrived.setdefault(group, set())
        arrived.add(sender)
        if note is not None:
            self.notes.setdefault(group, []).append(note)
        return self.complete_if(group, size)

    def complete_if(self, group: int, size: int) -> tuple[list[tuple[bytes, int]], list] | None:
        """Complete ``group``'s open barrier when ``size`` members arrived (after an arrival, or after a
        member left an elastic job); ``(every waiter, the notes)`` then, else None."""
        waiting = self.waiting.get(group)
        if not waiting or len(self.arrived.get(group, ())) < size:
            return None
        self.drop(group)
        notes = self.notes.pop(group, [])
        number = self.completed[group] = self.completed.get(group, 0) + 1
        past = self._past_notes.setdefault(group, {})
        past[number] = notes
        past.pop(number - self.KEPT_NOTES, None)
        return waiting, notes

    def replayed(self, group: int, number: int) -> list | None:
        """The notes of ``group``'s barrier ``number`` when it completed already (a replacement redoing
        it: answered at once; ``[]`` when its notes are no longer kept), else None."""
        if number > self.completed.get(group, 0):
            return None
        return self._past_notes.get(group, {}).get(number, [])

    def forget(self, uid: bytes) -> None:
        """A member that was replaced (a restarted worker) is no longer waited for, nor counted."""
        for group, waiting in self.waiting.items():
            self.waiting[group] = [w for w in waiting if w[0] != uid]
            self.arrived.get(group, set()).discard(uid)

    def drop(self, group: int) -> None:
        """Forget ``group``'s open barrier (answered, or failed)."""
        self.waiting.pop(group, None)
        self.arrived.pop(group, None)
        self.opened.pop(group, None)
