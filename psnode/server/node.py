"""A server node: decodes workers' requests, runs them on its ``ServerStore`` and replies.

The parts: a ``node.Connection`` (transport, address book, scheduler link, receive loop), the
``ServerStore`` (shards and their rounds), the ``Groups`` fast path for key lists, the ``Replies``
(pull replies per batch, held acknowledgements), the codec table that decodes pushes, the ``Joins``
(workers joining an elastic job) and the ``Seeding`` (a replica that joins gets this server's keys).
This module is the façade that reads each request and hands it to them.

The server is single-threaded: its one loop receives, merges, applies the updater and sends
replies, so no part needs a lock.

The updater a worker ships (``SET_UPDATER``) is unpickled here: it is called as
``updater(key, merged, stored)`` and must update ``stored`` in place; if it has ``init_key(key,
value)`` that is called for every key this server holds. For keys split across servers (big
arrays) the server sees flat 1-D shards of the key, not the key's shape.
"""

from __future__ import annotations

import collections
import pickle
import time
from typing import Any, Callable

import numpy as np

from psnode.compression.codecs import RAW, CodecTable
from psnode.env import NodeEnv
from psnode.errors import ClosedError, ProtocolError, RequestRefused, TransportError
from psnode.log import logger
from psnode.node import data_lanes
from psnode.node.bulk import gc_paused
from psnode.node.connection import Connection
from psnode.node.membership import PeerInfo
from psnode.node.protocol import (
    FLAG_MIRROR,
    FLAG_OFFER,
    FLAG_PULL,
    FLAG_REDO,
    FLAG_SYNC,
    IN_SHARED_MEMORY,
    PUSH_PULL,
    Cmd,
    Group,
    pack_entries,
    pack_header,
    pack_json,
    unpack_codec_params,
    unpack_entries,
    unpack_header,
    unpack_json,
    unpack_push_pull,
)
from psnode.node.stalls import StallClock, say_stall
from psnode.node.stats import server_report
from psnode.server.checkpoints import Checkpoints
from psnode.server.groups import Groups
from psnode.server.invitations import Invitations
from psnode.server.joins import Joins
from psnode.server.marks import read_mark
from psnode.server.replies import Replies
from psnode.server.seeding import Seeding
from psnode.server.shard_memory import shard_memory
from psnode.server.shared_values import SharedValues
from psnode.server.stalls import StallWatch
from psnode.server.store import ServerStore, Shard, init_value
from psnode.transport import same_host
from psnode.transport.base import Transport

__all__ = ["ServerNode"]

_REPLY_TO = {Cmd.MARKS: Cmd.MARKS_REPLY, Cmd.PULL: Cmd.PULL_REPLY, Cmd.PUSH: Cmd.PUSH_ACK, Cmd.INIT: Cmd.INIT_ACK, Cmd.ROWS: Cmd.ROWS_REPLY,
             Cmd.SET_UPDATER: Cmd.SET_UPDATER_ACK, Cmd.SET_CODEC: Cmd.SET_CODEC_ACK,
             Cmd.CHECKPOINT: Cmd.CHECKPOINT_REPLY}


class ServerNode:
    """A server of the job; ``run()`` serves until the scheduler shuts the job down."""

    def __init__(self, env: NodeEnv, transport: Transport | None = None) -> None:
        # big values in regions the workers on this host copy out themselves (psnode.server.shared_values)
        shared = SharedValues(same_host.job_tag(env.job_id)) if env.same_host == "shm" and not env.replica else None
        memory = shard_memory(env.server_device, shared)
        self.store = ServerStore(env.num_workers, memory)
        # versioned rounds: a dist_sync worker may be replaced in place, or a replica answer for a lost
        # server (the value after the round a pull names, and a repeated push taken once)
        self.store.replay = env.restart_scope == "worker" or env.server_replicas > 0
        self.store.replicated = env.server_replicas > 0
        self.codecs = CodecTable()
        self.attached = same_host.Attachments(same_host.job_tag(env.job_id))
        # a replica (PSLAUNCH_SERVER_REPLICA=1) registers as one: it takes the workers' copies of what they
        # send its server (``_mirrored``) and serves as that server once the scheduler says it is lost
        self.conn = Connection(env, "replica" if env.replica else "server", self._handle, transport,
                               on_worker_finished=self._worker_finished, on_worker_rejoined=self._worker_rejoined)
        # a scheduler started in place learns from the servers which workers finished the job already
        self.conn.link.rejoin_info = lambda: {"finished": {str(r): d for r, d in self.store.finished.items()}}
        self.replies = Replies(self.conn.transport, self.conn.members, memory, self.attached,
                               alone_from=data_lanes.LANE_MIN if self.conn.data_lanes is not None else 0)
        self.conn.serve_with(after_batch=self.replies.after_batch, deferred=self.replies)
        self.groups = Groups(self.store, self.replies)
        self.invitations = Invitations(env.push_window, self._invite)
        self.checkpoints = Checkpoints(self.store, self.groups, env.checkpoint_dir, env.num_servers, env.job_id,
                                       lambda: self.conn.rank, self.conn.link.beat)
        self._deferred_rows: list[tuple[PeerInfo, int, list]] = []  # row pulls waiting for a round
        self.stalls = StallWatch(StallClock.of(env))  # rounds that wait, said in the log (psnode.node.stalls)
        # a replica's: copies of pushes that came before their key's init or their codec's parameters
        self._held_copies: dict[int, collections.deque] = {}
        self._configured_codecs: set[int] = set()
        # a replica joining the running job: the server sends it its keys (psnode.server.seeding)
        self.seeding = Seeding(self, self._mirrored)
        self.conn.link.on_replica = self.seeding.replica_joining
        self.conn.link.on_worker_left = self._worker_left
        # an elastic job's joiners: the freeze while the scheduler agrees the round they start from
        self.joins = Joins(self, self._handle)
        self.conn.link.on_join = self.joins.on_control
        self.store.left = set(self.conn.members.left)  # ranks no worker holds yet: rounds do not wait for them
        self.conn.link.on_server_lost = self.seeding.server_lost
        self.timeline = self.conn.timeline
        if self.timeline is not None:  # PSLAUNCH_TIMELINE: each push's merge and each round's update, per key
            self.store.trace(self.timeline)
            self.groups.timeline = self.timeline
        if env.stats_interval > 0:
            self.conn.link.report = lambda: server_report(self)

    @property
    def rank(self) -> int:
        """This server's rank (-1 until registered)."""
        return self.conn.rank

    def register(self) -> None:
        """Register with the scheduler and connect to the workers (blocking; see ``Connection.register``)."""
        self.conn.register()

    def run(self) -> int:
        """Register (unless done already), serve until shutdown; return the exit code (0: the job ended in order).

        Raises:
            PSNodeError: the job failed (a node died, the scheduler went silent ...).
        """
        conn = self.conn
        if conn.rank < 0:
            conn.register()
        link, failure = conn.link, conn.failure
        checkpoints = self.checkpoints
        stalls = self.stalls
        while not link.shutdown_requested and failure.error is None:
            conn.process(0.005 if checkpoints.busy else 0.1)  # a commit's answer waits on the background
            checkpoints.poll()
            if self.joins.since is not None:
                self.joins.check(time.monotonic())
            if stalls.clock.on:
                for line, waiting_for, level, came, waited, what in stalls.look(
                        time.monotonic(), self.store.shards.values(), conn.env.num_workers,
                        self._gone(), self._host_of):
                    error = say_stall(conn.env, f"server {self.rank}", line, waiting_for, level, self.timeline, waited,
                                      what)
                    self._tell_waiting(came, line)
                    if error is not None:  # a job started by hand: every node hears why it ends
                        conn.link.send(Cmd.NODE_DIED, body={"message": str(error)})
                        failure.fail(error)
        failure.check()
        return 0

    def _tell_waiting(self, workers: list[int], line: str) -> None:
        """Send a stall's line to the workers waiting on it (``STALLED``), which say it in their logs:
        a job started by hand shows it where the user looks, at the workers that wait."""
        for worker in workers:
            try:
                self.conn.transport.send(self.conn.members.workers[worker].uid.encode(),
                                         [pack_header(Cmd.STALLED), pack_json({"text": line})])
            except (TransportError, IndexError) as exc:  # the worker is gone: its own news
                logger.info("server %d: the stall notice to worker %d was not sent: %s", self.rank, worker, exc)

    def _host_of(self, worker: int) -> str:
        workers = self.conn.members.workers
        return workers[worker].host if 0 <= worker < len(workers) else "?"

    def barrier(self, group: "Group | int | str" = Group.SERVERS, timeout: float | None = None) -> None:
        """Block (serving meanwhile) until every node of ``group`` (servers or all) reached a barrier.

        Raises:
            ValueError, PSNodeError, PeerDiedError, NodeTimeoutError: see ``Connection.ask_barrier``.
        """
        future, what = self.conn.ask_barrier(group)
        self.conn.wait(future, timeout, what)

    def close(self) -> None:
        """Let the checkpoint work under way finish (a few seconds at most) and answer it, close the
        sockets, giving queued replies a moment to leave; write the timeline's last events."""
        try:
            self.checkpoints.close()
        except ClosedError:
            pass  # the transport is gone already: nobody to answer
        self.conn.close(linger=0.5)
        if self.timeline is not None:
            self.timeline.close()

    # ---- requests ------------------------------------------------------------------------
    def _handle(self, peer: PeerInfo, cmd: int, flags: int, req_id: int, arg: int, frames: list) -> None:
        """Serve one message of a member; whatever goes wrong becomes an error reply to its request.

        The message comes from the network: a malformed one must neither kill this server nor leave
        the worker that sent it waiting (the error names what was wrong), and it is counted too.
        """
        if cmd == Cmd.SNAPSHOT and peer.role == "server" and self.conn.env.replica and peer.rank == self.rank:
            self.seeding.take_snapshot(frames[1:])
            return
        if peer.role != "worker":
            raise ProtocolError(f"{Cmd(cmd).name} from {peer.describe()}")
        if self.joins.since is not None and self.joins.hold((peer, cmd, flags, req_id, arg, frames)):
            return  # a worker joins: no round moves until its start round is agreed (psnode.server.joins)
        try:
            self._serve(peer, cmd, flags, req_id, arg, frames)
        except ClosedError:
            raise
        except Exception as exc:
            name = Cmd(cmd).name
            why = f"a malformed {name} from {peer.describe()}: {type(exc).__name__}: {exc}"
            if cmd == Cmd.PUSH_PULL:  # both of its requests are answered
                self.replies.refuse(peer, Cmd.PUSH_ACK, arg, why)
                self.replies.refuse(peer, Cmd.PULL_REPLY, req_id, why)
            elif cmd in _REPLY_TO:
                self.replies.refuse(peer, _REPLY_TO[cmd], req_id, why)
            raise ProtocolError(why) from exc

    def _serve(self, peer: PeerInfo, cmd: int, flags: int, req_id: int, arg: int, frames: list) -> None:
        if flags & FLAG_MIRROR:
            if not self.seeding.hold_copy((peer, cmd, flags, req_id, frames)):  # after the server's keys, which come first
                self._mirrored(peer, cmd, flags, req_id, frames)
            return
        if cmd == Cmd.SEAM:
            self.seeding.seam(peer, frames)
            return
        if cmd == Cmd.PUSH_PULL:
            if len(frames) != 1:
                raise ProtocolError(f"PUSH_PULL of {len(frames)} frames")
            self._push_pull(peer, frames[0].buffer)
            if self.replies.answers:  # the round closed: reply now rather than after the batch
                self.replies.flush()
            return
        if cmd == Cmd.LEAVING:  # an elastic job's worker: its next push is its last; every worker hears it first
            self.joins.relay_leave(peer, frames)
            return
        if cmd == Cmd.MARK:  # no answer: a mark costs its worker no round trip
            self.store.add_mark(peer.rank, read_mark(frames[1:], max(len(self.store.shards), 1)))
            return
        reply = _REPLY_TO.get(cmd)
        if reply is None:
            raise ProtocolError(f"a server does not accept {Cmd(cmd).name}")
        pull = None
        if flags & FLAG_PULL:  # a small push and the pull that followed it share one message
            if cmd != Cmd.PUSH or len(frames) < 5:
                raise ProtocolError(f"{Cmd(cmd).name} of {len(frames)} frames with a pull attached")
            frames, pull = frames[:-2], frames[-2:]
            pull_cmd, pull_flags, pull_req, pull_arg = unpack_header(pull[0])
            if pull_cmd != Cmd.PULL or pull_flags:
                raise ProtocolError(f"{Cmd(pull_cmd).name} attached to a push where a pull belongs")
        malformed = self._request(peer, cmd, reply, flags, req_id, arg, frames, pull is None)
        if pull is not None:  # after the push, so the pull's count of this worker's pushes includes it
            malformed = self._request(peer, Cmd.PULL, Cmd.PULL_REPLY, 0, pull_req, pull_arg, pull) or malformed
        if malformed is not None:
            raise malformed

    def _request(self, peer: PeerInfo, cmd: int, reply: int, flags: int, req_id: int, arg: int, frames: list,
                 ack: bool = True) -> ProtocolError | None:
        """Run one request (a push, pull, row pull, init, updater, codec or checkpoint); refusals go back
        as error replies.

        ``ack=False``: a push that carried a pull is acknowledged by that pull's reply (the worker
        completes both on it), so it gets no acknowledgement of its own. A malformed request is
        answered with an error too, and returned (the caller counts it once the message is done).
        """
        try:
            if cmd == Cmd.PUSH and flags & FLAG_OFFER:  # a big part announced: its value comes when invited
                self._offer(peer, req_id, frames)
            elif cmd == Cmd.PUSH:
                self._push(peer, req_id, frames)
                if ack:
                    self.replies.ack(peer.rank, req_id, arg)
                if self._deferred_rows:
                    deferred, self._deferred_rows = self._deferred_rows, []
                    for args in deferred:
                        self._rows(*args)
            elif cmd == Cmd.PULL:
                self._pull(peer, req_id, frames)
            elif cmd == Cmd.MARKS:
                listed, counts = self.store.worker_marks(peer.rank)
                self.conn.transport.send(peer.uid.encode(), [pack_header(reply, req_id, arg), pack_json(listed), *counts])
            elif cmd == Cmd.ROWS:
                self._rows(peer, req_id, frames)
            elif cmd == Cmd.INIT:
                self._init(frames, bool(flags & FLAG_SYNC), bool(flags & FLAG_REDO))
                self.replies.reply(peer, reply, req_id, arg)
            elif cmd == Cmd.SET_UPDATER:
                self._set_updater(peer, frames, bool(flags & FLAG_REDO))
                self.replies.reply(peer, reply, req_id, arg)
            elif cmd == Cmd.SET_CODEC:
                self._set_codec(frames)
                self.replies.reply(peer, reply, req_id, arg)
            elif cmd == Cmd.CHECKPOINT:
                if len(frames) != 2:
                    raise RequestRefused(f"CHECKPOINT of {len(frames)} frames, expected 2 (header, JSON body)")
                try:
                    body = unpack_json(frames[1])
                except ProtocolError as exc:
                    raise RequestRefused(f"server {self.rank}: {exc}") from None
                self.checkpoints.handle(peer.rank, body, self._answer_checkpoint(peer, reply, req_id, arg))
        except RequestRefused as exc:
            self.replies.refuse(peer, reply, req_id, str(exc))
        except ClosedError:
            raise
        except Exception as exc:  # from the network: answered, counted, never fatal
            why = f"a malformed {Cmd(cmd).name} from {peer.describe()}: {type(exc).__name__}: {exc}"
            self.replies.refuse(peer, reply, req_id, why)
            return ProtocolError(why)
        return None

    def _mirrored(self, peer: PeerInfo, cmd: int, flags: int, req_id: int, frames: list) -> None:
        """A worker's copy of what it sent this replica's server: taken as the server takes it, and
        answered by no one here (the server answers; a refusal there is the worker's error). Raises
        ProtocolError for anything else marked as a copy (counted as malformed)."""
        if not self.conn.env.replica:
            raise ProtocolError(f"a copy of a {Cmd(cmd).name} for a replica, but this server is none")
        try:
            if cmd == Cmd.PUSH and not flags & (FLAG_PULL | FLAG_OFFER):
                held = self._held_copies.get(peer.rank)
                if held or not self._can_take_copy(frames):
                    # a copy of a push can overtake worker 0's copy of the init of its key, or of its codec's
                    # parameters (they come by two sockets): held, with every later copy from that worker,
                    # until those are here
                    self._held_copies.setdefault(peer.rank, collections.deque()).append((peer, req_id, frames))
                    return
                self._push(peer, req_id, frames)
            elif cmd == Cmd.INIT:
                self._init(frames, bool(flags & FLAG_SYNC), bool(flags & FLAG_REDO))
                self._release_held_copies()
            elif cmd == Cmd.SET_UPDATER:
                self._set_updater(peer, frames, bool(flags & FLAG_REDO))
            elif cmd == Cmd.SET_CODEC:
                self._set_codec(frames)
                self._release_held_copies()
            elif cmd == Cmd.MARK:
                self.store.add_mark(peer.rank, read_mark(frames[1:], max(len(self.store.shards), 1)))
            else:
                raise ProtocolError(f"a copy of a {Cmd(cmd).name} for a replica, which takes pushes, init, the "
                                    "optimizer, codecs and marks only")
        except RequestRefused as exc:  # refused by the server too, which tells the worker
            logger.info("replica of server %d: %s", self.rank, exc)

    def _can_take_copy(self, frames: list) -> bool:
        """Whether every key part a push message names is here, with the parameters of its codec."""
        shards, configured = self.store.shards, self._configured_codecs
        return all(key in shards and (codec == RAW or codec in configured)
                   for key, _, _, codec, _, _, _ in unpack_entries(frames[1], [len(f.buffer) for f in frames[2:]]))

    def _release_held_copies(self) -> None:
        """Take the held copies of pushes whose keys are all here now, each worker's in order."""
        for rank, held in self._held_copies.items():
            while held and self._can_take_copy(held[0][2]):
                peer, req_id, frames = held.popleft()
                try:
                    self._push(peer, req_id, frames)
                except RequestRefused as exc:
                    logger.info("replica of server %d: %s", self.rank, exc)

    def _answer_checkpoint(self, peer: PeerInfo, reply: int, req_id: int, arg: int) -> Callable[[bool, Any], None]:
        """How checkpoint request ``req_id`` of ``peer`` is answered: now, or later from ``run``'s loop."""
        def answer(ok: bool, value: Any) -> None:
            try:
                if ok:
                    self.conn.transport.send(peer.uid.encode(), [pack_header(reply, req_id, arg), pack_json(value)])
                else:
                    self.replies.refuse(peer, reply, req_id, str(value))
            except TransportError as exc:  # answered late: the worker may be gone, which is no failure of this server
                logger.info("server %d: the answer to %s's checkpoint request was not sent: %s", self.rank,
                            peer.describe(), exc)
        return answer

    def _shard(self, key_id: int) -> Shard:
        """The shard of ``key_id``, taken off the group fast path first if it is on it."""
        shard = self.store.shard(key_id)
        if shard.group is not None:
            self.groups.dissolve(shard.group)
        return shard

    def _decode(self, shard: Shard, worker: int, codec: int, data: Any, nbytes: int) -> np.ndarray:
        """The values a push of ``shard`` carries (``data``: its ``nbytes`` encoded bytes).

        Raises:
            RequestRefused: the bytes do not encode the shard's size, an unknown codec, or one that
                cannot decode it (no parameters yet, another dtype); the push still counts as received.
        """
        if codec == RAW:  # the common case, without the table
            if nbytes != shard.nbytes:
                raise self.store.wrong_size(shard, worker, nbytes)
            return np.frombuffer(data, dtype=shard.dtype, count=shard.size)
        try:
            decoder = self._check_encoded(shard, codec, nbytes)
            return decoder.decode(data, shard.dtype, shard.size)
        except RequestRefused:
            shard.round.count_refused(worker)  # its worker counted it: later pulls must not wait for it
            raise

    def _check_encoded(self, shard: Shard, codec: int, nbytes: int, what: str = "push") -> Any:
        """The codec ``codec`` (not ``RAW``), once ``nbytes`` is what it makes of ``shard``'s values (a
        push's bytes, or those a pull asks its reply in).

        Raises:
            RequestRefused: an unknown codec, or another size (the message names both).
        """
        decoder = self.codecs.get(codec)
        expected = decoder.encoded_nbytes(shard.size, shard.dtype)
        if nbytes != expected:
            raise RequestRefused(f"key {shard.user_key!r}: a {decoder.name} {what} of {nbytes} bytes, but the "
                                 f"{shard.size} values held here take {expected} bytes in {decoder.name}")
        return decoder

    def _push_pull(self, peer: PeerInfo, buf: memoryview) -> None:
        """A ``PUSH_PULL`` frame: the push of one small part, then the pull of it (the small round
        trip); the steps of ``_request`` for both, read with one struct unpack."""
        pull_req, push_req, key, index, codec, nbytes, seq = unpack_push_pull(buf)
        rank = peer.rank
        replies = self.replies
        try:
            shard = self._shard(key)
            if codec == RAW and nbytes == shard.nbytes:  # the common case: a view of the frame
                data = np.frombuffer(buf, shard.dtype, nbytes // shard.dtype.itemsize, PUSH_PULL.size)
            else:
                data = self._decode(shard, rank, codec, buf[PUSH_PULL.size:], nbytes)
        except RequestRefused as exc:  # neither can run: both fail with the reason
            replies.refuse(peer, Cmd.PUSH_ACK, push_req, str(exc))
            replies.refuse(peer, Cmd.PULL_REPLY, pull_req, str(exc))
            return
        try:
            self.store.push(shard, rank, data, replies.answer, seq=seq)
        except RequestRefused as exc:
            replies.refuse(peer, Cmd.PUSH_ACK, push_req, str(exc))
        try:
            self.store.pull(shard, rank, pull_req, index, seq, replies.answer)
        except RequestRefused as exc:
            replies.refuse(peer, Cmd.PULL_REPLY, pull_req, str(exc))

    def _offer(self, peer: PeerInfo, req_id: int, frames: list) -> None:
        """An offer of one big push part (``invitations``): checked against the part it names, then queued.

        Raises:
            RequestRefused: no such key here, or a size its shard does not take (the push counts as
                received, as a refused push does: the worker counted it).
        """
        entries = unpack_entries(frames[1]) if len(frames) == 2 else []
        if len(entries) != 1:
            raise ProtocolError(f"an offer of {len(frames)} frames and {len(entries)} parts, expected 2 and 1")
        key, index, _, codec, _, nbytes, _ = entries[0]
        shard = self._shard(key)
        if codec == RAW and nbytes != shard.nbytes:
            raise self.store.wrong_size(shard, peer.rank, nbytes)
        if codec != RAW:
            try:
                self._check_encoded(shard, codec, nbytes)
            except RequestRefused:
                shard.round.count_refused(peer.rank)
                raise
        if not self.invitations.offers:
            logger.info("server %d: the first offer, %d bytes of key %r from %s; pushes that pass a window of %d bytes "
                        "come by invitation", self.rank, nbytes, shard.user_key, peer.describe(),
                        self.conn.env.push_window)
        self.invitations.offer(peer.rank, req_id, index, nbytes)

    def _invite(self, worker: int, req_id: int, index: int) -> None:
        """Ask ``worker`` for the value of the part it offered (``invitations``)."""
        try:
            self.conn.transport.send(self.conn.members.workers[worker].uid.encode(),
                                     [pack_header(Cmd.PUSH_INVITE, req_id, index)])
        except TransportError as exc:  # the worker is gone: the job fails on its death, not here
            logger.info("server %d: the invitation to worker %d was not sent: %s", self.rank, worker, exc)

    def _push(self, peer: PeerInfo, req_id: int, frames: list) -> None:
        data_frames = frames[2:]
        buffers = [f.buffer for f in data_frames]
        if self.groups.try_push(peer.rank, frames[1].buffer, buffers):
            return
        store, rank, answer = self.store, peer.rank, self.replies.answer
        refused: RequestRefused | None = None
        for key, index, frame, codec, offset, nbytes, seq in unpack_entries(frames[1], [len(b) for b in buffers]):
            try:
                shard = self._shard(key)
                if frame == IN_SHARED_MEMORY:  # in the worker's shared memory: read it there, keep no reference
                    data = self._decode(shard, rank, codec, self._shared(peer, offset, nbytes), nbytes)
                    store.push(shard, rank, data, answer, borrowed=codec == RAW, seq=seq)
                    continue
                data = self._decode(shard, rank, codec, buffers[frame][offset:offset + nbytes], nbytes)
                store.push(shard, rank, data, answer, seq=seq)
            except RequestRefused as exc:  # the other parts still count; the push fails with the first reason
                refused = refused or exc
            if self.invitations.invited:  # an invited part, merged or refused, leaves the window
                self.invitations.arrived(rank, req_id, index)
        if refused is not None:
            raise refused

    def _pull(self, peer: PeerInfo, req_id: int, frames: list) -> None:
        replies, rank = self.replies, peer.rank
        replies.pull_arrived(rank, req_id)
        meta = frames[1].buffer
        if self.groups.by_keys and self.groups.try_pull(rank, req_id, meta):
            return
        shard, pull, answer = self._shard, self.store.pull, replies.answer
        try:
            for key, index, frame, codec, offset, nbytes, seq in unpack_entries(meta):
                if frame == IN_SHARED_MEMORY:  # the reply goes into the worker's shared memory
                    self._shared(peer, offset, nbytes)  # checked and mapped now, so the reply cannot fail
                    replies.in_shared_memory(rank, req_id, index, offset, nbytes)
                found = shard(key)
                if codec != RAW:  # the reply travels encoded (half width)
                    replies.encoded(rank, req_id, index, self._reply_codec(found, codec, nbytes))
                pull(found, rank, req_id, index, seq, answer)
        except RequestRefused:
            replies.forget_regions(rank, req_id)
            raise

    def _reply_codec(self, shard: Shard, codec: int, nbytes: int) -> Any:
        """The codec a pull of ``shard`` asked its reply in, once it can encode that value in ``nbytes``.

        Raises:
            RequestRefused: an unknown codec, one that does not encode replies, or another size.
        """
        encoder = self.codecs.get(codec)
        if not encoder.encodes_replies:
            raise RequestRefused(f"key {shard.user_key!r}: a pull asked for its reply in {encoder.name}, which "
                                 "encodes pushes only")
        if shard.dtype != np.float32:
            raise RequestRefused(f"key {shard.user_key!r}: a pull asked for its reply in {encoder.name}, but the key "
                                 f"holds {shard.dtype}; only float32 keys travel at half width")
        return self._check_encoded(shard, codec, nbytes, "pull")

    def _shared(self, peer: PeerInfo, ref: int, nbytes: int) -> np.ndarray:
        """A view of ``peer``'s shared-memory region ``ref`` (only ever one of its own, of this job).

        Raises:
            RequestRefused: the reference is not such a region, or cannot be mapped (the message says which).
        """
        try:
            return self.attached.view(ref, nbytes, peer.pid)
        except (OSError, ValueError) as exc:
            pid, fd = same_host.decode(ref)
            raise RequestRefused(f"server {self.rank} cannot use shared memory fd {fd} of process {pid} from "
                                 f"{peer.describe()}: {exc}") from exc

    def _init(self, frames: list, sync: bool, redo: bool = False) -> None:
        specs = unpack_json(frames[1])
        data_frames = frames[2:]
        if not isinstance(specs, list):
            raise ProtocolError(f"INIT's specs are a {type(specs).__name__}, not a list")
        with gc_paused():  # thousands of shards that live on
            values = [init_value(spec, data_frames) for spec in specs]  # every spec checked before any is stored
            for key, user_key, value, row_size in values:
                if redo and self.store.holds_alike(key, user_key, value):
                    continue  # the replaced worker 0's predecessor initialised it before it died
                self.store.init(key, user_key, value, sync, row_size)

    def _set_updater(self, peer: PeerInfo, frames: list, redo: bool = False) -> None:
        if peer.rank != 0:  # unpickling runs the sender's code: only the job's first worker ships it
            raise RequestRefused(f"{peer.describe()} may not set the updater; worker 0 ships it for the job")
        if redo and self.store.updater is not None:  # its predecessor's arrived: it keeps its state
            return
        self.install_updater(frames[1].bytes)

    def install_updater(self, blob: bytes) -> None:
        """Unpickle worker 0's updater and install it (kept as it came, for a replica that joins later).

        Raises:
            RequestRefused: it cannot be loaded (the message says why).
        """
        try:
            updater = pickle.loads(blob)
        except Exception as exc:  # unpickling runs the sender's code: any error is possible
            raise RequestRefused(
                f"server {self.rank} cannot load the optimizer/updater: {type(exc).__name__}: {exc} "
                "(its class must be importable on the servers, e.g. from an installed module)"
            ) from exc
        self.store.set_updater(updater)
        self.seeding.updater_blob = blob
        logger.info("server %d installed updater %s", self.rank, type(updater).__name__)

    def _set_codec(self, frames: list) -> None:
        """Configure a codec (a threshold) before the pushes that use it; a bad body is refused, naming it."""
        if len(frames) != 2:
            raise RequestRefused(f"SET_CODEC of {len(frames)} frames, expected 2 (header, JSON body)")
        try:
            codec, params = unpack_codec_params(frames[1])
        except ProtocolError as exc:  # answered, not dropped: the worker waits for this reply
            raise RequestRefused(f"server {self.rank}: {exc}") from None
        self.configure_codec(codec, params)
        logger.info("server %d configured codec %s with %s", self.rank, self.codecs.get(codec).name, params)

    def configure_codec(self, codec: int, params: dict) -> None:
        """Set ``codec``'s parameters (kept to send a replica that joins)."""
        self.codecs.configure(codec, params)
        self._configured_codecs.add(codec)
        self.seeding.codec_params[codec] = params

    def _rows(self, peer: PeerInfo, req_id: int, frames: list) -> None:
        data_frames = frames[2:]
        sizes = [len(f.buffer) for f in data_frames]
        entries = unpack_entries(frames[1], sizes)
        shards = [self._shard(row[0]) for row in entries]
        if not all(s.round.ready_for(peer.rank, row[6]) for s, row in zip(shards, entries)):
            self._deferred_rows.append((peer, req_id, frames))  # answered after the round closes
            return
        out_entries = []
        chunks = []
        offset = 0
        for shard, (key, index, frame, _, off, nbytes, _) in zip(shards, entries):
            rows = np.frombuffer(data_frames[frame].buffer, dtype=np.int64, count=nbytes // 8, offset=off)
            block = np.ascontiguousarray(self.store.rows(shard, rows))
            out_entries.append((key, index, 0, 0, offset, block.nbytes, 0))
            offset += block.nbytes
            chunks.append(block.reshape(-1).view(np.uint8))
        payload = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
        self.replies.send_to(peer.rank, [pack_header(Cmd.ROWS_REPLY, req_id), pack_entries(out_entries), payload])

    # ---- the job -----------------------------------------------------------------------------
    def _worker_rejoined(self, rank: int) -> None:
        """A restarted worker took rank ``rank`` back (``PSLAUNCH_RESTART_SCOPE=worker``, dist_async): it
        counts its pushes from zero, and nothing owed to its predecessor is sent to it."""
        self.store.worker_rejoined(rank)
        self.invitations.forget_worker(rank)
        for group in self.groups.by_keys.values():
            group.round.received[rank] = 0
        self.replies.forget_worker(rank)

    def _gone(self) -> dict[int, str]:
        """The workers no round waits for: finished, or left an elastic job."""
        store = self.store
        return store.finished if not store.left else {**store.finished, **dict.fromkeys(store.left, "left")}

    def _worker_left(self, rank: int, version: int = 0, dropped: bool = False) -> None:
        """An elastic job's worker left at a step boundary, or was lost (``dropped``): its keys' rounds go on
        without it (groups of keys go back to the per-key path first, each round with its own progress).
        A lost worker's round is named to every worker first, before any answer its leaving releases
        (``Joins.relay_loss``: the round from which the workers' scripts count without it)."""
        for group in list(self.groups.by_keys.values()):
            self.groups.dissolve(group)
        if dropped:
            self.joins.relay_loss(rank, version)
        self.store.worker_left(rank, self.replies.answer)

    def _worker_finished(self, rank: int, node: str) -> None:
        """Fail the pulls that wait for a round this worker will never push to (instead of hanging)."""
        store = self.store
        store.finished[rank] = node
        store.marks.forget(rank)
        failed: dict[tuple[int, int], str] = {}
        rounds = [(s.user_key, s.round) for s in store.shards.values()]
        rounds += [(g.shards[0].user_key, g.round) for g in self.groups.by_keys.values()]
        for key, round_ in rounds:
            if round_.waiting:
                stuck = store.stuck(key, round_)
                if stuck:
                    for worker, _, item in round_.take_waiting():
                        failed.setdefault((worker, item[0]), stuck)  # item[0]: the pull's req_id
        workers = self.conn.members.workers
        for (worker, req_id), message in failed.items():
            self.replies.refuse(workers[worker], Cmd.PULL_REPLY, req_id, message)
        self.seeding.worker_finished()
