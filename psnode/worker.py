"""A worker node: sends key parts to servers and completes futures when the replies arrive.

The worker's API speaks in *parts*: ``(server rank, key id, array)``. Which parts a user key becomes
is decided above (``kvcore.sharding``). Every call returns at once with a
``concurrent.futures.Future`` (or completes the one it is given); a dedicated network thread
receives the replies, writes pulled values into their outs and completes the futures, and keeps
heartbeats going. Small parts of one call headed to one server travel in one message, packed into
one data frame; each part of 64 KiB or more travels in a message of its own (sent from its buffer
without a copy), so the server merges and answers it while the next one is still arriving.

Sends are queued by priority (higher first, then in call order) and leave as soon as the
connection takes them; when a connection's queue is full they wait in that order. Correctness does
not depend on the order: a pull tells the server how many pushes of the key it must include.

Thread-safety: every method may be called from any thread. One thread at a time receives: the
network thread, or a caller blocked in ``wait_for`` (``worker_receiving``). Callbacks added to the
futures run on whichever thread receives the reply and must be quick. How messages leave, and how
a small push waits for the next pull to ride along, is ``worker_sending``.

Bookkeeping is bounded: one entry per request in flight, one push counter per key.
"""

from __future__ import annotations

import array
import atexit
import concurrent.futures
import fcntl
import heapq
import itertools
import os
import pickle
import stat
import sys
import termios
import threading
import time
from typing import Any, Hashable, Sequence

import numpy as np

from . import shm
from .env import EXIT_PEER_FAILED, MARKER_FAILED, NodeEnv
from .errors import ClosedError, NodeTimeoutError, PeerDiedError, PSNodeError, ProtocolError, RemoteError
from .node import Node, PeerInfo, is_done
from .protocol import (
    ENTRY_STRUCT, FLAG_ACKS, FLAG_ERROR, FLAG_PULL, FLAG_SYNC, HEADER, Cmd, pack_entries, pack_header, pack_json, pack_push_pull,
    unpack_entries, unpack_json, with_flags,
)
from .worker_receiving import ReceivingRole
from .worker_sending import SendQueue

__all__ = ["WorkerNode", "is_done"]


def _wait_until_read(stream: Any, limit: float) -> None:
    """Wait (at most ``limit`` seconds) until the pipe behind ``stream`` is empty: pslaunch has read
    what this process wrote, so the other nodes' reaction cannot be shown before it."""
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        pending = array.array("i", [0])
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            fcntl.ioctl(fd, termios.FIONREAD, pending)
            if pending[0] == 0:
                return
            time.sleep(0.005)
    except (OSError, ValueError, AttributeError):
        return  # not a pipe we can ask (Linux answers for the writing end too): go on


def _peer_failure(error: BaseException | None) -> PeerDiedError | None:
    """The ``PeerDiedError`` behind ``error`` (kvcore wraps it as the cause), if any."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, PeerDiedError):
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None

_OWN_FRAME = 65536  # values at least this big travel in their own frame


class _Request:
    __slots__ = ("future", "remaining", "targets", "what", "regions", "carried")

    def __init__(self, future: concurrent.futures.Future, remaining: int, targets: list | None, what: str) -> None:
        self.future = future
        self.remaining = remaining
        self.targets = targets  # pull: index -> writable byte view of the out
        self.what = what
        self.regions: dict[int, shm.Region] | None = None  # pull: index -> shared-memory region of the reply
        self.carried: int | None = None  # pull: the push that carried it, done by this pull's reply


class WorkerNode(ReceivingRole, SendQueue, Node):
    """This process's worker node (see the module docstring). Start it with ``start()``."""

    def __init__(self, env: NodeEnv, transport: str = "zmq") -> None:
        super().__init__(env, "worker", transport)
        self._pending: dict[int, _Request] = {}
        self._push_counts: dict[tuple[int, int], int] = {}  # (key id, server) -> pushes sent
        self._queue: list = []
        self._seq = itertools.count()
        self._send_lock = threading.Lock()
        self._idle = threading.Condition()
        self._idle_waiters = 0  # threads in _wait_idle (only they need a notify when _pending empties)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.wrap_error: Any = None  # optional fn(error) -> error for the futures (kvcore's error tree)
        self._regions: dict[tuple[int, int, int], shm.Region] = {}  # (key id, server, 0 push / 1 pull)
        self._shm_servers: set[int] = set()  # servers on this host that map our shared memory
        self._buffers: dict[tuple[int, int], tuple[np.ndarray, Any]] = {}  # (key id, server) -> (buffer, tracker)
        self._rx_lock = threading.Lock()  # held by the thread that receives (polls, recvs, dispatches)
        self._rx_owner: int | None = None  # that thread's ident
        self._park_lock = threading.Lock()  # taken directly where no wait is needed (cheaper than the condition)
        self._rx_cond = threading.Condition(self._park_lock)
        self._rx_caller: int | None = None  # a caller thread that takes over receiving (see wait_for)
        self._rx_released = 0.0  # when a caller last gave the role up
        # A small push to one server may be held back (corked) while the network thread is parked,
        # so that a pull right after it travels in the same message (worker_sending). Both are
        # guarded by _park_lock; the parked network thread sends a held push within _HANDBACK.
        self._parked = False
        self._cork: tuple | None = None

    # ---- life cycle ----------------------------------------------------------------------
    def start(self) -> "WorkerNode":
        """Register (blocking, see ``Node.register``) and start the network thread."""
        self.register()
        if self.env.same_host == "shm":
            self._shm_servers = {p.rank for p in self.servers
                                 if p.fingerprint == self.fingerprint and p.shm_probe and shm.can_attach(p.shm_probe)}
        self._thread = threading.Thread(target=self._run, name=f"psnode-worker-{self.rank}", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        previous = sys.excepthook

        def report_crash(kind: type, value: BaseException, tb: Any) -> None:
            peer = _peer_failure(value)
            if peer is not None:
                self._exit_for_peer(peer)
            # The traceback goes out before the other nodes hear of the failure and end, so that
            # it is the first error of the job on the screen and in pslaunch's report.
            previous(kind, value, tb)
            if self.env.supervised:
                print(MARKER_FAILED, file=sys.stderr, flush=True)
                _wait_until_read(sys.stderr, 0.5)
            self.abort(f"{kind.__name__}: {value}")

        sys.excepthook = report_crash
        return self

    def _exit_for_peer(self, error: PeerDiedError) -> None:
        """End the process with ``EXIT_PEER_FAILED`` and one line naming the failed peer instead of a
        traceback: this worker did nothing wrong. Exit handlers still run."""
        print(f"psnode worker {self.rank} (pid {os.getpid()}): ended because a peer failed: {error}",
              file=sys.stderr, flush=True)
        try:
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(EXIT_PEER_FAILED)  # an excepthook cannot choose the exit code otherwise

    def abort(self, reason: str) -> None:
        """Tell the scheduler this worker failed (so every other node stops with ``reason``), then close."""
        if self._closed or self.failure is not None:
            return
        self.send_control(Cmd.NODE_DIED, body={"message": reason})
        self._closed = True
        self._stop_thread()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._fail_pending(ClosedError(f"worker {self.rank} aborted: {reason}"))
        self.transport.close(linger=1.0)

    @property
    def num_workers(self) -> int:
        """Workers in the job."""
        return self.env.num_workers

    @property
    def num_servers(self) -> int:
        """Servers in the job."""
        return self.env.num_servers

    def close(self, timeout: float | None = None) -> None:
        """Wait for requests in flight, tell the scheduler this worker finished, and close (idempotent).

        Raises:
            NodeTimeoutError: requests still in flight after ``timeout`` seconds (default: a minute, or
                the heartbeat timeout when that is longer); the node is closed anyway.
        """
        if self._closed:
            return
        if self._cork is not None:
            self._uncork()
        self._closed = True
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        limit = timeout if timeout is not None else max(60.0, self.env.heartbeat_timeout)
        error: BaseException | None = None
        try:
            if self.failure is None and self._thread is not None:
                self._wait_idle(limit)
                finished: concurrent.futures.Future = concurrent.futures.Future()
                req = self.next_req_id()
                self.add_waiter(req, finished)
                self.send_control(Cmd.FINISH, req)
                self._wait(finished, min(limit, max(5.0, self.env.heartbeat_timeout)), "the scheduler's answer to finish")
        except PSNodeError as exc:
            error = exc
        finally:
            self._stop_thread()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=2.0)
            self._fail_pending(ClosedError("the worker was closed"))
            self.transport.close(linger=0.5 if error is None else 0.0)
        if error is not None and not isinstance(error, ClosedError) and self.failure is None:
            raise error

    def _wait_idle(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        with self._idle:
            self._idle_waiters += 1
            try:
                while self._pending and self.failure is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise NodeTimeoutError(f"worker {self.rank}: {len(self._pending)} requests still unanswered after {limit:g} s")
                    self._idle.wait(min(remaining, 0.1))
            finally:
                self._idle_waiters -= 1

    def _wait(self, future: concurrent.futures.Future, limit: float | None, what: str) -> None:
        if not self.wait_for(future, limit):
            raise NodeTimeoutError(f"worker {self.rank}: no {what} within {limit:g} s")
        future.result()

    # ---- the API --------------------------------------------------------------------------
    def init(self, parts: Sequence[tuple[int, int, Hashable, np.ndarray, int]], sync: bool, future: Any = None) -> Any:
        """Send initial values ``(server, key id, user key, value, row_size)``; the future is done when stored."""
        future = future or concurrent.futures.Future()
        by_server: dict[int, list] = {}
        for part in parts:
            by_server.setdefault(part[0], []).append(part)
        req = self._track(future, len(by_server), None, "init")
        for server, items in by_server.items():
            specs, frames = [], []
            for i, (_, key_id, user_key, value, row_size) in enumerate(items):
                value = np.ascontiguousarray(value)
                specs.append({"key": key_id, "user_key": user_key, "shape": list(value.shape), "dtype": value.dtype.str,
                              "row_size": row_size, "frame": i, "offset": 0})
                frames.append(value)
            msg = [pack_header(Cmd.INIT, req, 1, FLAG_SYNC if sync else 0), pack_json(specs)] + frames
            self._enqueue(server, msg, 0, req)
        self._pump()
        return future

    def set_updater(self, updater: Any, future: Any = None) -> Any:
        """Ship a picklable updater to every server; the future is done when all installed it."""
        future = future or concurrent.futures.Future()
        blob = pickle.dumps(updater, protocol=pickle.HIGHEST_PROTOCOL)
        req = self._track(future, self.num_servers, None, "set_updater")
        for server in range(self.num_servers):
            self._enqueue(server, [pack_header(Cmd.SET_UPDATER, req, 1), blob], 0, req)
        self._pump()
        return future

    def push(self, parts: Sequence[tuple[int, int, np.ndarray]], priority: int = 0, copy: bool = True, future: Any = None) -> Any:
        """Push ``(server, key id, value)`` parts; returns at once.

        With ``copy=True`` the values are copied before push returns (the caller may change them
        right away); with ``copy=False`` the caller hands them over and must not change them.
        The future is done when every server has received its parts.
        """
        future = future or concurrent.futures.Future()
        if len(parts) == 1 and parts[0][2].nbytes < _OWN_FRAME:
            return self._push_small(*parts[0], priority, future)
        by_server = self._by_server(parts)
        req = self._track(future, len(parts), None, "push")
        counts = self._push_counts
        for server, items in by_server.items():
            entries = []
            small = []
            offset = 0
            for i, (_, key_id, value) in enumerate(items):
                slot = (key_id, server)
                seq = counts.get(slot, 0) + 1
                counts[slot] = seq
                nbytes = value.nbytes
                region = self._region((key_id, server, 0), nbytes) if nbytes >= shm.SHM_MIN and server in self._shm_servers else None
                if region is not None:  # same host: one copy into shared memory, the server reads it there
                    np.copyto(region.array, value.reshape(-1).view(np.uint8) if value.flags.c_contiguous else np.ascontiguousarray(value).reshape(-1).view(np.uint8))
                    region.busy = future
                    entries.append((key_id, i, shm.SHM_FRAME, region.ref, nbytes, seq))
                elif nbytes >= _OWN_FRAME:
                    flat = value.reshape(-1).view(np.uint8) if value.flags.c_contiguous else np.ascontiguousarray(value).reshape(-1).view(np.uint8)
                    buffer = self._send_copy(slot, flat) if copy else flat
                    # its own message: the server merges and answers it while the next part arrives
                    own = [pack_header(Cmd.PUSH, req, 1), ENTRY_STRUCT.pack(key_id, i, 1, 0, nbytes, seq), b"", buffer]
                    self._enqueue(server, own, priority, req)
                else:
                    small.append(value)
                    entries.append((key_id, i, 0, offset, nbytes, seq))
                    offset += nbytes
            if not entries:
                continue
            # small values are copied here (the caller may change its arrays as soon as push returns)
            payload: Any = small[0].tobytes() if len(small) == 1 else b"".join([v.tobytes() for v in small])
            message = [pack_header(Cmd.PUSH, req, len(entries)), pack_entries(entries), payload]
            if len(by_server) == 1 and self._hold(server, message, priority, req):
                return future
            self._enqueue(server, message, priority, req)
        self._pump()
        return future

    def push_part(self, server: int, key_id: int, value: np.ndarray, priority: int = 0, future: Any = None) -> Any:
        """``push([(server, key_id, value)], priority)`` (value copied), for callers with one part."""
        if value.nbytes < _OWN_FRAME:
            return self._push_small(server, key_id, value, priority, future or concurrent.futures.Future())
        return self.push([(server, key_id, value)], priority, True, future)

    def pull_part(self, server: int, key_id: int, out: np.ndarray, priority: int = 0, future: Any = None) -> Any:
        """``pull([(server, key_id, out)], priority)``, for callers with one part."""
        if out.nbytes < shm.SHM_MIN or server not in self._shm_servers:
            return self._pull_one(server, key_id, out, priority, future or concurrent.futures.Future())
        return self.pull([(server, key_id, out)], priority, future)

    def _push_small(self, server: int, key_id: int, value: np.ndarray, priority: int, future: Any) -> Any:
        """``push`` of one small part: the same message, built without the general bookkeeping."""
        req = self._track(future, 1, None, "push")
        slot = (key_id, server)
        seq = self._push_counts.get(slot, 0) + 1
        self._push_counts[slot] = seq
        nbytes = value.nbytes
        message = [pack_header(Cmd.PUSH, req, 1), ENTRY_STRUCT.pack(key_id, 0, 0, 0, nbytes, seq), value.tobytes()]
        if not self._hold(server, message, priority, req):
            self._send(server, message, priority, req)
        return future

    def pull(self, parts: Sequence[tuple[int, int, np.ndarray]], priority: int = 0, future: Any = None) -> Any:
        """Pull ``(server, key id, out)`` parts into the C-contiguous arrays ``out``; returns at once.

        Each value includes every push of the key this worker issued before. The outs must stay
        alive and untouched until the future is done.
        """
        future = future or concurrent.futures.Future()
        if len(parts) == 1 and (parts[0][2].nbytes < shm.SHM_MIN or parts[0][0] not in self._shm_servers):
            return self._pull_one(*parts[0], priority, future)
        targets = [memoryview(out).cast("B") for _, _, out in parts]  # C-contiguous outs, as bytes
        req = self._track(future, len(parts), targets, "pull")
        counts = self._push_counts
        request = self._pending.get(req)
        by_server = self._by_server(parts, indexed=True)
        cork = self._take_cork() if self._cork is not None else None
        if cork is not None and (len(by_server) != 1 or cork[2] not in by_server or cork[0] != -priority):
            heapq.heappush(self._queue, cork)  # it cannot carry this pull: it leaves on its own
            cork = None
        for server, items in by_server.items():
            items = self._pull_big_alone(server, items, req, priority) if len(items) > 1 or cork is None else items
            if not items:
                continue
            entries = [(key_id, index, 0, 0, out.nbytes, counts.get((key_id, server), 0)) for index, (_, key_id, out) in items]
            if server in self._shm_servers and request is not None:
                for j, (index, (_, key_id, out)) in enumerate(items):
                    region = self._region((key_id, server, 1), out.nbytes) if out.nbytes >= shm.SHM_MIN else None
                    if region is not None:  # the server writes the value into shared memory
                        region.busy = future
                        if request.regions is None:
                            request.regions = {}
                        request.regions[index] = region
                        entries[j] = (key_id, index, shm.SHM_FRAME, region.ref, out.nbytes, entries[j][5])
            message = [pack_header(Cmd.PULL, req, len(items)), pack_entries(entries)]
            if cork is not None:  # the held push carries this pull: its header gets FLAG_PULL
                if request is not None:  # the server acknowledges the push with this pull's reply
                    request.carried = cork[4]
                push = cork[3]
                push[0] = with_flags(push[0], FLAG_PULL)
                heapq.heappush(self._queue, cork[:3] + (push + message,) + cork[4:])
                continue
            self._enqueue(server, message, priority, req)
        self._pump()
        return future

    def _pull_big_alone(self, server: int, items: list, req: int, priority: int) -> list:
        """Send a pull message of its own for each big part answered over the socket (as pushes
        do, so that the server answers each as soon as its round closes); the other items."""
        rest = []
        local = server in self._shm_servers
        for item in items:
            index, (_, key_id, out) = item
            if out.nbytes >= _OWN_FRAME and not (local and out.nbytes >= shm.SHM_MIN):
                seq = self._push_counts.get((key_id, server), 0)
                self._enqueue(server, self._pull_message(req, key_id, index, out.nbytes, seq), priority, req)
            else:
                rest.append(item)
        return rest

    def _pull_one(self, server: int, key_id: int, out: np.ndarray, priority: int, future: Any) -> Any:
        """``pull`` of one part answered in a message: the same request, built without the general bookkeeping."""
        req = self._track(future, 1, [memoryview(out).cast("B")], "pull")
        seq = self._push_counts.get((key_id, server), 0)
        cork = self._take_cork() if self._cork is not None else None
        if cork is not None:
            if cork[2] == server and cork[0] == -priority:  # the held push carries this pull
                request = self._pending.get(req)
                if request is not None:
                    request.carried = cork[4]
                push = cork[3]
                if len(push) == 3 and len(push[1]) == ENTRY_STRUCT.size and ENTRY_STRUCT.unpack(push[1])[0] == key_id:
                    # a push of this very part: one PUSH_PULL frame (protocol's compact form)
                    self._send(server, [pack_push_pull(req, cork[4], key_id, 0, seq, push[2])], priority, req)
                    return future
                push[0] = with_flags(push[0], FLAG_PULL)
                self._send(server, push + self._pull_message(req, key_id, 0, out.nbytes, seq), priority, req)
                return future
            heapq.heappush(self._queue, cork)  # it cannot carry this pull: it leaves on its own
        self._send(server, self._pull_message(req, key_id, 0, out.nbytes, seq), priority, req)
        return future

    @staticmethod
    def _pull_message(req: int, key_id: int, index: int, nbytes: int, seq: int) -> list:
        """The frames of a pull of one part (``index``: its place in the request): header and meta."""
        return [pack_header(Cmd.PULL, req, 1), ENTRY_STRUCT.pack(key_id, index, 0, 0, nbytes, seq)]

    def pull_rows(self, parts: Sequence[tuple[int, int, np.ndarray, np.ndarray]], priority: int = 0, future: Any = None) -> Any:
        """Pull the rows ``rows`` (int64, local to the part) of ``(server, key id, rows, out)`` parts into ``out``."""
        future = future or concurrent.futures.Future()
        targets = [memoryview(out).cast("B") for _, _, _, out in parts]
        req = self._track(future, len(parts), targets, "row_sparse_pull")
        for server, items in self._by_server(parts, indexed=True).items():
            entries = []
            chunks, offset = [], 0
            for index, (_, key_id, rows, out) in items:
                rows = np.ascontiguousarray(rows, dtype=np.int64)
                entries.append((key_id, index, 0, offset, rows.nbytes, self._push_counts.get((key_id, server), 0)))
                offset += rows.nbytes
                chunks.append(rows)
            payload = np.concatenate(chunks) if chunks else b""
            self._enqueue(server, [pack_header(Cmd.ROWS, req, len(items)), pack_entries(entries), payload], priority, req)
        self._pump()
        return future

    # ---- internals -------------------------------------------------------------------------
    @staticmethod
    def _by_server(parts: Sequence, indexed: bool = False) -> dict[int, list]:
        by_server: dict[int, list] = {}
        for index, part in enumerate(parts):
            by_server.setdefault(part[0], []).append((index, part) if indexed else part)
        return by_server

    def _region(self, slot: tuple[int, int, int], nbytes: int) -> shm.Region | None:
        """The shared-memory region of ``slot`` when it is free (None: use a message this time)."""
        region = self._regions.get(slot)
        if region is None or region.nbytes != nbytes:
            try:
                region = shm.Region(nbytes)
            except OSError:
                return None
            self._regions[slot] = region
        return region if region.free() else None

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._closed:
            raise ClosedError(f"worker {self.rank} was closed")

    def _track(self, future: Any, remaining: int, targets: list | None, what: str) -> int:
        self._check()
        req = self.next_req_id()
        if remaining == 0:
            future.set_result(None)
            return req
        self._pending[req] = _Request(future, remaining, targets, what)
        if self.failure is not None:  # failed between the check and now: do not leave it hanging
            self._complete(req, self.failure)
        return req

    def _complete(self, req: int, error: BaseException | None = None) -> None:
        request = self._pending.pop(req, None)
        if request is None:
            return
        if error is not None and self.wrap_error is not None:
            error = self.wrap_error(error)
        try:
            if error is None:
                request.future.set_result(None)
            else:
                request.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass
        if self._idle_waiters and not self._pending:
            with self._idle:
                self._idle.notify_all()

    def _fail_pending(self, error: BaseException) -> None:
        for req in list(self._pending):
            self._complete(req, error)

    def on_failure(self, error: BaseException) -> None:
        self._fail_pending(error)

    # ---- replies (network thread) ------------------------------------------------------------
    def _take_acks(self, frame: Any) -> None:
        pending = self._pending
        for rid, count in np.frombuffer(frame.buffer, dtype=np.uint64).reshape(-1, 2).tolist():
            request = pending.get(rid)
            if request is not None:
                request.remaining -= count
                if request.remaining <= 0:
                    self._complete(rid)

    @staticmethod
    def _take_value(request: _Request, index: int, frame: memoryview) -> None:
        """Write a ``VALUE`` reply into the out of part ``index``."""
        targets = request.targets
        if targets is None or not 0 <= index < len(targets):
            raise ProtocolError(f"VALUE for part {index} of a request with {len(targets or ())} parts")
        target = targets[index]
        if len(frame) - HEADER.size != target.nbytes:
            raise ProtocolError(f"VALUE of {len(frame) - HEADER.size} bytes for an out of {target.nbytes} bytes")
        target[:] = frame[HEADER.size:]

    @staticmethod
    def _take_one(request: _Request, meta: memoryview, data: memoryview) -> None:
        """Write the one part of a reply into its out (``handle_data`` for the common case)."""
        if len(meta) != ENTRY_STRUCT.size:
            raise ProtocolError(f"reply meta frame of {len(meta)} bytes for one part")
        _, index, frame, offset, nbytes, _ = ENTRY_STRUCT.unpack_from(meta)
        target = request.targets[index]
        if nbytes != target.nbytes:
            raise ProtocolError(f"reply part of {nbytes} bytes for an out of {target.nbytes} bytes")
        if frame == shm.SHM_FRAME:
            target[:] = request.regions[index].array
        elif frame != 0 or offset + nbytes > len(data):
            raise ProtocolError("a reply part lies outside the message's data frame")
        else:
            target[:] = data[offset:offset + nbytes]

    def handle_data(self, peer: PeerInfo, cmd: int, flags: int, req_id: int, arg: int, frames: list) -> None:
        if cmd == Cmd.PUSH_ACK and not flags & FLAG_ERROR:
            self._take_acks(frames[1])
            if self._queue:
                self._pump()
            return
        if flags & FLAG_ACKS:  # push acknowledgements riding along with a reply
            self._take_acks(frames[-1])
            frames = frames[:-1]
        request = self._pending.get(req_id)
        if request is None:
            raise ProtocolError(f"{Cmd(cmd).name} for unknown request {req_id}")
        if request.carried is not None:  # any reply to the pull means the server took the push before it
            self._complete(request.carried)
            request.carried = None
        if flags & FLAG_ERROR:
            message = unpack_json(frames[1]).get("error", "unknown error")
            self._complete(req_id, RemoteError(f"{request.what} failed on {peer.describe()}: {message}"))
            return
        try:
            self._take_reply(request, cmd, arg, frames)
        except (ProtocolError, IndexError, KeyError, TypeError, ValueError) as exc:
            self._complete(req_id, ProtocolError(f"{request.what}: malformed reply from {peer.describe()}: {exc}"))
            raise  # and the message is counted as malformed
        if request.remaining <= 0:
            self._complete(req_id)
        if self._queue:
            self._pump()

    def _take_reply(self, request: _Request, cmd: int, arg: int, frames: list) -> None:
        """Write a reply's values into the request's outs and count the parts it answered."""
        if cmd == Cmd.VALUE:  # one part, in the header frame (protocol's compact form)
            self._take_value(request, arg, frames[0].buffer)
            request.remaining -= 1
        elif cmd in (Cmd.PULL_REPLY, Cmd.ROWS_REPLY):
            if len(frames) == 3 and len(request.targets) == 1:  # one part in the message (most small pulls)
                self._take_one(request, frames[1].buffer, frames[2].buffer)
                request.remaining -= 1
                return
            data_frames = frames[2:]
            buffers = [f.buffer for f in data_frames]
            entries = unpack_entries(frames[1], [len(b) for b in buffers])
            targets = request.targets
            for _, index, frame, offset, nbytes, _ in entries:
                target = targets[index]
                if nbytes != target.nbytes:
                    raise ProtocolError(f"reply part of {nbytes} bytes for an out of {target.nbytes} bytes")
                if frame == shm.SHM_FRAME:
                    target[:] = request.regions[index].array
                else:
                    target[:] = buffers[frame][offset:offset + nbytes]
            request.remaining -= len(entries)
        elif cmd in (Cmd.INIT_ACK, Cmd.SET_UPDATER_ACK):
            request.remaining -= arg
        else:
            raise ProtocolError(f"a worker does not accept {Cmd(cmd).name}")
