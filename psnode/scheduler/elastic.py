"""An elastic job's membership at the scheduler (``PSLAUNCH_MIN_WORKERS`` below ``DMLC_NUM_WORKER``).

A worker leaves at a step boundary (SIGTERM: a preempted pod, a spot notice), with every push it
made acknowledged. It asks the scheduler (``LEAVE``); the scheduler takes it out of the roster (so
barriers, the job's end and liveness count it no more), tells every server and worker
(``WORKER_LEFT``: each server's rounds after its last push close without it, exactly), answers any
barrier it was the last one missing, and then acknowledges, so the worker exits knowing everyone
heard. The others keep their ranks (``kv.rank`` is an id, ``kv.num_workers`` the members now).

A worker that registers while the job runs joins it (one at a time, in the order they came). The
servers freeze and say the latest round a push reached (``psnode.server.joins``); the joiner gets the
lowest free rank (its ``DMLC_WORKER_ID`` when that one is free; a rank whose leaver still has a push
in an open round waits), counts from that round + 2 (``WORKER_JOINED``), and gets its address book
with that start round. The members' lowest rank (the *provider*) sends the joiner its ``State``
scalars as they were when that round began (``JOIN_SCALARS``, relayed here). A job that holds
``DMLC_NUM_WORKER`` workers refuses a joiner, naming the limit. Changes are numbered (``version``),
so a node that hears of two changes of one rank in the wrong order keeps the newer.

While fewer than ``PSLAUNCH_MIN_WORKERS`` remain, the job waits ``PSLAUNCH_ELASTIC_TIMEOUT``
seconds for more, and then fails, naming what it waited for (``ElasticError``). Single-threaded
(the scheduler's loop).
"""

from __future__ import annotations

import time
from typing import Any

from psnode.errors import ProtocolError, PSNodeError
from psnode.log import logger
from psnode.node.membership import PeerInfo, endpoint_of
from psnode.node.protocol import FLAG_ERROR, GROUP_ROLES, Cmd, Group, pack_header, pack_json, unpack_json

__all__ = ["Elastic", "ElasticError", "SCALARS_LIMIT"]

SCALARS_LIMIT = 16384  # bytes of a joiner's State scalars (JSON), as a provider sends them


class ElasticError(PSNodeError):
    """An elastic job had fewer workers than its minimum for longer than its timeout."""


class Elastic:
    """The scheduler's part of an elastic job (see the module docstring)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.left: dict[int, str] = {}  # rank -> description, of the workers that left
        self.short_since: float | None = None  # when the members fell below the minimum
        self.version = 0  # changes of membership so far (joins and leaves), numbered in every note
        self.waiting: list[tuple[bytes, dict, Any]] = []  # joiners not started yet: (uid, registration, peer)
        self.joining: tuple[bytes, dict, Any] | None = None  # the joiner whose freeze is under way
        self.rounds: dict[bytes, tuple[int, list[int]]] = {}  # server uid -> its JOIN_ROUND answer
        self.retry_at: float | None = None  # a joiner waits for a leaver's rank to settle: try again then
        self.joined: dict[int, tuple[int, float]] = {}  # rank -> (start round, when), of the workers that joined
        # joiner's rank -> (its start round, the member that owes it its scalars), until they came
        self.providers: dict[int, tuple[int, int]] = {}
        self.going: set[int] = set()  # workers the servers heard announce their last push, until they left

    def leave(self, scheduler: Any, sender: bytes, member: Any, req_id: int) -> None:
        """``member`` asks to leave the job now (``LEAVE``)."""
        env, peer = self.env, member.peer
        if not env.elastic or peer.role != "worker" or member.finished:
            why = ("leaving needs an elastic job (-n MIN:MAX, PSLAUNCH_MIN_WORKERS)" if not env.elastic
                   else f"{peer.describe()} cannot leave: it is no worker, or it finished")
            scheduler.transport.send(sender, [pack_header(Cmd.LEAVE_ACK, req_id, flags=FLAG_ERROR),
                                              pack_json({"error": why})])
            return
        roster = scheduler.roster
        roster.leave(sender)
        scheduler.barriers.forget(sender)
        self.left[peer.rank] = peer.describe()
        remaining = roster.expected["worker"]
        self.version += 1
        note = pack_json({"rank": peer.rank, "node": peer.describe(), "workers": remaining, "version": self.version})
        for uid in roster.of_roles(("server", "replica", "worker")):
            if not roster.members[uid].finished:
                try:
                    scheduler.transport.send(uid, [pack_header(Cmd.WORKER_LEFT), note])
                except PSNodeError:
                    pass  # gone: its own news
        scheduler.transport.send(sender, [pack_header(Cmd.LEAVE_ACK, req_id)])
        self._provider_gone(scheduler, peer.rank)
        logger.warning("scheduler: %s left the job at a step boundary; %d %s on (minimum %d)",
                       peer.describe(), remaining, "worker goes" if remaining == 1 else "workers go", env.min_workers)
        self.complete_barriers(scheduler)
        if remaining < env.min_workers and self.short_since is None:
            self.short_since = time.monotonic()

    # ---- joining -------------------------------------------------------------------------------
    def register(self, scheduler: Any, sender: bytes, frames: list) -> None:
        """A worker registered while the job runs: it joins once the servers agreed its start round.

        Raises:
            ProtocolError: a malformed registration (counted and dropped by the caller).
        """
        info = unpack_json(frames[1]) if len(frames) > 1 else None
        try:
            peer = scheduler.roster.check_joiner(sender, info)
        except PSNodeError as exc:
            if isinstance(exc, ProtocolError):
                raise
            self._refuse(scheduler, sender, info, str(exc))
            return
        if any(uid == sender for uid, _, _ in self.waiting) or (self.joining and self.joining[0] == sender):
            return  # a registration sent again while it waits
        self.waiting.append((sender, info, peer))
        self.start_next(scheduler)

    def start_next(self, scheduler: Any) -> None:
        """Freeze the servers for the next waiting joiner (one join at a time)."""
        if self.joining is not None or not self.waiting:
            return
        self.retry_at = None
        self.joining = self.waiting.pop(0)
        self.rounds = {}
        for uid in scheduler.roster.of_roles(("server",)):
            scheduler.transport.send(uid, [pack_header(Cmd.JOIN_FREEZE)])

    def round_reply(self, scheduler: Any, sender: bytes, frames: list) -> None:
        """A server's ``JOIN_ROUND``; with every server's, the joiner joins (or waits, or is refused).

        Raises:
            ProtocolError: a malformed answer.
        """
        body = unpack_json(frames[1]) if len(frames) > 1 else None
        touched = body.get("touched") if isinstance(body, dict) else None
        unsettled = body.get("unsettled") if isinstance(body, dict) else None
        going = body.get("going", []) if isinstance(body, dict) else None
        if (type(touched) is not int or touched < 0 or not isinstance(unsettled, list) or not isinstance(going, list)
                or not all(type(r) is int for r in unsettled + going)):
            raise ProtocolError(f"a malformed JOIN_ROUND: {str(body)[:100]}")
        if self.joining is None:
            return  # a late answer to a freeze that ended
        self.rounds[sender] = (touched, unsettled)
        self.going.update(going)
        servers = scheduler.roster.of_roles(("server",))
        if not all(uid in self.rounds for uid in servers):
            return
        uid, info, peer = self.joining
        self.joining = None
        free = scheduler.roster.free_worker_ranks(self.env.num_workers)
        unsettled_ranks = {r for _, held in self.rounds.values() for r in held}
        ready = [r for r in free if r not in unsettled_ranks]
        wanted = info.get("worker_id")
        if type(wanted) is int:  # DMLC_WORKER_ID: that rank or none
            rank = wanted if wanted in ready else None
            refusal = None if wanted in free else (
                f"a worker at {peer.host}:{peer.port} asked to join as worker {wanted} (DMLC_WORKER_ID), which "
                + ("a member holds" if 0 <= wanted < self.env.num_workers
                   else f"is not one of the job's ranks 0..{self.env.num_workers - 1} (DMLC_NUM_WORKER)"))
        else:
            rank = ready[0] if ready else None
            refusal = None if free else (f"a worker at {peer.host}:{peer.port} asked to join, but the job has its "
                                         f"maximum of {self.env.num_workers} workers (DMLC_NUM_WORKER, -n MIN:MAX)")
        if rank is None:
            for server in servers:
                scheduler.transport.send(server, [pack_header(Cmd.JOIN_THAW)])
            if refusal is None:  # a leaver's rank settles within a round: try again shortly
                self.waiting.insert(0, (uid, info, peer))
                self.retry_at = time.monotonic() + 0.05
            else:
                self._refuse(scheduler, uid, info, refusal)
                self.start_next(scheduler)
            return
        self._join(scheduler, uid, info, peer, rank, max(t for t, _ in self.rounds.values()) + 2)
        self.start_next(scheduler)

    def _join(self, scheduler: Any, uid: bytes, info: dict, peer: Any, rank: int, start: int) -> None:
        roster = scheduler.roster
        member = roster.join(uid, info, peer, rank)
        scheduler.transport.connect(uid, endpoint_of(member.peer, scheduler.transport, scheduler.fingerprint,
                                                     self.env.same_host))
        scheduler.transport.watch_liveness(uid)  # a joiner lost later is dropped at once (``drop``)
        self.version += 1
        workers = roster.expected["worker"]
        provider = self._provider_for(roster, rank, self.going)
        note = pack_json({"rank": rank, "node": member.peer.as_record(), "start": start, "workers": workers,
                          "version": self.version, "provider": provider})
        for server in roster.of_roles(("server",)):
            scheduler.transport.send(server, [pack_header(Cmd.WORKER_JOINED), note])
        # each server tells every worker before the round it matters for; a worker that was itself still
        # joining drops a server's word that came before its address book: the scheduler's comes after it
        for other, peer_member in roster.members.items():
            if peer_member.peer.role == "worker" and other != uid and not peer_member.finished:
                scheduler.transport.send(other, [pack_header(Cmd.WORKER_JOINED), note])
        free = roster.free_worker_ranks(self.env.num_workers)
        extra = b',"joined":%d,"free":[%s]' % (start, ",".join(str(r) for r in free).encode())
        scheduler._books.clear()
        scheduler.transport.send(uid, [pack_header(Cmd.ADDRBOOK), scheduler._book(member, extra=extra)])
        self.joined[rank] = (start, time.monotonic())
        if provider >= 0:
            self.providers[rank] = (start, provider)
        else:  # no member to ask: the joiner starts with no scalars
            scheduler.transport.send(uid, [pack_header(Cmd.JOIN_SCALARS), pack_json({"start": start, "scalars": {}})])
        logger.warning("scheduler: worker %d joined the job from %s:%d; it counts from round %d; %d workers",
                       rank, peer.host, peer.port, start, workers)
        self.left.pop(rank, None)

    def scalars(self, scheduler: Any, member: Any, frames: list) -> None:
        """The provider's ``JOIN_SCALARS`` for a joiner: relayed to it.

        Raises:
            ProtocolError: a malformed or oversized body, or scalars no joiner is owed.
        """
        if len(frames) < 2 or len(frames[1].buffer) > SCALARS_LIMIT:
            raise ProtocolError(f"a JOIN_SCALARS of more than {SCALARS_LIMIT} bytes, or without a body")
        body = unpack_json(frames[1])
        rank = body.get("rank") if isinstance(body, dict) else None
        owed = self.providers.get(rank) if type(rank) is int else None
        late = body.get("late") is True if isinstance(body, dict) else False
        if (owed is None or body.get("start") != owed[0] or owed[1] != member.peer.rank
                or not (late or isinstance(body.get("scalars"), dict))):
            raise ProtocolError(f"{member.peer.describe()} sent scalars for worker {rank!r}, which it owes none")
        del self.providers[rank]
        if late:  # asked after its provider was lost, and past that round itself: none has them any more
            self._give_scalars(scheduler, rank, owed[0], None,
                               f"the worker that was to give it the State scalars of round {owed[0]} was lost before "
                               f"it did, and {member.peer.describe()} had passed that round")
            return
        self._give_scalars(scheduler, rank, owed[0], body["scalars"])

    @staticmethod
    def _provider_for(roster: Any, joiner: int, going: Any = frozenset()) -> int:
        """The member that gives a joiner the script's scalars: the lowest rank but the joiner's, one
        that announced its last push only when no other is left (-1: none)."""
        ranks = sorted(m.peer.rank for m in roster.members.values()
                       if m.peer.role == "worker" and m.peer.rank != joiner and not m.finished)
        staying = [r for r in ranks if r not in going]
        return (staying or ranks or [-1])[0]

    def _give_scalars(self, scheduler: Any, rank: int, start: int, scalars: dict | None, error: str = "") -> None:
        target = next((u for u, m in scheduler.roster.members.items()
                       if m.peer.role == "worker" and m.peer.rank == rank), None)
        if target is not None:
            body = {"start": start, "scalars": scalars} if scalars is not None else {"start": start, "error": error}
            scheduler.transport.send(target, [pack_header(Cmd.JOIN_SCALARS), pack_json(body)])

    def _provider_gone(self, scheduler: Any, gone: int) -> None:
        """Worker ``gone`` left or was lost: each joiner it owed scalars asks the next member (a
        ``JOIN_SCALARS`` without scalars is that request), or starts with none when no member is left."""
        self.providers.pop(gone, None)
        self.going.discard(gone)
        for joiner, (start, provider) in list(self.providers.items()):
            if provider != gone:
                continue
            nxt = self._provider_for(scheduler.roster, joiner, self.going)
            if nxt < 0:
                del self.providers[joiner]
                self._give_scalars(scheduler, joiner, start, {})
                continue
            self.providers[joiner] = (start, nxt)
            uid = next(u for u, m in scheduler.roster.members.items() if m.peer.role == "worker" and m.peer.rank == nxt)
            scheduler.transport.send(uid, [pack_header(Cmd.JOIN_SCALARS), pack_json({"rank": joiner, "start": start})])

    @staticmethod
    def _refuse(scheduler: Any, sender: bytes, info: Any, why: str) -> None:
        scheduler._send_once(sender, PeerInfo.from_record({**info, "rank": -1}), Cmd.REGISTER_FAILED, {"error": why})
        logger.warning("scheduler: %s", why)

    def drop(self, scheduler: Any, uid: bytes, member: Any, why: str) -> None:
        """Worker ``member`` is gone without leaving (its process or host was lost: its connection
        closed, or it went silent): the job drops it as if it had left after the last push the
        servers took from it, and goes on. A round it had pushed some keys of but not others sums it
        in those only: a drop is not exact, a leave is. The workers' scripts count it until the round
        each server names as it takes this note (``Joins.relay_loss``), not from whenever this note
        reaches them, so they agree on every step's members (``psnode.worker.elastic``)."""
        peer = member.peer
        scheduler.roster.leave(uid)
        scheduler.barriers.forget(uid)
        scheduler.transport.disconnect(uid)
        self.left[peer.rank] = f"{peer.describe()} (lost)"
        remaining = scheduler.roster.expected["worker"]
        self.version += 1
        note = pack_json({"rank": peer.rank, "node": peer.describe(), "workers": remaining, "version": self.version,
                          "dropped": why})
        for other in scheduler.roster.of_roles(("server", "worker")):
            if not scheduler.roster.members[other].finished:
                try:
                    scheduler.transport.send(other, [pack_header(Cmd.WORKER_LEFT), note])
                except PSNodeError:
                    pass  # gone: its own news
        logger.warning("scheduler: %s was lost (%s); the elastic job drops it: the rounds it did not push to go on "
                       "without it; %d %s on (minimum %d)", peer.describe(), why, remaining,
                       "worker goes" if remaining == 1 else "workers go", self.env.min_workers)
        self._provider_gone(scheduler, peer.rank)
        self.complete_barriers(scheduler)
        if remaining < self.env.min_workers and self.short_since is None:
            self.short_since = time.monotonic()

    @staticmethod
    def complete_barriers(scheduler: Any) -> None:
        """Answer the open barriers every remaining member has reached (the one that left was the last
        one missing)."""
        for group in list(scheduler.barriers.waiting):
            done = scheduler.barriers.complete_if(group, scheduler.roster.size_of(GROUP_ROLES[Group(group)]))
            if done is not None:
                scheduler.desk.answer(group, *done)

    def check(self, workers: int) -> None:
        """Raise ``ElasticError`` once the job has had fewer than its minimum workers for longer than
        ``PSLAUNCH_ELASTIC_TIMEOUT``."""
        if self.short_since is None:
            return
        env = self.env
        if workers >= env.min_workers:
            self.short_since = None
            return
        waited = time.monotonic() - self.short_since
        if waited > env.elastic_timeout:
            gone = ", ".join(self.left.values())
            raise ElasticError(
                f"the job has {workers} worker{'' if workers == 1 else 's'}, fewer than its minimum of "
                f"{env.min_workers} (PSLAUNCH_MIN_WORKERS), and no worker came within {waited:.0f} s "
                f"(PSLAUNCH_ELASTIC_TIMEOUT={env.elastic_timeout:g}); left: {gone}")

