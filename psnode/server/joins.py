"""A worker joining a running elastic job, at a server: the freeze while the scheduler agrees the
round it starts from.

The scheduler asks every server to freeze (``JOIN_FREEZE``). A frozen server holds every worker's
message, so no round moves, and answers with the latest round a push reached on any of its keys, the
ranks whose leave is not settled yet (a leaver's push still in an open round: that rank is not given
to a joiner yet) and those that announced their last push (none of them provides a joiner's
scalars). With every answer in, the scheduler takes the start round ``S`` = the latest + 2 and sends
``WORKER_JOINED``. Each server then makes the joiner count from ``S``
(``ServerStore.worker_joined``), tells every worker, and handles what it held, in order. Round
``S - 1`` had no push when the servers froze, so every worker hears of the join before any answer
that lets it compute step ``S``: its ``kv.num_workers`` is the new count at that step boundary.
``JOIN_THAW`` ends a freeze without a join. A freeze longer than ``FREEZE_LIMIT`` seconds fails the
server, naming the scheduler (every wait has an end).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from psnode.errors import PeerDiedError, ProtocolError, TransportError
from psnode.log import logger
from psnode.node.membership import PeerInfo, endpoint_of
from psnode.node.protocol import Cmd, pack_header, pack_json, unpack_json

__all__ = ["Joins", "FREEZE_LIMIT"]

FREEZE_LIMIT = 30.0


class Joins:
    """One server's part in workers joining (see the module docstring). Single-threaded (the server's loop).

    ``handle(peer, cmd, flags, req_id, arg, frames)`` serves a held message once the freeze ends.
    """

    def __init__(self, server: Any, handle: Callable[..., None]) -> None:
        self.server = server
        self.handle = handle
        self.since: float | None = None  # frozen since (None: not frozen)
        self.held: list[tuple] = []
        self.going: set[int] = set()  # workers that announced their last push (``LEAVING``) and may not have left

    def hold(self, message: tuple) -> bool:
        """Keep a worker's ``message`` while frozen (True); False: serve it now."""
        if self.since is None:
            return False
        self.held.append(message)
        return True

    def on_control(self, cmd: int, body: dict) -> None:
        """The scheduler's ``JOIN_FREEZE``, ``WORKER_JOINED`` or ``JOIN_THAW``.

        Raises:
            ProtocolError: a malformed body.
        """
        server = self.server
        if cmd == Cmd.JOIN_FREEZE:
            for group in list(server.groups.by_keys.values()):  # each key its own round, as for a leave
                server.groups.dissolve(group)
            if self.since is None:
                self.since = time.monotonic()
            store = server.store
            going = sorted(r for r in self.going if r not in server.conn.members.left)
            server.conn.link.send(Cmd.JOIN_ROUND, body={"touched": store.touched(),
                                                         "unsettled": sorted(store.unsettled()), "going": going})
        elif cmd == Cmd.WORKER_JOINED:
            self._joined(body)
        elif cmd == Cmd.JOIN_THAW:
            self._thaw()

    def _joined(self, body: dict) -> None:
        server = self.server
        conn = server.conn
        try:
            peer = PeerInfo.from_record(body.get("node"))
            start, version = body.get("start"), body.get("version")
            if type(start) is not int or start < 1 or type(version) is not int:
                raise ProtocolError(f"a WORKER_JOINED of {peer.describe()} from round {start!r} (change {version!r})")
            conn.members.add_worker(peer, conn.env.num_workers)
        except ProtocolError:
            self._thaw()  # what it held is served: a bad notice must not hold the job
            raise
        conn.members.change(peer.rank, True, version)
        conn.transport.connect(peer.uid.encode(), endpoint_of(peer, conn.transport, conn.me.fingerprint,
                                                              conn.env.same_host))
        server.store.worker_joined(peer.rank, start)
        self.going.discard(peer.rank)
        server.invitations.forget_worker(peer.rank)
        server.replies.forget_worker(peer.rank)
        note = [pack_header(Cmd.WORKER_JOINED), pack_json(body)]
        for worker in conn.members.workers:
            if worker.rank in conn.members.left or worker.rank in server.store.finished:
                continue
            try:
                conn.transport.send(worker.uid.encode(), note)
            except TransportError as exc:  # that worker is gone: its own news
                logger.info("server %d: the join notice to worker %d was not sent: %s", server.rank, worker.rank, exc)
        logger.info("server %d: worker %d joined from %s:%d; it counts from round %d", server.rank, peer.rank,
                    peer.host, peer.port, start)
        self._thaw()

    def relay_leave(self, peer: PeerInfo, frames: list) -> None:
        """A worker's ``LEAVING`` (its next push here is its last): tell every other worker now, before
        that push can close a round (it comes after this on the same connection).

        Raises:
            ProtocolError: a malformed notice.
        """
        body = unpack_json(frames[1]) if len(frames) > 1 else None
        last = body.get("last") if isinstance(body, dict) else None
        if type(last) is not int or last < 1:
            raise ProtocolError(f"a LEAVING from {peer.describe()} with last round {last!r}")
        conn = self.server.conn
        self.going.add(peer.rank)  # no provider of a joiner's scalars: it may leave first
        note = [pack_header(Cmd.LEAVING), pack_json({"rank": peer.rank, "last": last})]
        for worker in conn.members.workers:
            if worker.rank != peer.rank and worker.rank not in conn.members.left:
                try:
                    conn.transport.send(worker.uid.encode(), note)
                except TransportError as exc:  # that worker is gone: its own news
                    logger.info("server %d: a leave notice to worker %d was not sent: %s", self.server.rank,
                                worker.rank, exc)

    def relay_loss(self, rank: int, version: int) -> None:
        """Worker ``rank`` was lost (the scheduler dropped it, change ``version``), not a leave: tell every
        other worker the last round its script counts it in, before this server answers anything the
        loss releases (on the same connections). That is the round after the latest one a push reached
        here (``ServerStore.touched``): no worker can have computed the round after it, which needs an
        answer of that round from here, and every worker hears this before any such answer. So every
        worker that pushes and pulls here each step counts the lost worker in the same rounds, whenever
        the scheduler's word reached it (psnode.worker.elastic takes the lowest of its servers'). A
        server without ``dist_sync`` keys names no round (``last`` null)."""
        conn, store = self.server.conn, self.server.store
        last = store.touched() + 1 if any(shard.sync for shard in store.shards.values()) else None
        note = [pack_header(Cmd.LEAVING), pack_json({"rank": rank, "last": last, "lost": version})]
        for worker in conn.members.workers:
            if worker.rank == rank or worker.rank in conn.members.left or worker.rank in store.finished:
                continue
            try:
                conn.transport.send(worker.uid.encode(), note)
            except TransportError as exc:  # that worker is gone: its own news
                logger.info("server %d: the notice of lost worker %d to worker %d was not sent: %s", self.server.rank,
                            rank, worker.rank, exc)

    def _thaw(self) -> None:
        held, self.held, self.since = self.held, [], None
        for message in held:
            try:
                self.handle(*message)
            except ProtocolError as exc:  # answered already (the handler refuses what it cannot use)
                self.server.conn.link.note_malformed(message[0].uid.encode(), exc)

    def check(self, now: float) -> None:
        """Raise once frozen for longer than ``FREEZE_LIMIT`` (the scheduler never ended the freeze).

        Raises:
            PeerDiedError: naming the scheduler.
        """
        if self.since is not None and now - self.since > FREEZE_LIMIT:
            raise PeerDiedError(f"server {self.server.rank}: the scheduler asked it to hold the workers' messages "
                                f"while a worker joins and did not end that within {FREEZE_LIMIT:g} s",
                                "scheduler", 0, "")
