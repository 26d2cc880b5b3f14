"""A worker's requests in flight: which are pending, what they wait for, and how replies complete them.

Every call of the worker's API becomes one request: an id, the future the caller holds, the number
of parts still unanswered and, for pulls, where each part's value goes (writable byte views of the
caller's outs). ``take_reply`` reads a server's reply, writes pulled values into their outs, counts
the parts it answered and completes the future when none is left; push acknowledgements arrive on
their own or riding along with a reply. The table also counts the pushes sent per (key part,
server): a pull tells the server how many of them it must include.

Bookkeeping is bounded: one entry per request in flight, one counter per key part. The table also
keeps the worker's traffic counters (``pushed_bytes``, ``pulled_bytes``, ``rounds``: plain integers
bumped where a push is counted and a pull's value is written), which heartbeats report
(``psnode.node.stats``).

Thread-safety: ``track`` and the counters are used by calling threads, ``take_reply`` by the thread
that receives; entries are added and removed with single dictionary operations (atomic in CPython),
and a request's fields are only written by the thread that receives its reply. ``wait_idle`` waits
on the table's own condition.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from typing import Any, Callable

import numpy as np

from psnode.errors import ClosedError, NodeTimeoutError, ProtocolError, RemoteError
from psnode.node.membership import PeerInfo
from psnode.node.protocol import (
    ENTRY_STRUCT,
    FLAG_ACKS,
    FLAG_ERROR,
    HEADER,
    IN_SERVER_MEMORY,
    IN_SHARED_MEMORY,
    Cmd,
    peek_arg,
    unpack_entries,
    unpack_json,
)
from psnode.transport import same_host

__all__ = ["Request", "RequestTable"]


class Request:
    """One request in flight."""

    __slots__ = ("future", "remaining", "targets", "what", "regions", "carried", "servers", "by_rank", "answered")

    def __init__(self, future: concurrent.futures.Future, remaining: int, targets: list | None, what: str,
                 servers: Any = -1) -> None:
        self.future = future
        self.remaining = remaining
        self.targets = targets  # pull: index -> writable byte view of the out
        self.what = what
        # who may answer: a server rank (one server), a tuple of the server of each part, or a set
        self.servers = servers
        self.regions: dict[int, same_host.Region] | None = None  # pull: index -> shared-memory region of the reply
        self.carried: int | None = None  # pull: the push that carried it, done by this pull's reply
        # with replicas (``RequestTable.replicated``): per server rank [parts sent, parts answered, the
        # messages a replica must be sent again if that server is lost], and a pull's answered parts
        self.by_rank: dict[int, list] | None = None
        self.answered: set[int] | None = None


class RequestTable:
    """The requests of one worker (see the module docstring).

    ``failure`` is the worker's latch: once it holds an error no request starts (and one started as
    it fails is failed at once); after ``refuse_new(reason)`` (the worker closed) none starts either.
    """

    def __init__(self, failure: Any) -> None:
        self._failure = failure
        self._refused: str | None = None  # why no request may start any more (the worker closed)
        self.pending: dict[int, Request] = {}
        self.push_counts: dict[tuple[int, int], int] = {}  # (key id, server) -> pushes sent
        # a replacement in place redoing its predecessor's steps: (key id, server) -> the pushes the
        # servers took from the predecessor; its first push past them calls _on_caught_up (``redo_until``)
        self._redoing: dict[tuple[int, int], int] | None = None
        self._on_caught_up: Any = None
        # Counters for heartbeats: written by one thread each (pushes by the caller, pulls by the
        # receiving thread), read by the heartbeat; a caller pushing from several threads at once
        # may lose an increment, which a rate on a dashboard can afford.
        self.pushed_bytes = 0
        self.pulled_bytes = 0
        self.rounds = 0  # pushes of this worker's most pushed key part: its training steps, as a rule
        self._ids = itertools.count(1)  # next() on a count is atomic: no lock needed
        self._idle = threading.Condition()
        self._idle_waiters = 0  # threads in wait_idle (only they need a notify when the table empties)
        # PSLAUNCH_SERVER_REPLICAS: each request keeps per server what was sent and answered, so that
        # a lost server's part of it goes on with the replica that takes its place (``server_lost``)
        self.replicated = False
        # the regions of the servers on this host, mapped to copy a value a reply names there out of
        # (``psnode.server.shared_values``); None: no server shares this host's memory with this worker
        self.server_memory: same_host.Attachments | None = None
        self.from_server_memory = 0  # values copied out of a server's memory (the receiving thread)

    # ---- starting and ending requests ----------------------------------------------------------
    def refuse_new(self, reason: str) -> None:
        """From now on ``track`` raises ``ClosedError(reason)``: the worker closed."""
        self._refused = reason

    def track(self, future: Any, remaining: int, targets: list | None, what: str, servers: Any = -1) -> int:
        """Start a request of ``remaining`` parts sent to ``servers``; return its id.

        ``servers``: the rank of the one server it went to, a tuple of each part's server, or a set
        of ranks; only those servers' replies are taken (``take_reply``).

        Raises:
            PSNodeError: the worker failed (its failure) or was closed (``ClosedError``).
        """
        error = self._failure.error
        if error is not None:
            raise error
        if self._refused is not None:
            raise ClosedError(self._refused)
        req = next(self._ids)
        if remaining == 0:
            future.set_result(None)
            return req
        request = self.pending[req] = Request(future, remaining, targets, what, servers)
        if self.replicated:
            request.by_rank = {}
            if targets is not None and what != "checkpoint" and what != "marks":
                request.answered = set()
        if self._failure.error is not None:  # failed between the check and now: do not leave it hanging
            self.complete(req, self._failure.error)
        return req

    def next_pushes(self, key_ids: list[int], server: int, nbytes: int) -> list[int]:
        """``next_push`` of each part of ``key_ids`` to ``server`` (``nbytes`` in all), in one call: the
        push of a long key list takes no call per key here."""
        counts = self.push_counts
        seqs = []
        for key_id in key_ids:
            slot = (key_id, server)
            seq = counts.get(slot, 0) + 1
            counts[slot] = seq
            seqs.append(seq)
        self.pushed_bytes += nbytes
        top = max(seqs, default=0)
        if top > self.rounds:
            self.rounds = top
        redoing = self._redoing
        if redoing is not None and any(seq > redoing.get((k, server), 0) for k, seq in zip(key_ids, seqs)):
            self.caught_up()
        return seqs

    def next_push(self, key_id: int, server: int, nbytes: int) -> int:
        """Count one more push of part ``key_id`` to ``server`` (``nbytes`` bytes); return its number (from 1)."""
        return self.next_pushes([key_id], server, nbytes)[0]

    def redo_until(self, taken: dict[tuple[int, int], int], on_caught_up: Any) -> None:
        """A replacement in place redoes its predecessor's steps: call ``on_caught_up()`` once, at its
        first push past ``taken`` (the pushes of each ``(key id, server)`` the servers took from the
        predecessor), the first that a round waited for; or at ``caught_up()``."""
        self._redoing, self._on_caught_up = dict(taken), on_caught_up

    def caught_up(self) -> None:
        """The redo is over (its first new push, or the worker finished without one): tell, once."""
        callback, self._redoing, self._on_caught_up = self._on_caught_up, None, None
        if callback is not None:
            callback()

    def note_sent(self, req: int, server: int, frames: list, mirrored: bool) -> None:
        """With replicas: message ``frames`` of request ``req`` left for ``server`` (``mirrored``: its
        replicas got a copy, so they hold what it carries; any other message is sent again to the
        replica that takes the server's place, should it be lost before it answers)."""
        request = self.pending.get(req)
        if request is None or request.by_rank is None:
            return
        entry = request.by_rank.get(server)
        if entry is None:
            entry = request.by_rank[server] = [0, 0, []]
        entry[0] += peek_arg(frames[0])
        if not mirrored:
            entry[2].append(frames)

    def server_lost(self, rank: int) -> list[tuple[int, list]]:
        """Server ``rank`` is lost and a replica takes its place: what of each request went there goes
        on with the replica. Parts of mirrored messages (pushes, init, the optimizer, codecs) count as
        answered, since the replica got its copy as the server did; the other messages (pulls,
        checkpoint and mark requests) that the server did not answer in full are returned as
        ``(req, frames)``, to be sent to the replica (a part answered twice is taken once)."""
        again: list[tuple[int, list]] = []
        done: list[int] = []
        for req, request in list(self.pending.items()):
            entry = None if request.by_rank is None else request.by_rank.pop(rank, None)
            if entry is None:
                continue
            sent, answered, direct = entry
            if direct:
                if answered < sent:
                    again += [(req, frames) for frames in direct]
                continue
            request.remaining -= sent - answered
            if request.remaining <= 0:
                done.append(req)
        for req in done:
            self.complete(req)
        return again

    def pushes(self, key_id: int, server: int) -> int:
        """Pushes of part ``key_id`` sent to ``server`` so far: what a pull must include."""
        return self.push_counts.get((key_id, server), 0)

    def complete(self, req: int, error: BaseException | None = None) -> None:
        """End request ``req`` (with ``error``, or successfully); nothing when it already ended."""
        request = self.pending.pop(req, None)
        if request is None:
            return
        if request.carried is not None:  # the push this pull carried ends with it
            self.complete(request.carried, error)
        try:
            if error is None:
                request.future.set_result(None)
            else:
                request.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass
        if self._idle_waiters and not self.pending:
            with self._idle:
                self._idle.notify_all()

    def fail_all(self, error: BaseException) -> None:
        """End every pending request with ``error``."""
        for req in list(self.pending):
            self.complete(req, error)

    def wait_idle(self, limit: float, failed: Callable[[], bool], who: str) -> None:
        """Block until no request is pending (or ``failed()``).

        A checkpoint request is waited for without a limit: its server answers once the checkpoint
        is on disk, which takes as long as the disk takes, and a server that dies fails the worker
        (``failed()``) within the heartbeat timeout. ``limit`` bounds the wait for any other.

        Raises:
            NodeTimeoutError: requests still pending after ``limit`` seconds (names how many).
        """
        deadline = time.monotonic() + limit
        with self._idle:
            self._idle_waiters += 1
            try:
                while self.pending and not failed():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        if all(r.what == "checkpoint" for r in list(self.pending.values())):
                            remaining = 0.1
                        else:
                            raise NodeTimeoutError(f"{who}: {len(self.pending)} requests still unanswered after {limit:g} s")
                    self._idle.wait(min(remaining, 0.1))
            finally:
                self._idle_waiters -= 1

    # ---- replies (the receiving thread) -----------------------------------------------------------
    def take_reply(self, peer: PeerInfo, cmd: int, flags: int, req_id: int, arg: int, frames: list) -> None:
        """Complete what a server's reply answers.

        Raises:
            ProtocolError: a reply to no pending request, or malformed (the request it answers fails
                with the reason; the message is counted as malformed).
        """
        if cmd == Cmd.PUSH_ACK and not flags & FLAG_ERROR:
            self.take_acks(peer, frames[1])
            return
        if flags & FLAG_ACKS:  # push acknowledgements riding along with a reply
            self.take_acks(peer, frames[-1])
            frames = frames[:-1]
        request = self.pending.get(req_id)
        if request is None:
            raise ProtocolError(f"{Cmd(cmd).name} for unknown request {req_id}")
        if not _sent_to(request, peer):
            raise ProtocolError(f"{Cmd(cmd).name} from {peer.describe()} for request {req_id}, which was not sent there")
        if request.carried is not None:  # any reply to the pull means the server took the push before it
            self.complete(request.carried)
            request.carried = None
        if flags & FLAG_ERROR:
            message = unpack_json(frames[1]).get("error", "unknown error")
            self.complete(req_id, RemoteError(f"{request.what} failed on {peer.describe()}: {message}"))
            return
        try:
            if request.by_rank is None:
                self._take_values(request, cmd, arg, frames, peer)
            else:
                self._take_values_once(request, cmd, arg, frames, peer)
        except (ProtocolError, IndexError, KeyError, TypeError, ValueError) as exc:
            self.complete(req_id, ProtocolError(f"{request.what}: malformed reply from {peer.describe()}: {exc}"))
            raise  # and the message is counted as malformed
        if request.remaining <= 0:
            self.complete(req_id)

    def take_acks(self, peer: PeerInfo, frame: Any) -> None:
        """Count acknowledged push parts: ``(req_id, parts)`` u64 pairs (only of pushes sent to ``peer``)."""
        pending = self.pending
        buffer = frame.buffer
        if len(buffer) % 16:
            raise ProtocolError(f"push acknowledgements of {len(buffer)} bytes, not a multiple of 16")
        for rid, count in np.frombuffer(buffer, dtype=np.uint64).reshape(-1, 2).tolist():
            request = pending.get(rid)
            if request is not None and _sent_to(request, peer):
                request.remaining -= count
                if request.by_rank is not None:
                    _count_answered(request, peer.rank, count)
                if request.remaining <= 0:
                    self.complete(rid)

    def _take_values(self, request: Request, cmd: int, arg: int, frames: list, peer: PeerInfo,
                     skip: set[int] | None = None) -> None:
        """Write a reply's values into the request's outs and count the parts it answered (but for
        the parts in ``skip``: answered before, ``_take_values_once``)."""
        peer_rank = peer.rank
        if cmd == Cmd.VALUE:  # one part, in the header frame (protocol's compact form)
            self.pulled_bytes += _write_value(request, arg, frames[0].buffer)
            request.remaining -= 1
        elif cmd in (Cmd.PULL_REPLY, Cmd.ROWS_REPLY):
            if len(frames) == 3 and len(request.targets) == 1:  # one part in the message (most small pulls)
                self.pulled_bytes += self._write_one(request, frames[1].buffer, frames[2].buffer, peer)
                request.remaining -= 1
                return
            buffers = [f.buffer for f in frames[2:]]
            entries = unpack_entries(frames[1], [len(b) for b in buffers])
            targets = request.targets
            servers = request.servers if type(request.servers) is tuple else None
            taken = len(entries)
            pulled = 0
            for _, index, frame, _, offset, nbytes, receipt in entries:  # (a step per part: kept lean)
                if skip and index in skip:
                    taken -= 1
                    continue
                if servers is not None and servers[index] != peer_rank:
                    raise ProtocolError(f"a reply for part {index}, which server {peer_rank} was not asked for")
                target = targets[index]
                if nbytes != target.nbytes:
                    raise ProtocolError(f"reply part of {nbytes} bytes for an out of {target.nbytes} bytes")
                if frame >= IN_SERVER_MEMORY:  # in shared memory (unpack_entries checked every other frame)
                    self._from_shared_memory(request, index, frame, target, offset, receipt, peer)
                else:
                    data = buffers[frame]
                    if data is not target:  # (a data lane read it into the out already: ``lane_target``)
                        target[:] = data[offset:offset + nbytes]
                pulled += nbytes
            self.pulled_bytes += pulled
            request.remaining -= taken
        elif cmd in (Cmd.INIT_ACK, Cmd.SET_UPDATER_ACK, Cmd.SET_CODEC_ACK):
            request.remaining -= arg
        elif cmd == Cmd.CHECKPOINT_REPLY:  # a JSON result per server, gathered in the request's list
            if len(frames) != 2 or request.targets is None or request.what != "checkpoint":
                raise ProtocolError(f"a CHECKPOINT_REPLY of {len(frames)} frames for a {request.what}")
            request.targets.append((peer_rank, unpack_json(frames[1])))
            request.remaining -= 1
        elif cmd == Cmd.MARKS_REPLY:  # a server's kept marks of this rank: the JSON list, a counts frame each, taken
            if request.targets is None or request.what != "marks" or len(frames) < 3:
                raise ProtocolError(f"a MARKS_REPLY of {len(frames)} frames for a {request.what}")
            listed = unpack_json(frames[1])
            if not isinstance(listed, list) or len(listed) != len(frames) - 3:
                raise ProtocolError(f"a MARKS_REPLY listing {str(listed)[:80]} with {len(frames) - 3} count frames")
            request.targets.append((peer_rank, listed, [bytes(f.buffer) for f in frames[2:]]))
            request.remaining -= 1
        else:
            raise ProtocolError(f"a worker does not accept {Cmd(cmd).name}")


    def lane_target(self, req_id: int, index: int, nbytes: int, server: int) -> memoryview | None:
        """Where the value of a reply that comes on a data lane may be read straight to (any thread):
        the out of part ``index`` of pull ``req_id`` when that pull waits for it from ``server`` and
        the out has ``nbytes``; else None (``psnode.node.data_lanes``). The reply then names the out
        itself as its value frame, and ``take_reply`` copies nothing."""
        request = self.pending.get(req_id)
        if request is None or request.what != "pull" or request.targets is None:
            return None
        targets, servers = request.targets, request.servers
        if not 0 <= index < len(targets) or (request.regions is not None and index in request.regions):
            return None
        asked = servers if type(servers) is int else servers[index] if type(servers) is tuple else None
        if asked != server:
            return None
        target = targets[index]
        return target if target.nbytes == nbytes else None

    def _write_one(self, request: Request, meta: memoryview, data: memoryview, peer: PeerInfo) -> int:
        """Write the one part of a reply into its out (the common case of ``_take_values``); return the
        bytes written."""
        if len(meta) != ENTRY_STRUCT.size:
            raise ProtocolError(f"reply meta frame of {len(meta)} bytes for one part")
        _, index, frame, _, offset, nbytes, receipt = ENTRY_STRUCT.unpack_from(meta)
        target = request.targets[index]
        if nbytes != target.nbytes:
            raise ProtocolError(f"reply part of {nbytes} bytes for an out of {target.nbytes} bytes")
        if self._from_shared_memory(request, index, frame, target, offset, receipt, peer):
            return nbytes
        if frame != 0 or offset + nbytes > len(data):
            raise ProtocolError("a reply part lies outside the message's data frame")
        target[:] = data[offset:offset + nbytes]
        return nbytes

    def _from_shared_memory(self, request: Request, index: int, frame: int, target: memoryview, ref: int,
                            receipt: int, peer: PeerInfo) -> bool:
        """Write part ``index`` into ``target`` when its reply entry says it lies in shared memory: this
        worker's pull region (``IN_SHARED_MEMORY``), or ``peer``'s region ``ref`` (``IN_SERVER_MEMORY``,
        ``psnode.server.shared_values``: then ``receipt`` goes into the part's pull region, and the
        server may change that value again). False: the value is in the message.

        Raises:
            ProtocolError: the part was not asked for in shared memory, or ``ref`` is not a region of
                ``peer``'s of this job (the message names why).
        """
        if frame == IN_SHARED_MEMORY:
            target[:] = request.regions[index].array
            return True
        if frame != IN_SERVER_MEMORY:
            return False
        region = request.regions.get(index) if request.regions is not None else None
        if region is None or self.server_memory is None:
            raise ProtocolError(f"a reply of {peer.describe()} names its memory for part {index}, which was not "
                                "asked for in shared memory")
        try:
            view = self.server_memory.view(ref, target.nbytes, peer.pid)
        except (OSError, ValueError) as exc:
            raise ProtocolError(f"{peer.describe()} named a region this worker cannot read: {exc}") from exc
        target[:] = view
        region.receipt[0] = receipt
        self.from_server_memory += 1
        return True

    def _take_values_once(self, request: Request, cmd: int, arg: int, frames: list, peer: PeerInfo) -> None:
        """``_take_values`` with replicas: a part answered before is not taken twice, and the parts each
        server answered are counted. A lost server may have answered some parts of a pull message
        (their rounds closed one by one) before it died; the replica it was sent to again answers
        every part of it, in one reply: the parts answered before are skipped."""
        before = request.remaining
        answered = request.answered
        again = None
        if answered is not None and cmd in (Cmd.VALUE, Cmd.PULL_REPLY, Cmd.ROWS_REPLY):
            indexes = _reply_indexes(cmd, arg, frames)
            again = indexes & answered
            if again and indexes <= answered:
                return
            answered |= indexes
        self._take_values(request, cmd, arg, frames, peer, again)
        _count_answered(request, peer.rank, before - request.remaining)


def _reply_indexes(cmd: int, arg: int, frames: list) -> set[int]:
    """The part indexes a pull reply answers."""
    if cmd == Cmd.VALUE:
        return {arg}
    return {entry[1] for entry in unpack_entries(frames[1])}


def _count_answered(request: Request, rank: int, parts: int) -> None:
    entry = request.by_rank.get(rank) if request.by_rank is not None else None
    if entry is None:
        entry = request.by_rank[rank] = [0, 0, []]
    entry[1] += parts


def _sent_to(request: Request, peer: PeerInfo) -> bool:
    """True when ``peer`` is a server ``request`` went to (a reply from any other node is forged)."""
    servers = request.servers
    if peer.role != "server":
        return False
    if type(servers) is int:
        return servers == peer.rank or servers < 0
    return peer.rank in servers


def _write_value(request: Request, index: int, frame: memoryview) -> int:
    """Write a ``VALUE`` reply into the out of part ``index``; return the bytes written."""
    targets = request.targets
    if targets is None or not 0 <= index < len(targets):
        raise ProtocolError(f"VALUE for part {index} of a request with {len(targets or ())} parts")
    target = targets[index]
    if len(frame) - HEADER.size != target.nbytes:
        raise ProtocolError(f"VALUE of {len(frame) - HEADER.size} bytes for an out of {target.nbytes} bytes")
    target[:] = frame[HEADER.size:]
    return target.nbytes
