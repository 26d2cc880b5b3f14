"""What servers and workers share: binding, registration, the address book, heartbeats, barriers, failure.

A ``Node`` binds its receiving endpoint, registers with the scheduler, waits for the address book,
connects to the peers it talks to (workers to servers, servers to workers; same-host peers over the
same-host endpoint), and from then on runs ``process(timeout)``: it receives messages, answers the
scheduler's control messages, sends heartbeats and checks the scheduler is alive. Data messages go
to ``handle_data``, which the server and the worker implement.

Any failure (a dead peer announced by the scheduler, a silent scheduler) is stored in ``failure``
and passed to ``on_failure`` once; every later call raises it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import shm
from .env import NodeEnv
from .errors import (
    ClosedError,
    NodeTimeoutError,
    PeerDiedError,
    ProtocolError,
    PSNodeError,
    RegistrationTimeoutError,
)
from .protocol import FLAG_ERROR, GROUP_ROLES, Cmd, Group, pack_header, pack_json, parse_group, unpack_header, unpack_json
from .transport import Transport, create_transport

__all__ = ["Node", "PeerInfo", "host_fingerprint", "is_done", "logger", "setup_logging"]

logger = logging.getLogger("psnode")

SCHEDULER = b"scheduler"
_IDLE_DELAY = 0.0002  # how long held-back acknowledgements wait for a reply to ride along with

_CONTROL_CMDS = frozenset(
    {Cmd.ADDRBOOK, Cmd.REGISTER_FAILED, Cmd.HEARTBEAT_ACK, Cmd.BARRIER_DONE, Cmd.FINISH_ACK, Cmd.SHUTDOWN, Cmd.NODE_DIED,
     Cmd.WORKER_FINISHED}
)


@dataclass(frozen=True)
class PeerInfo:
    """A node of the job as the address book lists it."""

    role: str
    rank: int
    host: str
    port: int
    uid: str
    fingerprint: str
    local_name: str
    shm_probe: int = 0  # wire reference of the node's shared-memory probe (0: none)

    def describe(self) -> str:
        """``server 1 on 10.0.0.2:4567``: how errors name a node."""
        return f"{self.role} {self.rank} on {self.host}:{self.port}"


_DONE_STATES = frozenset({"CANCELLED", "CANCELLED_AND_NOTIFIED", "FINISHED"})


def is_done(future: concurrent.futures.Future) -> bool:
    """``future.done()`` without taking the future's lock (reading one attribute is atomic).

    The receive loops ask this after every message; the lock ``done()`` takes is most of its cost.
    """
    return future._state in _DONE_STATES


def host_fingerprint() -> str:
    """Same value for processes that can reach each other's same-host endpoints (boot id + network namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"unknown-{os.getpid()}"  # never matches another process: TCP everywhere
    return f"{boot}:{netns}"


def setup_logging(verbose: int) -> None:
    """Log to stderr at INFO (PS_VERBOSE=1) or DEBUG (2)."""
    if verbose <= 0 or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[psnode %(asctime)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)


class Node:
    """A server or worker's connection to the job (see the module docstring).

    Not thread-safe except where a method says so: ``process`` runs on one thread (the network
    thread); ``send_control`` and ``fail`` may be called from any thread.
    """

    def __init__(self, env: NodeEnv, role: str, transport: str = "zmq") -> None:
        setup_logging(env.verbose)
        self.env = env
        self.role = role
        self.host = env.advertised_host()
        self.fingerprint = host_fingerprint()
        self.same_host = env.same_host
        self.transport: Transport = create_transport(transport, b"", io_sched=env.io_sched)
        job = re.sub(r"[^A-Za-z0-9_.-]", "_", env.job_id)[:40]
        self.local_name = f"{job}-{role}-{os.getpid()}-{os.urandom(3).hex()}"
        self.port = self.transport.bind(0, self.local_name)
        self._probe = shm.probe() if env.same_host == "shm" else None
        self.uid = f"{role}@{self.host}:{self.port}"
        self.transport.identity = self.uid.encode()
        self.rank = -1
        self.peers: dict[bytes, PeerInfo] = {}
        self.workers: list[PeerInfo] = []
        self.servers: list[PeerInfo] = []
        self.failure: BaseException | None = None
        self.shutdown_requested = False
        self.malformed = 0
        self._fail_lock = threading.Lock()
        self._last_from_scheduler = time.monotonic()
        self._last_beat_check = 0.0  # when _heartbeat last ran
        self._next_heartbeat = 0.0
        self._waiters: dict[int, Any] = {}  # req_id -> future, for barrier / finish replies
        self._req_ids = itertools.count(1)  # next() on a count is atomic: no lock needed

    # ---- registration -------------------------------------------------------------------
    def register(self) -> None:
        """Register with the scheduler and wait for the address book (blocking).

        Raises:
            RegistrationTimeoutError: the scheduler reported a timeout, or never answered.
            TransportError: the scheduler's address cannot be connected to.
        """
        env = self.env
        self.transport.connect(SCHEDULER, f"tcp://{env.root_uri}:{env.root_port}")
        info = {
            "role": self.role,
            "host": self.host,
            "port": self.port,
            "uid": self.uid,
            "fingerprint": self.fingerprint,
            "local_name": self.local_name,
            "shm_probe": self._probe.ref if self._probe is not None else 0,
            "worker_id": env.worker_id if self.role == "worker" else None,
            "pid": os.getpid(),
        }
        self.transport.send(SCHEDULER, [pack_header(Cmd.REGISTER), pack_json(info)])
        logger.info("%s registering with the scheduler at %s", self.uid, env.root_address)
        deadline = time.monotonic() + env.register_timeout + max(5.0, env.heartbeat_timeout)
        early: list[tuple[bytes, list]] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RegistrationTimeoutError(
                    f"{self.role} at {self.host}:{self.port} got no address book from the scheduler at "
                    f"{env.root_address} within {env.register_timeout + max(5.0, env.heartbeat_timeout):.0f} s; "
                    "is the scheduler running and reachable (DMLC_PS_ROOT_URI / DMLC_PS_ROOT_PORT)?"
                )
            if not self.transport.poll(min(remaining, 0.5)):
                continue
            sender, frames = self.transport.recv()
            if sender != SCHEDULER:
                # a peer that got the address book first may already send requests: keep them
                if len(early) < 10000:
                    early.append((sender, frames))
                continue
            try:
                cmd, flags, req_id, arg = unpack_header(frames[0])
                if cmd == Cmd.REGISTER_FAILED:
                    raise RegistrationTimeoutError(unpack_json(frames[1])["error"])
                if cmd == Cmd.ADDRBOOK:
                    self._apply_addrbook(unpack_json(frames[1]))
                    for item in early:
                        self._dispatch(*item)
                    return
            except (ProtocolError, IndexError, KeyError, TypeError):
                self.malformed += 1

    def _apply_addrbook(self, book: dict) -> None:
        self.rank = int(book["rank"])
        for item in book["nodes"]:
            peer = PeerInfo(
                item["role"], int(item["rank"]), item["host"], int(item["port"]), item["uid"],
                item["fingerprint"], item["local_name"], int(item.get("shm_probe") or 0),
            )
            self.peers[peer.uid.encode()] = peer
        self.workers = sorted((p for p in self.peers.values() if p.role == "worker"), key=lambda p: p.rank)
        self.servers = sorted((p for p in self.peers.values() if p.role == "server"), key=lambda p: p.rank)
        targets = self.servers if self.role == "worker" else self.workers
        for peer in targets:
            endpoint = self.endpoint_of(peer)
            self.transport.connect(peer.uid.encode(), endpoint)
            logger.info("%s %d connected to %s at %s", self.role, self.rank, peer.describe(), endpoint)
        self._last_from_scheduler = self._last_beat_check = time.monotonic()

    def endpoint_of(self, peer: PeerInfo) -> str:
        """The same-host endpoint for a peer on this host (unless PSLAUNCH_SAME_HOST=tcp), else TCP."""
        if self.same_host in ("ipc", "shm") and peer.fingerprint == self.fingerprint:
            return self.transport.same_host_endpoint(peer.local_name)
        return f"tcp://{peer.host}:{peer.port}"

    # ---- the loop ------------------------------------------------------------------------
    def next_req_id(self) -> int:
        """A fresh request id (thread-safe)."""
        return next(self._req_ids)

    def process(self, timeout: float, until: Any = None) -> None:
        """Handle messages for up to ``timeout`` seconds (returns after the first batch); keep heartbeats.

        ``until``: a future; the batch ends as soon as it is done (a waiting caller returns at once).
        """
        now = time.monotonic()
        self._heartbeat(now)
        wait = timeout
        if self.env.heartbeat_interval > 0:
            wait = max(0.0, min(wait, self._next_heartbeat - now))
        if self.wake_at is not None:
            if now >= self.wake_at:
                self.on_idle()  # held-back work whose time is up, whether messages come or not
            else:
                wait = min(wait, self.wake_at - now)
        if self.idle_work and not self.transport.poll(min(wait, _IDLE_DELAY)):
            self.on_idle()  # nothing came for a moment: send what was held back to share a message
            return
        if not self.transport.poll(wait):
            return
        try:
            # drain what is queued, but let heartbeats run between batches; a caller waiting for
            # ``until`` returns once it is done
            for _ in range(256):
                sender, frames = self.transport.recv()
                self._dispatch(sender, frames)
                if self.failure is not None or (until is not None and is_done(until)) or not self.transport.poll(0):
                    break
        finally:
            self.after_batch()

    def after_batch(self) -> None:
        """Called after each batch of received messages (the server sends its gathered replies here)."""

    idle_work = False  # True while on_idle has something to send once the node is idle
    wake_at: float | None = None  # monotonic time by which on_idle runs anyway (None: no deadline)

    def on_idle(self) -> None:
        """Called when ``idle_work`` is set and no message arrived for ``_IDLE_DELAY`` seconds, or at ``wake_at``."""

    def _heartbeat(self, now: float) -> None:
        interval = self.env.heartbeat_interval
        if interval <= 0 or self.failure is not None:
            return
        stalled = now - self._last_beat_check
        self._last_beat_check = now
        if stalled > self.env.heartbeat_timeout / 2:
            self._last_from_scheduler += stalled  # this process was stopped: not the scheduler's silence
        if now - self._last_from_scheduler > self.env.heartbeat_timeout:
            self.fail(
                PeerDiedError(
                    f"the scheduler at {self.env.root_address} died or is unreachable: no message from it for "
                    f"{now - self._last_from_scheduler:.1f} s (PS_HEARTBEAT_TIMEOUT={self.env.heartbeat_timeout:g})",
                    "scheduler", 0, self.env.root_uri,
                )
            )
            return
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + interval
            self.send_control(Cmd.HEARTBEAT)

    def send_control(self, cmd: int, req_id: int = 0, arg: int = 0, body: Any = None) -> None:
        """Send a control message to the scheduler (thread-safe)."""
        frames = [pack_header(cmd, req_id, arg)]
        if body is not None:
            frames.append(pack_json(body))
        try:
            self.transport.send(SCHEDULER, frames)
        except ClosedError:
            pass

    def _dispatch(self, sender: bytes, frames: list) -> None:
        try:
            cmd, flags, req_id, arg = unpack_header(frames[0])
        except (ProtocolError, IndexError) as exc:
            self._malformed(sender, exc)
            return
        if self.env.verbose >= 2:
            logger.debug("%s %d <- %s: %s req %d (%d frames)", self.role, self.rank, sender.decode(errors="replace"), Cmd(cmd).name, req_id, len(frames))
        if sender == SCHEDULER:
            self._last_from_scheduler = time.monotonic()
            if cmd in _CONTROL_CMDS:
                try:
                    self._handle_control(cmd, flags, req_id, arg, frames)
                except (ProtocolError, IndexError, KeyError, TypeError, ValueError) as exc:
                    self._malformed(sender, exc)
                return
        peer = self.peers.get(sender)
        if peer is None:
            self._malformed(sender, ProtocolError(f"message {Cmd(cmd).name} from an unknown sender"))
            return
        try:
            self.handle_data(peer, cmd, flags, req_id, arg, frames)
        except (ProtocolError, IndexError, KeyError, TypeError, ValueError) as exc:
            self._malformed(sender, exc)

    def _malformed(self, sender: bytes, exc: BaseException) -> None:
        self.malformed += 1
        logger.info("%s %d dropped a malformed message from %r (%d so far): %s", self.role, self.rank, sender[:64], self.malformed, exc)

    def _handle_control(self, cmd: int, flags: int, req_id: int, arg: int, frames: list) -> None:
        if cmd == Cmd.HEARTBEAT_ACK:
            return
        if cmd == Cmd.NODE_DIED:
            info = unpack_json(frames[1])
            self.fail(PeerDiedError(info["message"], info.get("role", ""), int(info.get("rank", -1)), info.get("host", "")))
            return
        if cmd == Cmd.WORKER_FINISHED:
            info = unpack_json(frames[1])
            self.on_worker_finished(int(info["rank"]), str(info["node"]))
            return
        if cmd == Cmd.SHUTDOWN:
            self.shutdown_requested = True
            self.send_control(Cmd.SHUTDOWN_ACK, req_id)
            return
        if cmd in (Cmd.BARRIER_DONE, Cmd.FINISH_ACK):
            waiter = self._waiters.pop(req_id, None)
            if waiter is not None and not waiter.done():
                if flags & FLAG_ERROR:
                    waiter.set_exception(PSNodeError(unpack_json(frames[1])["error"]))
                else:
                    waiter.set_result(None)
            return

    def barrier(self, group: "Group | int | str" = Group.WORKERS, timeout: float | None = None) -> None:
        """Block until every node of ``group`` (workers, servers or all) reached a barrier.

        A node calls it only for a group it belongs to. Liveness-checked: a node of the job that dies
        meanwhile fails it naming that node; no time limit unless ``timeout`` is given.

        Raises:
            ValueError: an unknown group (the message lists the groups).
            PSNodeError: this node is not in ``group``, or the barrier can never complete (a member
                already finished); PeerDiedError: a node died; NodeTimeoutError: ``timeout`` passed.
        """
        group = parse_group(group)
        if self.role not in GROUP_ROLES[group]:
            raise PSNodeError(f"{self.role} {self.rank} is not in the barrier group {group.name.lower()}")
        self._check()
        future: concurrent.futures.Future = concurrent.futures.Future()
        req = self.next_req_id()
        self.add_waiter(req, future)
        self.send_control(Cmd.BARRIER, req, int(group))
        self._wait(future, timeout, f"end of the {group.name.lower()} barrier")

    def _check(self) -> None:
        """Raise the node's failure, if any (the worker also refuses calls once closed)."""
        if self.failure is not None:
            raise self.failure

    def _wait(self, future: concurrent.futures.Future, limit: float | None, what: str) -> None:
        """Receive until ``future`` is done (single-threaded nodes; the worker overrides this)."""
        deadline = None if limit is None else time.monotonic() + limit
        while not future.done():
            if self.failure is not None:
                raise self.failure
            step = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if step <= 0:
                raise NodeTimeoutError(f"{self.role} {self.rank}: no {what} within {limit:g} s")
            self.process(step)
        future.result()

    def add_waiter(self, req_id: int, future: Any) -> None:
        """Complete ``future`` when the scheduler answers ``req_id`` (thread-safe)."""
        if self.failure is not None:
            future.set_exception(self.failure)
            return
        self._waiters[req_id] = future

    def handle_data(self, peer: PeerInfo, cmd: int, flags: int, req_id: int, arg: int, frames: list) -> None:
        """Handle a data message from ``peer`` (servers and workers override this)."""
        raise ProtocolError(f"{self.role} does not accept {Cmd(cmd).name}")

    # ---- failure -------------------------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        """Record the first failure and tell ``on_failure`` (thread-safe, once)."""
        with self._fail_lock:
            if self.failure is not None:
                return
            self.failure = error
        logger.info("%s %d failed: %s", self.role, self.rank, error)
        for waiter in list(self._waiters.values()):
            if not waiter.done():
                try:
                    waiter.set_exception(error)
                except Exception:  # an InvalidStateError from a concurrent completion
                    pass
        self._waiters.clear()
        self.on_failure(error)

    def on_failure(self, error: BaseException) -> None:
        """Called once with the first failure."""

    def on_worker_finished(self, rank: int, node: str) -> None:
        """Called when the scheduler says worker ``rank`` (described by ``node``) finished."""
