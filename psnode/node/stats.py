"""The counters a node reports with its heartbeats, and the scheduler's stats line for pslaunch.

With ``PSLAUNCH_STATS`` set (pslaunch sets it for its dashboard, ``--metrics-port`` and
``--summary-json``), every server and worker puts a small JSON object of counters in its heartbeat
(``report``). The counters themselves are plain attributes of the parts that do the work, bumped by
an integer add on the hot path: a worker's ``RequestTable`` (bytes pushed and pulled, rounds), its
``Receiver`` (seconds callers waited for replies) and ``Outbox`` (messages queued), and in
allreduce mode its collectives ``Engine`` (the bytes of the values it summed count as pushed and
pulled, collectives of its most used key as rounds); a server's
``ServerStore`` (keys, bytes held and received, updates) and ``Replies`` (pulls waiting for a round).

The scheduler treats every report as untrusted input (``check_report``: a bounded size, known
fields only, finite non-negative numbers) and keeps the latest one per node. Every
``PSLAUNCH_STATS`` seconds it writes one line on its own stderr, ``MARKER_STATS`` and a JSON object
(``StatsLine``), which pslaunch reads and never shows: the scheduler's stderr is a channel pslaunch
already reads on every backend (a pipe, an ssh channel, mpirun's output), so no port is opened and
nothing is scraped from logs. The line's format is in docs/env.md ("Under pslaunch").

Single-threaded where it is used: a node builds its report on the thread that sends heartbeats,
the scheduler's one thread does the rest.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Callable

from psnode.env import MARKER_STATS
from psnode.errors import ProtocolError
from psnode.node.protocol import unpack_json

__all__ = ["stderr_line", "WORKER_FIELDS", "SERVER_FIELDS", "REPORT_LIMIT", "check_report", "check_body", "process_usage", "worker_report",
           "server_report", "StatsLine"]

#: Fields every report has: node uptime (s), process CPU time (s), resident memory (bytes), and
#: the launcher's rank of the process (``PSLAUNCH_RANK``), which is how pslaunch finds its row.
COMMON_FIELDS = frozenset({"t", "cpu", "rss", "lr"})
#: A worker's counters: bytes pushed and pulled, rounds (pushes of its most pushed key), seconds its
#: callers waited for replies, messages queued to send.
WORKER_FIELDS = COMMON_FIELDS | {"push_b", "pull_b", "rounds", "wait_s", "queued"}
#: A server's counters: keys held, bytes held, bytes of pushes received, key updates applied, pulls
#: waiting for a round to close.
SERVER_FIELDS = COMMON_FIELDS | {"keys", "held_b", "kept_b", "push_b", "updates", "waiting", "stalled"}
_FIELDS = {"worker": WORKER_FIELDS, "server": SERVER_FIELDS, "replica": SERVER_FIELDS}

#: Bytes a heartbeat's JSON body may take (a report is about 150).
REPORT_LIMIT = 1024
_MAX_VALUE = float(1 << 62)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_usage() -> tuple[float, int]:
    """This process's CPU time (user + system, seconds) and resident memory (bytes; 0 if unknown)."""
    times = os.times()
    try:
        with open("/proc/self/statm", "rb") as fh:
            rss = int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        rss = 0
    return times.user + times.system, rss


def _common(launch_rank: int | None) -> dict[str, float]:
    cpu, rss = process_usage()
    report: dict[str, float] = {"t": round(time.monotonic(), 3), "cpu": round(cpu, 3), "rss": rss}
    if launch_rank is not None:
        report["lr"] = launch_rank
    return report


def worker_report(worker: Any) -> dict[str, float]:
    """The heartbeat report of a ``WorkerNode`` (read from its parts' counters)."""
    requests, receiver = worker.requests, worker.receiver
    report = _common(worker.env.launch_rank)
    since = receiver.waiting_since
    waited = receiver.waited + (max(0.0, report["t"] - since) if since else 0.0)  # a wait still going on counts
    summed, coll_rounds = worker.collectives.summed_bytes, worker.collectives.rounds  # allreduce mode
    report.update(push_b=requests.pushed_bytes + summed, pull_b=requests.pulled_bytes + summed,
                  rounds=max(requests.rounds, coll_rounds),
                  wait_s=round(waited, 4), queued=len(worker.outbox.queue))
    return report


def server_report(server: Any) -> dict[str, float]:
    """The heartbeat report of a ``ServerNode`` (read from its parts' counters)."""
    store = server.store
    report = _common(server.conn.env.launch_rank)
    report.update(keys=len(store.shards), held_b=store.held_bytes, kept_b=store.kept_bytes, push_b=store.pushed_bytes,
                  updates=store.updates, waiting=server.replies.pulls_waiting(), stalled=server.stalls.stalled)
    return report


def check_report(role: str, body: Any) -> dict[str, float]:
    """The counters of a heartbeat body from a ``role`` node, every field checked.

    Raises:
        ProtocolError: not an object, an unknown field, or a value that is not a finite number
            in 0 .. 2**62 (the message names it).
    """
    if not isinstance(body, dict):
        raise ProtocolError(f"a stats report that is a {type(body).__name__}, not an object")
    allowed = _FIELDS.get(role)
    if allowed is None:
        raise ProtocolError(f"a stats report from a {role!r} node")
    out: dict[str, float] = {}
    for name, value in body.items():
        if name not in allowed:
            raise ProtocolError(f"a {role}'s stats report with the unknown field {str(name)[:40]!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and 0 <= value <= _MAX_VALUE):
            raise ProtocolError(f"a {role}'s stats report with {name}={repr(value)[:40]}, not a number in 0..2**62")
        out[name] = value
    return out


def check_body(role: str, frame: Any) -> tuple[dict[str, float] | None, int | None]:
    """The counters (``s``) and clock probe (``clock``) of the JSON body a ``role`` node sent with a
    heartbeat (or a worker's finish, a server's shutdown acknowledgement), every field checked;
    None for a field the body does not have.

    Raises:
        ProtocolError: a body over ``REPORT_LIMIT`` bytes, not an object of those two fields, a
            report ``check_report`` refuses, or a probe that is not an integer (the message names it).
    """
    size = len(frame.buffer) if hasattr(frame, "buffer") else len(frame)
    if size > REPORT_LIMIT:
        raise ProtocolError(f"a body of {size} bytes; it may take {REPORT_LIMIT}")
    body = unpack_json(frame)
    if not isinstance(body, dict) or not set(body) <= {"s", "clock"}:
        raise ProtocolError(f"a body {str(body)[:80]!r}, not an object of s and clock")
    report = check_report(role, body["s"]) if "s" in body else None
    clock = body.get("clock")
    if clock is not None and type(clock) is not int:
        raise ProtocolError(f"a clock probe of {str(clock)[:40]!r}, not an integer")
    return report, clock


class StatsLine:
    """The scheduler's periodic line of the job's counters (see the module docstring).

    ``write(text)`` writes one line (default: the process's stderr, flushed).
    """

    def __init__(self, interval: float, write: Callable[[str], None] | None = None) -> None:
        self.interval = interval
        self.started = time.monotonic()
        self.next_at = 0.0
        self._write = write or stderr_line

    def due(self, now: float) -> bool:
        """True when a line is due at monotonic time ``now``."""
        return self.interval > 0 and now >= self.next_at

    def emit(self, now: float, phase: str, nodes: list[dict], heartbeat: tuple[float, float]) -> None:
        """Write the line: the scheduler's own usage, the ``phase`` of the job (``registering``,
        ``running``, ``ending``) and one record per node (role, rank, state, heartbeat age ...)."""
        self.next_at = now + self.interval
        cpu, rss = process_usage()
        body = {"v": 1, "t": round(now - self.started, 3), "phase": phase, "hb": heartbeat[0], "hbt": heartbeat[1],
                "self": {"cpu": round(cpu, 3), "rss": rss, "pid": os.getpid()}, "nodes": nodes}
        self._write(f"{MARKER_STATS} {json.dumps(body, separators=(',', ':'))}")


def stderr_line(text: str) -> None:
    """Write ``text`` as one line on stderr, for pslaunch (a marker line; nothing when stderr is gone)."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # stderr is gone: pslaunch stopped reading, nothing to tell
