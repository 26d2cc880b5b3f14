"""How a worker's messages leave: in priority order, at once when nothing waits before them, and a
small push held back for the pull that follows it.

``Outbox``: messages wait in a heap ordered by priority (higher first), then call order, and leave
as soon as the connection takes them; a full connection (``WouldBlock``) keeps the rest queued in
that order and the receiving thread retries (``pump``). A message with nothing queued before it is
sent straight from the calling thread. Big values are copied into a send buffer kept per (key part,
server), reused once ZeroMQ has sent the previous one.

``HeldPush`` is one small state machine: a small push to one server may be *held* while the
worker's network thread is *parked* (a caller receives, and is likely to pull next), so that the
pull travels in the same message and both are answered by one reply::

    empty --hold (network thread parked)--> held
    held  --the next pull to that server, same priority--> joined into the pull's message
    held  --anything else sent / a caller waits / the parked thread wakes--> sent on its own

So a held push leaves before anything sent after it, and within the network thread's hand-back
delay at the latest (``worker_receiver``).

*Replicas* (``PSLAUNCH_SERVER_REPLICAS``): what changes a server's keys (pushes, init, the
optimizer, codec parameters, marks) also goes, as it leaves for the server, to each replica of that
server, marked ``FLAG_MIRROR`` (the replica takes it and answers nothing); so a replica holds what
its server holds, round for round. Nothing is held back then (a held push would carry a pull the
replica must not get). When a server is lost (``server_lost``), its rank's messages go to the replica
that takes its place: the ones queued as they are, and the unanswered ones it got that a replica
has no copy of (pulls) again.

Thread-safety: every method may be called from any thread. The heap is only pushed by callers and
popped under the send lock; ``HeldPush`` has its own lock, which is also the one the network thread
parks on.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Any, Callable

import numpy as np

from psnode.errors import PSNodeError, WouldBlock
from psnode.log import logger
from psnode.node.membership import Membership
from psnode.node.protocol import (
    ENTRY_STRUCT,
    FLAG_MIRROR,
    FLAG_OFFER,
    FLAG_PULL,
    Cmd,
    pack_header,
    pack_json,
    pack_push_pull,
    peek,
    unpack_entries,
    with_flags,
)
from psnode.transport.base import Transport, send_while_full

__all__ = ["Outbox", "HeldPush"]


class _Unsent:
    done = False  # a send buffer queued but not yet handed to ZeroMQ is never reused


_UNSENT = _Unsent()

#: What a replica gets a copy of: the messages that change a server's keys.
MIRRORED = frozenset({int(Cmd.PUSH), int(Cmd.INIT), int(Cmd.SET_UPDATER), int(Cmd.SET_CODEC), int(Cmd.MARK)})
_MIRROR_WAIT = 60.0  # seconds a replica's full queue may hold a copy up before the copy is dropped


class _Both:
    """The trackers of a message sent to a server and to its replicas: done once all are."""

    __slots__ = ("trackers",)

    def __init__(self, trackers: list) -> None:
        self.trackers = trackers

    @property
    def done(self) -> bool:
        return all(t.done for t in self.trackers)


class HeldPush:
    """The push held back for the next pull, and the network thread's parking (see the module docstring).

    An item is the outbox's heap entry ``(-priority, order, server, frames, req)``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.parked = False
        self.item: tuple | None = None

    def park(self, timeout: float, stop: threading.Event) -> tuple | None:
        """Park the network thread for up to ``timeout``; return the held item it must now send, if any."""
        with self._cond:
            if not stop.is_set():
                self.parked = True
                self._cond.wait(timeout)
            self.parked = False
            item, self.item = self.item, None
        return item

    def wake(self) -> None:
        """End a park now (the worker stops)."""
        with self._cond:
            self._cond.notify_all()

    def hold(self, item: tuple) -> bool:
        """Hold ``item`` while the network thread is parked and nothing is held; True when held."""
        if not self.parked or self.item is not None:
            return False
        with self._cond:
            if self.parked and self.item is None:
                self.item = item
                return True
        return False

    def take(self) -> tuple | None:
        """The held item, which the caller now sends (None when nothing is held)."""
        if self.item is None:
            return None
        with self._cond:
            item, self.item = self.item, None
        return item


class Outbox:
    """A worker's outgoing messages (see the module docstring).

    ``on_error(req, error)`` ends a request whose message could not be sent.
    """

    def __init__(self, transport: Transport, members: Membership, on_error: Callable[[int, BaseException], None]) -> None:
        self.transport = transport
        self.members = members
        self.on_error = on_error
        self.held = HeldPush()
        self.queue: list = []
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._buffers: dict[tuple[int, int], tuple[np.ndarray, Any]] = {}  # (key id, server) -> (buffer, tracker)
        # PSLAUNCH_SERVER_REPLICAS (see the module docstring); ``on_sent(req, server, frames, mirrored)``
        # hears of each message that left (the request table keeps what a lost server leaves to redo)
        self.replicated = False
        self.on_sent: Callable[[int, int, list, bool], None] | None = None

    # ---- sending -----------------------------------------------------------------------------
    def send(self, server: int, frames: list, priority: int, req: int) -> None:
        """Send one message now when nothing waits before it, else queue it."""
        if self.held.item is None and not self.queue and self._lock.acquire(blocking=False):
            try:
                if not self.queue:
                    try:
                        if self.replicated:
                            self._deliver(server, frames, False, req)
                        else:
                            self.transport.send(self.members.servers[server].uid.encode(), frames, block=False)
                        return
                    except WouldBlock:
                        pass
                    except PSNodeError as exc:
                        self.on_error(req, exc)
                        return
                heapq.heappush(self.queue, (-priority, next(self._order), server, frames, req))
            finally:
                self._lock.release()
            self.pump()
            return
        self.enqueue(server, frames, priority, req)
        self.pump()

    def write_through(self, server: int, frames: list) -> bool:
        """Write a push from the caller's own value before returning, when nothing waits before it
        and the transport can (``Transport.write_through``: an idle data lane): True when written
        (the caller may change the value at once), False when nothing was (queue a copy).

        The send lock is not taken: a data lane keeps its own order, and ZeroMQ's messages need none
        against it; a message queued by another thread meanwhile is a concurrent call's."""
        if self.queue or self.replicated or self.held.item is not None:
            return False
        return self.transport.write_through(self.members.servers[server].uid.encode(), frames) is not None

    def enqueue(self, server: int, frames: list, priority: int, req: int) -> None:
        """Queue a message (``pump`` sends it); a held push goes first, as it was sent first."""
        if self.held.item is not None:
            self.release_held()
        heapq.heappush(self.queue, (-priority, next(self._order), server, frames, req))

    def hold(self, server: int, frames: list, priority: int, req: int) -> bool:
        """Hold a small push for the caller's next pull (see ``HeldPush``); True when held."""
        if self.queue or self.replicated:
            return False
        return self.held.hold((-priority, next(self._order), server, frames, req))

    def requeue(self, item: tuple) -> None:
        """Queue a heap entry taken from the held push (``pump`` sends it)."""
        heapq.heappush(self.queue, item)

    def release_held(self) -> None:
        """Queue the held push, if any: it leaves on its own (``pump`` sends it)."""
        item = self.held.take()
        if item is not None:
            heapq.heappush(self.queue, item)

    def take_held(self, server: int, priority: int) -> tuple | None:
        """The held push when it can carry a pull to ``server`` at ``priority``; any other is released."""
        item = self.held.take()
        if item is None:
            return None
        if item[2] != server or item[0] != -priority:
            heapq.heappush(self.queue, item)
            return None
        return item

    def join_compact(self, held: tuple, pull_req: int, key_id: int, seq: int) -> bool:
        """Send the held push ``held`` and pull ``pull_req`` of part ``key_id`` as one ``PUSH_PULL``
        frame when the push is one part of that very key; False (nothing sent) otherwise.

        The caller has made the pull carry the push (``Request.carried``).
        """
        priority, _, server, push, push_req = held
        if len(push) != 3 or len(push[1]) != ENTRY_STRUCT.size:
            return False
        pushed_key, _, _, codec, _, _, _ = ENTRY_STRUCT.unpack(push[1])
        if pushed_key != key_id:
            return False
        self.send(server, [pack_push_pull(pull_req, push_req, key_id, 0, seq, push[2], codec)], -priority, pull_req)
        return True

    def join(self, held: tuple, pull: list, pull_req: int) -> None:
        """Send the held push ``held`` with pull ``pull_req`` (its frames ``pull``) as one message: the
        push's header gets ``FLAG_PULL`` and the pull's frames follow it, in the push's place in line.

        The caller has made the pull carry the push (``Request.carried``).
        """
        priority, order, server, push, _ = held
        push[0] = with_flags(push[0], FLAG_PULL)
        heapq.heappush(self.queue, (priority, order, server, push + pull, pull_req))
        self.pump()

    def pump(self) -> None:
        """Send queued messages in priority order while the connections take them (any thread)."""
        while self.queue:
            if not self._lock.acquire(blocking=False):
                return  # the holder re-checks the queue after releasing, so nothing is stranded
            try:
                if self._send_queued():
                    return  # a connection is full: the receiving thread retries shortly
            finally:
                self._lock.release()

    def _send_queued(self) -> bool:
        """Send what the connections take; True when one was full. Call with the send lock held."""
        queue = self.queue
        servers = self.members.servers
        while queue:
            item = heapq.heappop(queue)  # atomic: other threads only ever push
            _, _, server, frames, req = item
            cmd, flags = peek(frames[0])
            # a push with big values in frames of their own: know when ZeroMQ is done with them
            track = len(frames) > 3 and cmd == Cmd.PUSH and not flags & FLAG_PULL
            try:
                if self.replicated:
                    tracker = self._deliver(server, frames, track, req)
                else:
                    tracker = self.transport.send(servers[server].uid.encode(), frames, track=track, block=False)
            except WouldBlock:
                heapq.heappush(queue, item)  # same sort key: it keeps its place
                return True
            except PSNodeError as exc:
                self.on_error(req, exc)
                continue
            if tracker is not None:
                self._remember_tracker(server, frames, tracker)
        return False

    # ---- replicas ----------------------------------------------------------------------------
    def _deliver(self, server: int, frames: list, track: bool, req: int) -> Any:
        """Send a message to ``server`` and, when it changes the server's keys, a copy to each of its
        replicas; the tracker of all (when ``track``). Call with the send lock held.

        Raises:
            WouldBlock: the server's queue is full (nothing was sent).
            PSNodeError: the send to the server failed.
        """
        members = self.members
        tracker = self.transport.send(members.servers[server].uid.encode(), frames, track=track, block=False)
        cmd, flags = peek(frames[0])
        replicas = members.replicas.get(server)
        mirrored = bool(replicas) and cmd in MIRRORED and not flags & (FLAG_PULL | FLAG_OFFER)
        if mirrored:
            copy = [with_flags(frames[0], FLAG_MIRROR), *frames[1:]]
            trackers = [tracker] if tracker is not None else []
            for replica in replicas:
                sent = self._mirror(server, replica.uid, copy, track)
                if sent is not None:
                    trackers.append(sent)
            tracker = _Both(trackers) if track and trackers else tracker
        if self.on_sent is not None:
            self.on_sent(req, server, frames, mirrored)
        return tracker

    def _mirror(self, server: int, uid: str, frames: list, track: bool) -> Any:
        """Send a replica its copy; waits while its queue is full (a replica must not fall behind the
        server), as long as it is still one of ``server``'s replicas."""
        peer = uid.encode()
        try:
            return send_while_full(lambda: self.transport.send(peer, frames, track=track, block=False), _MIRROR_WAIT,
                                   lambda: any(p.uid == uid for p in self.members.replicas.get(server, ())))
        except WouldBlock:
            logger.warning("a copy of a message for server %d was not sent to its replica %s: its queue stayed "
                           "full for %g s", server, uid, _MIRROR_WAIT)
            return None
        except PSNodeError as exc:  # the replica is gone: the scheduler tells the job
            logger.info("a copy of a message for server %d was not sent to its replica %s: %s", server, uid, exc)
            return None

    def replica_joined(self, peer: Any) -> None:
        """``peer`` (connected) joined as a replica of server ``peer.rank``: from this point of this worker's
        stream to that server, marked there with a ``SEAM``, the replica gets a copy of what changes its
        keys; the server sends it everything before (psnode.server.snapshot). Under the send lock, so no
        message leaves between the two."""
        with self._lock:
            self.members.replica_joined(peer.rank, peer)
            server = self.members.servers[peer.rank].uid.encode()
            self.transport.send(server, [pack_header(Cmd.SEAM), pack_json({"replica": peer.uid})])
        self.pump()

    def server_lost(self, rank: int, lost: str, by: str | None, requests: Any) -> None:
        """Server ``rank``'s process ``lost`` is gone, and ``by`` (a replica) takes its place (None: a
        replica was lost). The book changes, the lost peer's connection is dropped and, for a
        server, what ``requests`` says must go to the replica again is queued; all under the send
        lock, so no message leaves for a peer that is no longer there."""
        with self._lock:
            self.members.server_lost(rank, lost, by)
            self.transport.disconnect(lost.encode())
            if by is not None:
                for req, frames in requests.server_lost(rank):
                    heapq.heappush(self.queue, (0, next(self._order), rank, frames, req))
        self.pump()

    # ---- send buffers ----------------------------------------------------------------------------
    def copy_for_send(self, slot: tuple[int, int], flat: np.ndarray) -> np.ndarray:
        """A copy of ``flat`` in the buffer kept for ``slot`` (key id, server), reused once ZeroMQ sent it."""
        entry = self._buffers.get(slot)
        if entry is not None and entry[0].nbytes == flat.nbytes and entry[1].done:
            buffer = entry[0]
        else:
            buffer = np.empty_like(flat)
        np.copyto(buffer, flat)
        self._buffers[slot] = (buffer, _UNSENT)
        return buffer

    def _remember_tracker(self, server: int, frames: list, tracker: Any) -> None:
        for key_id, _, frame, _, _, _, _ in unpack_entries(frames[1]):
            if frame:
                entry = self._buffers.get((key_id, server))
                if entry is not None and entry[0] is frames[2 + frame]:
                    self._buffers[(key_id, server)] = (entry[0], tracker)
