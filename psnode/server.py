"""A server node: decodes workers' requests, runs them on its ``ServerStore`` and replies.

The server is single-threaded: its one loop receives, merges, applies the updater and sends
replies, so the store needs no locks. Small values in a reply are packed into one data frame; values
of ``_OWN_FRAME`` bytes or more travel in their own frame straight from the stored array (ZeroMQ
reads it in place; the store copies on write while a send is pending).

The updater a worker ships (``SET_UPDATER``) is unpickled here: it is called as
``updater(key, merged, stored)`` and must update ``stored`` in place; if it has ``init_key(key,
value)`` that is called for every key this server holds. For keys split across servers (big
arrays) the server sees flat 1-D shards of the key, not the key's shape.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np

from . import shm
from .env import EXIT_PEER_FAILED, NodeEnv
from .errors import PeerDiedError, PSNodeError, ProtocolError
from .node import Node, PeerInfo, logger
from .protocol import (
    FLAG_ACKS,
    FLAG_ERROR,
    FLAG_PULL,
    FLAG_SYNC,
    PUSH_PULL,
    Cmd,
    pack_header,
    pack_entries,
    pack_json,
    pack_value,
    unpack_entries,
    unpack_header,
    unpack_json,
    with_flags,
)
from .server_groups import Groups
from .server_store import KeyError_, ServerStore, Shard
from .shard_memory import shard_memory

__all__ = ["ServerNode", "run_server"]

_OWN_FRAME = 65536
_ACK_HOLD = 0.002  # longest a push acknowledgement waits for a pull reply of its worker to ride along


class ServerNode(Node):
    """A server of the job; ``run()`` serves until the scheduler shuts the job down."""

    def __init__(self, env: NodeEnv, transport: str = "zmq") -> None:
        super().__init__(env, "server", transport)
        self.store = ServerStore(env.num_workers, shard_memory(env.server_device))
        self._outbox: dict[tuple[int, int], list[tuple[int, Shard]]] = defaultdict(list)
        self._acks: dict[int, list[tuple[int, int]]] = defaultdict(list)  # worker -> (req_id, parts)
        self._attached = shm.Attachments()
        self._reply_regions: dict[tuple[int, int, int], tuple[int, int]] = {}  # pulls answered in shared memory
        self._groups = Groups(self.store, self._send_to, self._pull_reply)
        self._pulls_waiting: dict[int, set[int]] = defaultdict(set)  # worker -> pull req_ids not answered yet
        self._deferred_rows: list[tuple[PeerInfo, int, list]] = []  # row pulls waiting for a round
        self._cmd_replies = {Cmd.PULL: Cmd.PULL_REPLY, Cmd.PUSH: Cmd.PUSH_ACK, Cmd.INIT: Cmd.INIT_ACK,
                             Cmd.ROWS: Cmd.ROWS_REPLY, Cmd.SET_UPDATER: Cmd.SET_UPDATER_ACK}

    def run(self) -> int:
        """Register (unless done already), serve until shutdown; return the exit code (0: the job ended in order)."""
        if self.rank < 0:
            self.register()
        while not self.shutdown_requested and self.failure is None:
            self.process(0.1)
        if self.failure is not None:
            raise self.failure
        return 0

    # ---- requests ------------------------------------------------------------------------
    def handle_data(self, peer: PeerInfo, cmd: int, flags: int, req_id: int, arg: int, frames: list) -> None:
        if peer.role != "worker":
            raise ProtocolError(f"{Cmd(cmd).name} from {peer.describe()}")
        if cmd == Cmd.PUSH_PULL:
            if len(frames) != 1:
                raise ProtocolError(f"PUSH_PULL of {len(frames)} frames")
            self._push_pull(peer, req_id, arg, frames[0].buffer)
            if self._outbox:  # the round closed: reply now rather than after the batch
                self._flush()
            return
        reply = self._cmd_replies.get(cmd)
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
        self._request(peer, cmd, reply, flags, req_id, arg, frames, pull is None)
        if pull is not None:  # after the push, so the pull's count of this worker's pushes includes it
            self._request(peer, Cmd.PULL, Cmd.PULL_REPLY, 0, pull_req, pull_arg, pull)

    def _push_pull(self, peer: PeerInfo, pull_req: int, push_req: int, buf: memoryview) -> None:
        """A ``PUSH_PULL`` frame: the push of one small part, then the pull of it (the small round
        trip); the steps of ``_request`` for both, read with one struct unpack."""
        key, index, _, nbytes, seq = PUSH_PULL.unpack_from(buf)[7:]
        if len(buf) != PUSH_PULL.size + nbytes:
            raise ProtocolError(f"PUSH_PULL of {len(buf)} bytes for a value of {nbytes}")
        rank = peer.rank
        try:
            shard = self._shard(key)
            if nbytes != shard.nbytes:
                raise self.store.wrong_size(shard, rank, nbytes)
        except KeyError_ as exc:  # neither can run: both fail with the reason
            self._reply_error(peer, Cmd.PUSH_ACK, push_req, str(exc))
            self._reply_error(peer, Cmd.PULL_REPLY, pull_req, str(exc))
            return
        try:
            data = np.frombuffer(buf, shard.dtype, nbytes // shard.dtype.itemsize, PUSH_PULL.size)
            self.store.push(shard, rank, data, self._answer)
        except KeyError_ as exc:
            self._reply_error(peer, Cmd.PUSH_ACK, push_req, str(exc))
        try:
            self.store.pull(shard, rank, pull_req, index, seq, self._answer)
        except KeyError_ as exc:
            self._reply_error(peer, Cmd.PULL_REPLY, pull_req, str(exc))

    def _request(self, peer: PeerInfo, cmd: int, reply: int, flags: int, req_id: int, arg: int, frames: list, ack: bool = True) -> None:
        """Run one request (a push, pull, row pull, init or updater); refusals go back as error replies.

        ``ack=False``: a push that carried a pull is acknowledged by that pull's reply (the worker
        completes both on it), so it gets no acknowledgement of its own.
        """
        try:
            if cmd == Cmd.PUSH:
                self._push(peer, frames)
                if ack:
                    self._acks[peer.rank].append((req_id, arg))  # sent with the batch's other acks
                if self._deferred_rows:
                    deferred, self._deferred_rows = self._deferred_rows, []
                    for args in deferred:
                        self._rows(*args)
            elif cmd == Cmd.PULL:
                self._pulls_waiting[peer.rank].add(req_id)
                if self._groups.by_keys and self._groups.try_pull(peer.rank, req_id, frames[1].buffer):
                    return
                shard, pull, rank, answer = self._shard, self.store.pull, peer.rank, self._answer
                for key, index, frame, offset, nbytes, seq in unpack_entries(frames[1]):
                    if frame == shm.SHM_FRAME:  # the reply goes into the worker's shared memory
                        self._reply_regions[(rank, req_id, index)] = (offset, nbytes)
                    pull(shard(key), rank, req_id, index, seq, answer)
            elif cmd == Cmd.ROWS:
                self._rows(peer, req_id, frames)
            elif cmd == Cmd.INIT:
                self._init(frames, bool(flags & FLAG_SYNC))
                self._reply(peer, reply, req_id, arg)
            elif cmd == Cmd.SET_UPDATER:
                self._set_updater(frames)
                self._reply(peer, reply, req_id, arg)
        except KeyError_ as exc:
            self._reply_error(peer, reply, req_id, str(exc))
            if self._reply_regions:  # a refused pull answers nothing in shared memory
                for slot in [s for s in self._reply_regions if s[:2] == (peer.rank, req_id)]:
                    del self._reply_regions[slot]

    def after_batch(self) -> None:
        """Send the batch's pull replies; hold the push acknowledgements no reply took along.

        A worker with a pull waiting here gets its acknowledgements with that pull's reply (one
        message and one wake-up fewer per round), or after ``_ACK_HOLD`` at the latest, so a
        worker that waits for a push before anything else still hears of it. Other acknowledgements
        leave as soon as the server is idle.
        """
        if self._outbox:
            self._flush()
        if not self._acks:
            self.idle_work = False
            self.wake_at = None
            return
        waiting = self._pulls_waiting
        if all(waiting.get(worker) for worker in self._acks):
            self.idle_work = False
            if self.wake_at is None:
                self.wake_at = time.monotonic() + _ACK_HOLD
        else:
            self.idle_work = True

    def on_idle(self) -> None:
        """Send the acknowledgements no pull reply took along."""
        acks, self._acks = self._acks, defaultdict(list)
        self.idle_work = False
        self.wake_at = None
        for worker, pairs in acks.items():
            body = np.array(pairs, dtype=np.uint64).tobytes()
            self.transport.send(self.workers[worker].uid.encode(), [pack_header(Cmd.PUSH_ACK, 0, len(pairs)), body])

    def _shard(self, key_id: int) -> Shard:
        """The shard of ``key_id``, taken off the group fast path first if it is on it."""
        shard = self.store.shard(key_id)
        if shard.group is not None:
            self._groups.dissolve(shard.group)
        return shard

    def _push(self, peer: PeerInfo, frames: list) -> None:
        data_frames = frames[2:]
        buffers = [f.buffer for f in data_frames]
        if self._groups.try_push(peer.rank, frames[1].buffer, buffers):
            return
        store, rank, answer = self.store, peer.rank, self._answer
        refused: KeyError_ | None = None
        for key, _, frame, offset, nbytes, _ in unpack_entries(frames[1], [len(b) for b in buffers]):
            shard = self._shard(key)
            if nbytes != shard.nbytes:
                refused = refused or store.wrong_size(shard, rank, nbytes)
                continue
            if frame == shm.SHM_FRAME:  # in the worker's shared memory: read it there, keep no reference
                store.push(shard, rank, self._shared(offset, nbytes).view(shard.dtype), answer, borrowed=True)
                continue
            data = np.frombuffer(buffers[frame], dtype=shard.dtype, count=nbytes // shard.dtype.itemsize, offset=offset)
            store.push(shard, rank, data, answer)
        if refused is not None:
            raise refused

    def _shared(self, ref: int, nbytes: int) -> np.ndarray:
        """A view of a worker's shared-memory region."""
        try:
            return self._attached.view(ref, nbytes)
        except (OSError, ValueError) as exc:
            pid, fd = shm.decode(ref)
            raise KeyError_(f"server {self.rank} cannot map shared memory fd {fd} of process {pid}: {exc}") from exc

    def _init(self, frames: list, sync: bool) -> None:
        specs = unpack_json(frames[1])
        data_frames = frames[2:]
        for spec in specs:
            frame = data_frames[int(spec["frame"])]
            dtype = np.dtype(spec["dtype"])
            shape = tuple(int(n) for n in spec["shape"])
            count = int(np.prod(shape, dtype=np.int64))
            if int(spec["offset"]) + count * dtype.itemsize > len(frame.buffer):
                raise ProtocolError(f"init of key {spec['user_key']!r} reaches past its data frame")
            value = np.frombuffer(frame.buffer, dtype=dtype, count=count, offset=int(spec["offset"])).reshape(shape)
            self.store.init(int(spec["key"]), spec["user_key"], value, sync, int(spec.get("row_size", 1)))

    def _set_updater(self, frames: list) -> None:
        try:
            updater = pickle.loads(frames[1].bytes)
        except Exception as exc:  # unpickling runs the sender's code: any error is possible
            raise KeyError_(
                f"server {self.rank} cannot load the optimizer/updater: {type(exc).__name__}: {exc} "
                "(its class must be importable on the servers, e.g. from an installed module)"
            ) from exc
        self.store.set_updater(updater)
        logger.info("server %d installed updater %s", self.rank, type(updater).__name__)

    def _rows(self, peer: PeerInfo, req_id: int, frames: list) -> None:
        data_frames = frames[2:]
        sizes = [len(f.buffer) for f in data_frames]
        entries = unpack_entries(frames[1], sizes)
        shards = [self._shard(row[0]) for row in entries]
        if not all(s.ready_for(peer.rank, row[5]) for s, row in zip(shards, entries)):
            self._deferred_rows.append((peer, req_id, frames))  # answered after the round closes
            return
        out_entries = []
        chunks = []
        offset = 0
        for shard, (key, index, frame, off, nbytes, _) in zip(shards, entries):
            rows = np.frombuffer(data_frames[frame].buffer, dtype=np.int64, count=nbytes // 8, offset=off)
            block = np.ascontiguousarray(self.store.rows(shard, rows))
            out_entries.append((key, index, 0, offset, block.nbytes, 0))
            offset += block.nbytes
            chunks.append(block.reshape(-1).view(np.uint8))
        payload = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
        self._send_to(peer.rank, [pack_header(Cmd.ROWS_REPLY, req_id), pack_entries(out_entries), payload])

    # ---- replies -------------------------------------------------------------------------
    def _answer(self, worker: int, req_id: int, index: int, shard: Shard) -> None:
        self._outbox[(worker, req_id)].append((index, shard))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, defaultdict(list)
        host = self.store.backend.host
        for (worker, req_id), parts in outbox.items():
            if len(parts) == 1 and not self._reply_regions:  # one small part: the common reply, built directly
                index, shard = parts[0]
                if not shard.error and shard.nbytes < _OWN_FRAME:
                    self._send_to(worker, [pack_value(req_id, index, host(shard.stored).tobytes())])
                    continue
            peer = self.workers[worker]
            errors = [s.error for _, s in parts if s.error]
            if errors:
                self._reply_error(peer, Cmd.PULL_REPLY, req_id, errors[0])
                continue
            entries = []
            small: list[np.ndarray] = []
            big: list[Shard] = []
            offset = 0
            for index, shard in parts:
                region = self._reply_regions.pop((worker, req_id, index), None) if self._reply_regions else None
                if region is not None and region[1] == shard.nbytes:
                    np.copyto(self._shared(region[0], region[1]), host(shard.stored).view(np.uint8))
                    entries.append((shard.key_id, index, shm.SHM_FRAME, 0, shard.nbytes, 0))
                elif shard.nbytes >= _OWN_FRAME:
                    big.append(shard)
                    entries.append((shard.key_id, index, len(big), 0, shard.nbytes, 0))
                else:
                    small.append(host(shard.stored))
                    entries.append((shard.key_id, index, 0, offset, shard.nbytes, 0))
                    offset += shard.nbytes
            if len(small) == 1:
                payload: Any = small[0].tobytes()
            elif small:
                payload = b"".join([a.tobytes() for a in small]) if len(small) < 64 else np.concatenate([a.reshape(-1).view(np.uint8) for a in small])
            else:
                payload = b""
            frames = [pack_header(Cmd.PULL_REPLY, req_id), pack_entries(entries), payload]
            for shard in big:
                frames.append(self.store.backend.host(shard.stored).reshape(-1))
            tracker = self._send_to(worker, frames, track=bool(big))
            if tracker is not None:
                for shard in big:
                    shard.trackers.append(tracker)

    def _send_to(self, worker: int, frames: list, track: bool = False) -> Any:
        """Send a reply to ``worker``, with its held-back push acknowledgements as a last frame."""
        header = frames[0]
        if header[3] == Cmd.PULL_REPLY or header[3] == Cmd.VALUE:
            self._pulls_waiting[worker].discard(int.from_bytes(header[8:16], "little"))
        pairs = self._acks.pop(worker, None)
        if pairs:
            frames[0] = with_flags(frames[0], FLAG_ACKS)
            frames.append(np.array(pairs, dtype=np.uint64).tobytes())
        return self.transport.send(self.workers[worker].uid.encode(), frames, track=track)

    @staticmethod
    def _pull_reply(req_id: int, meta: bytes, payload: bytes) -> list:
        return [pack_header(Cmd.PULL_REPLY, req_id), meta, payload]

    def _reply(self, peer: PeerInfo, cmd: int, req_id: int, arg: int) -> None:
        self.transport.send(peer.uid.encode(), [pack_header(cmd, req_id, arg)])

    def _reply_error(self, peer: PeerInfo, cmd: int, req_id: int, message: str) -> None:
        logger.info("server %d refuses a request of %s: %s", self.rank, peer.describe(), message)
        if cmd == Cmd.PULL_REPLY:
            self._pulls_waiting[peer.rank].discard(req_id)
        self.transport.send(peer.uid.encode(), [pack_header(cmd, req_id, flags=FLAG_ERROR), pack_json({"error": message})])

    def on_worker_finished(self, rank: int, node: str) -> None:
        """Fail the pulls that wait for a round this worker will never push to (instead of hanging)."""
        self.store.finished[rank] = node
        failed: dict[tuple[int, int], str] = {}
        for shard in self.store.shards.values():
            if shard.waiting:
                blocked = self.store.blocked(shard.user_key, shard.sync, shard.count, shard.pushed)
                if blocked:
                    for worker, req_id, _, _ in shard.waiting:
                        failed.setdefault((worker, req_id), blocked)
                    shard.waiting = []
        for group in list(self._groups.by_keys.values()):
            blocked = self.store.blocked(group.shards[0].user_key, True, group.count, group.pushed)
            if group.waiting and blocked:
                for worker, req_id, _, _ in group.waiting:
                    failed.setdefault((worker, req_id), blocked)
                group.waiting = []
        for (worker, req_id), message in failed.items():
            self._reply_error(self.workers[worker], Cmd.PULL_REPLY, req_id, message)

    def on_failure(self, error: BaseException) -> None:
        """A failed server stops serving; ``run`` raises the error."""

    def close(self) -> None:
        """Close the sockets, giving queued replies a moment to leave."""
        self.transport.close(linger=0.5)


def run_server(env: NodeEnv) -> int:
    """Run a server of the job ``env`` describes; return the exit code (errors are printed on stderr):
    0, 1, or ``EXIT_PEER_FAILED`` when another node failed (the line printed names it)."""
    node = None
    try:
        node = ServerNode(env)
        return node.run()
    except PeerDiedError as exc:
        print(f"psnode server (pid {os.getpid()}): ended because a peer failed: {exc}", file=sys.stderr, flush=True)
        return EXIT_PEER_FAILED
    except PSNodeError as exc:
        print(f"psnode server (pid {os.getpid()}): error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if node is not None:
            node.close()
