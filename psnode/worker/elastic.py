"""A worker's part when workers join or leave a running elastic job (``psnode.scheduler.elastic``).

The count of members a script sees changes at its step boundaries only, and it is exact: the
members of the round the worker's next push goes to (``members_next``). A leaver says which round
is its last before it pushes to it (``announce_leave``: ``LEAVING`` to every server, which relays it
to every worker before that round closes), so the others know before they compute the round after.
Every worker hears of a join from the servers (``WORKER_JOINED``, before any answer that lets it
compute the joiner's first step): its count of members changes (``kv.num_workers`` at its next step
boundary). The members' lowest rank is the joiner's *provider*: at its first step boundary from the
joiner's start round on (its pushes have reached the round before it) it sends the joiner its
``kvcore.elastic.State`` scalars (``JOIN_SCALARS``, relayed by the scheduler), so the joiner resumes
at the same step. The joiner waits for them in ``scalars``.

A worker that is lost (SIGKILL, its host gone: the scheduler drops it, ``Elastic.drop``) announces
nothing, and the others hear of it whenever the scheduler's word reaches them, each at another place
of its loop. Their scripts still count it in the same rounds: it counts until each server that holds
``dist_sync`` keys names its last round (``Joins.relay_loss``: the round after the latest one a push
reached there, so no worker has computed the round after it, and each hears it before any answer
that lets it compute that round); a worker takes the lowest one named (``lost``, ``on_lost``).
Counting it in a round it no longer pushes to costs that round its share of the batch, never an
agreement: survivors that counted differently would split the data differently and run different
numbers of steps (the last pushes of one of them could then never be summed).

The notes come on the receiving thread; ``at_boundary`` runs on the script's thread. The owed
scalars are a dict swapped whole, so neither needs a lock; the lost workers' are read and
pruned under ``_lost_lock``.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from typing import Any, Callable

from pscontract import MARKER_JOINED
from psnode.errors import ProtocolError, PSNodeError
from psnode.log import logger
from psnode.node.membership import PeerInfo
from psnode.node.protocol import Cmd, pack_header, pack_json, unpack_json

__all__ = ["ElasticMembers"]

_FIRST = 1 << 62  # a leave notice's priority: before anything queued after it (the leaver's last push)
_UNNAMED = 1 << 62  # a lost worker's last round while no server named it: it counts on


class ElasticMembers:
    """Joins as one worker sees them (see the module docstring)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.owed: dict[int, int] = {}  # joiner's rank -> its start round: this worker sends it its scalars
        self.ahead: dict[int, int] = {}  # joiner's rank -> its start round, while this worker's pushes are before it
        self.going: dict[int, int] = {}  # leaver's rank -> its last round, until the scheduler says it left
        # lost worker's rank -> (the scheduler's number of that change, the lowest last round its servers
        # named, None: none yet, how many servers named none: they hold no dist_sync key)
        self.lost: dict[int, tuple[int, int | None, int]] = {}
        self._lost_lock = threading.Lock()
        self._known: tuple[object, tuple[int, ...]] = (None, ())  # (the left set, the members it gives)
        self._scalars: concurrent.futures.Future = concurrent.futures.Future()  # a joiner's, from its provider
        self.scalars_now: Callable[[], dict] = dict  # the script's State scalars (set at its step boundaries)
        worker.before_close(self._flush)  # a provider that ends first still sends what it owes

    def on_note(self, peer: PeerInfo, frames: list) -> None:
        """A server's ``WORKER_JOINED`` (the receiving thread).

        Raises:
            ProtocolError: a malformed note, or not from a server.
        """
        body = unpack_json(frames[1]) if peer.role == "server" and len(frames) > 1 else None
        self._joined(body, peer.describe())

    def _joined(self, body: object, sender: str) -> None:
        """A ``WORKER_JOINED`` note, from a server or the scheduler (both send it: a server's comes in
        time for the round, the scheduler's to a worker that was itself still joining when a server
        sent its own). The first of them counts."""
        if not isinstance(body, dict):
            raise ProtocolError(f"a malformed join notice from {sender}")
        rank, start, version, provider = (body.get(k) for k in ("rank", "start", "version", "provider"))
        worker = self.worker
        if not all(type(v) is int for v in (rank, start, version, provider)) or not 0 <= rank < worker.env.num_workers:
            raise ProtocolError(f"a join notice from {sender} of worker {rank!r} from round {start!r}")
        if rank == worker.rank or not worker.conn.members.change(rank, True, version):
            return  # its own join, or heard from another server already
        self.ahead = {**self.ahead, rank: start}
        if provider == worker.rank:
            self.owed = {**self.owed, rank: start}
        logger.info("worker %d: worker %d joined the job; it counts from round %d; %d workers", worker.rank, rank,
                    start, worker.num_workers)

    def on_leaving(self, peer: PeerInfo, frames: list) -> None:
        """A server relays a leaver's ``LEAVING`` (the receiving thread).

        Raises:
            ProtocolError: a malformed note, or not from a server.
        """
        body = unpack_json(frames[1]) if peer.role == "server" and len(frames) > 1 else None
        rank = body.get("rank") if isinstance(body, dict) else None
        last = body.get("last") if isinstance(body, dict) else None
        if isinstance(body, dict) and "lost" in body:  # a lost worker's last round, as this server names it
            version = body["lost"]
            if (type(rank) is not int or not 0 <= rank < self.worker.env.num_workers or type(version) is not int
                    or version < 1 or not (last is None or (type(last) is int and last >= 1))):
                raise ProtocolError(f"a malformed notice of a lost worker from {peer.describe()}")
            self._named(rank, version, last)
            return
        if type(rank) is not int or type(last) is not int or not 0 <= rank < self.worker.env.num_workers:
            raise ProtocolError(f"a malformed leave notice from {peer.describe()}")
        if rank != self.worker.rank and rank not in self.worker.conn.members.left:
            self.going = {**self.going, rank: last}

    def on_lost(self, rank: int, version: int) -> None:
        """The scheduler dropped worker ``rank`` (lost: change ``version``), the receiving thread, before
        the book says it left: the script counts it until its servers name its last round."""
        if rank == self.worker.rank:
            return
        with self._lost_lock:
            held = self.lost.get(rank)
            if held is None or held[0] < version:
                self.lost = {**self.lost, rank: (version, None, 0)}

    def _named(self, rank: int, version: int, last: int | None) -> None:
        """A server named the last round of lost worker ``rank`` (change ``version``; None: it holds no
        ``dist_sync`` key); the lowest named counts."""
        if rank == self.worker.rank:
            return
        with self._lost_lock:
            held = self.lost.get(rank)
            if held is not None and held[0] > version:
                return  # a loss of an earlier holder of that rank
            _, named, nulls = held if held is not None and held[0] == version else (version, None, 0)
            if last is None:
                nulls += 1
            else:
                named = last if named is None else min(named, last)
            self.lost = {**self.lost, rank: (version, named, nulls)}

    def announce_leave(self) -> int:
        """Tell every server that this worker's next push is its last (its round: returned); sent
        before that push on each connection, so every member hears it before that round closes."""
        worker = self.worker
        last = self._reached() + 1
        body = pack_json({"last": last})
        for server in range(worker.num_servers):
            worker.outbox.enqueue(server, [pack_header(Cmd.LEAVING), body], _FIRST, -1)
        worker.outbox.pump()
        return last

    def on_control(self, cmd: int, body: dict) -> None:
        """The scheduler's ``JOIN_SCALARS`` (the receiving thread): to this joiner, its scalars; without
        scalars, a request to send a joiner its own (its provider left before it did).

        Raises:
            ProtocolError: a malformed body, or scalars to a worker that did not join.
        """
        if cmd == Cmd.WORKER_JOINED:
            self._joined(body, "the scheduler")
            return
        scalars = body.get("scalars")
        if cmd == Cmd.JOIN_SCALARS and "rank" in body:  # a request: the joiner's provider was lost
            rank, start = body.get("rank"), body.get("start")
            if type(rank) is not int or type(start) is not int:
                raise ProtocolError(f"a request for the scalars of worker {rank!r} from round {start!r}")
            if self._reached() >= start:  # past that round: its scalars then are gone (and it may wait for the joiner)
                self.worker.conn.link.send(Cmd.JOIN_SCALARS, body={"rank": rank, "start": start, "late": True})
            else:
                self.owed = {**self.owed, rank: start}
            return
        if cmd == Cmd.JOIN_SCALARS and isinstance(body.get("error"), str) and self.worker.conn.members.joined_at:
            if not self._scalars.done():
                self._scalars.set_exception(PSNodeError(f"worker {self.worker.rank} joined the running job, but "
                                                        f"{body['error'][:300]}: start it again to join anew"))
            return
        if cmd != Cmd.JOIN_SCALARS or not isinstance(scalars, dict) or not self.worker.conn.members.joined_at:
            raise ProtocolError(f"a {Cmd(cmd).name} to worker {self.worker.rank}, which did not join a running job")
        if not self._scalars.done():
            self._scalars.set_result(scalars)

    def started(self) -> None:
        """This worker joined a running job: tell pslaunch (its table shows when)."""
        worker = self.worker
        worker.tell_launcher(f"{MARKER_JOINED} " + json.dumps(
            {"rank": worker.rank, "start": worker.conn.members.joined_at, "workers": worker.num_workers}))

    def _reached(self) -> int:
        """The latest round this worker pushed to (its pushes per key, from the round it joined at)."""
        worker = self.worker
        return max(worker.requests.push_counts.values(), default=0) + max(worker.conn.members.joined_at - 1, 0)

    def members_next(self) -> tuple[int, ...]:
        """Once this step's pulls are in: the ranks of the members of the round this worker's next
        push goes to (a joiner heard of counts from its start round on, a leaver up to its last
        round: both notes come before the answers of the round before; a lost worker up to the last
        round its servers named, see the module docstring)."""
        worker = self.worker
        members = worker.conn.members
        left = members.left  # replaced whole at each change: its identity says nothing changed
        if not (self.ahead or self.going or self.lost):  # read every step: O(1) while the members stay
            if self._known[0] is not left:
                self._known = (left, tuple(rank for rank in range(worker.env.num_workers) if rank not in left))
            return self._known[1]
        round_ = self._reached() + 1
        self.ahead = {rank: start for rank, start in self.ahead.items() if start > round_}
        counting, current = self._lost_in(round_) if self.lost else (set(), set())
        self.going = {rank: last for rank, last in self.going.items() if rank not in left or rank in current}
        ranks = []
        for rank in range(worker.env.num_workers):
            if rank in self.ahead:  # a joiner not counted yet; a lost worker it follows may still be
                member = rank in counting and rank not in current
            elif self.going.get(rank, _UNNAMED) < round_:
                member = False
            elif rank in current or rank in counting:  # lost: until its last round
                member = rank in counting
            else:
                member = rank not in left
            if member:
                ranks.append(rank)
        return tuple(ranks)

    def _lost_in(self, round_: int) -> tuple[set[int], set[int]]:
        """``(the lost workers that count in round round_, the ranks whose holder now is a lost worker)``;
        a loss that counts no more is let go once the book says the rest (it left, or a joiner holds its
        rank)."""
        members, servers = self.worker.conn.members, self.worker.num_servers
        counting: set[int] = set()
        current: set[int] = set()
        with self._lost_lock:
            kept = {}
            for rank, (version, named, nulls) in self.lost.items():
                last = named if named is not None else 0 if nulls >= servers else _UNNAMED
                now = version >= members.version_of(rank)  # no change of that rank since (a join)
                if last < round_ and (rank in members.left or not now):
                    continue
                kept[rank] = (version, named, nulls)
                if now:
                    current.add(rank)
                if last >= round_:
                    counting.add(rank)
            if len(kept) != len(self.lost):
                self.lost = kept
        return counting, current

    def at_boundary(self, scalars: Callable[[], dict]) -> None:
        """At a step boundary of the script: send the scalars owed to joiners whose start round this
        worker's pushes reached (``scalars()`` gives the script's ``State`` scalars now)."""
        self.scalars_now = scalars
        reached = self._reached()
        due = {rank: start for rank, start in self.owed.items() if reached >= start - 1}
        if not due:
            return
        self.owed = {rank: start for rank, start in self.owed.items() if rank not in due}
        self._send(due, scalars())

    def _flush(self) -> None:
        if self.owed:
            due, self.owed = self.owed, {}
            self._send(due, self.scalars_now())

    def _send(self, due: dict[int, int], values: dict) -> None:
        worker = self.worker
        for rank, start in due.items():
            worker.conn.link.send(Cmd.JOIN_SCALARS, body={"rank": rank, "start": start, "scalars": values})

    def scalars(self, timeout: float) -> dict:
        """A joiner's ``State`` scalars as the members had them when its start round began ({} when
        they keep none), once its provider sent them.

        Raises:
            NodeTimeoutError: none came within ``timeout`` seconds; PSNodeError: the node failed.
        """
        self.worker._wait(self._scalars, timeout, "State scalars from the worker that provides them")
        return self._scalars.result()
