"""What pslaunch knows of a running job: the scheduler's stats lines, turned into one row per process.

The runtime's scheduler writes a ``PSLAUNCH-STATS`` line on its stderr every ``PSLAUNCH_STATS``
seconds (docs/env.md, "Under pslaunch"): its own usage and, per server and worker, its state, the
age of its last heartbeat and the counters that heartbeat carried. ``JobStats.take_line`` checks a
line (the scheduler's process runs user code too, so nothing in it is trusted: a bounded size, JSON
of the expected shape, numbers where numbers belong; a bad line is counted and dropped) and keeps
each node's recent reports. ``JobStats.rows`` joins them with pslaunch's own view of each process
(its handle: state, exit, uptime) into ``Row`` values: rates over the last few seconds (MB/s pushed
and pulled, rounds/s, updates/s, CPU%), the waiting share, a late heartbeat, and the straggler.

The straggler is the worker that spends the most time per round not waiting for the servers
(``straggler``): in ``dist_sync`` every worker runs the same rounds per second, and the one the
others wait for is the one that itself waits least; in ``dist_async`` it is the one with the fewest
rounds. It is named only when it stands out: 25% above the middle of the other workers.

With ``--max-restarts`` the rows go on across restarts: a new scheduler (the job restarted) starts
every row's reports afresh, and so does a node with a new pid (a worker restarted alone, which the
scheduler lists as ``rejoining`` until it is back).

Thread-safety: ``take_line`` runs on a reader thread, ``rows`` on any other; a lock guards the state.
"""

from __future__ import annotations

import collections
import json
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .watched import WatchedProcess

__all__ = ["JobStats", "Row", "straggler", "LINE_LIMIT", "RATE_WINDOW"]

#: Longest stats line taken (bytes of JSON; the longest line the printer keeps whole): a job of a
#: thousand nodes writes about 250 KiB.
LINE_LIMIT = 1 << 20
#: Seconds of reports a rate is computed over.
RATE_WINDOW = 5.0
#: How long a live process the runtime has not reported counts as ``starting``; after that it runs
#: user code (loading data before ``kvcore.create``, or a program that never joins the runtime).
STARTING_SECONDS = 2.0
_STANDS_OUT = 1.25
_NODE_ROLES = ("server", "worker", "replica")
_STATES = ("registered", "running", "rejoining", "finished")  # rejoining: a dead worker awaiting its restart
_MAX = float(1 << 62)


@dataclass
class Row:
    """One process as the dashboard, the metrics and the summary show it. Rates are None until two
    reports are in; counters are None for a process that reported nothing."""

    name: str
    role: str
    rank: int
    host: str
    pid: int | None
    state: str
    uptime: float
    exited: bool = False
    exit_code: int | None = None
    signal: int | None = None
    heartbeat_age: float | None = None
    late: bool = False
    cpu_percent: float | None = None
    rss: int | None = None
    counters: dict[str, float] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    wait_share: float | None = None
    straggler: bool = False


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= _MAX


class JobStats:
    """The latest stats of a job (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._history: dict[tuple[str, int], collections.deque] = {}  # (role, launcher rank) -> reports
        self._nodes: dict[tuple[str, int], dict] = {}  # the latest record of each node
        self._self: collections.deque = collections.deque(maxlen=64)  # (t, cpu, rss) of the scheduler
        self._scheduler: "WatchedProcess | None" = None
        self.received_at: float | None = None  # monotonic time of the latest good line
        self.heartbeat = (1.0, 10.0)
        self.phase = ""
        self.rejected = 0
        self.last_error = ""

    # ---- taking lines ----------------------------------------------------------------------
    def take_line(self, handle: WatchedProcess, text: str, handles: "list[WatchedProcess] | None" = None) -> bool:
        """Take the JSON after a ``STATS`` marker, written by ``handle`` (the scheduler's process);
        ``handles`` are the job's processes (to find each node's). False (and counted) when the line
        is malformed."""
        try:
            body = self._parse(text)
        except ValueError as exc:
            with self._lock:
                self.rejected += 1
                self.last_error = str(exc)
            return False
        now = time.monotonic()
        with self._lock:
            if handle is not self._scheduler:  # a restarted job: its new scheduler counts from zero again
                self._self.clear()
                self._nodes.clear()
                self._history.clear()
            self._scheduler = handle
            self.received_at = now
            self.phase = body["phase"]
            self.heartbeat = (body["hb"], body["hbt"])
            own = body["self"]
            self._self.append((body["t"], own["cpu"], own["rss"]))
            for node in body["nodes"]:
                key = self._key_of(node, handles or [])
                if key is None:
                    continue
                node["received"] = now
                previous = self._nodes.get(key)
                if previous is not None and previous.get("pid") != node.get("pid"):
                    self._history.pop(key, None)  # a worker restarted alone: a new process, new counters
                self._nodes[key] = node
                report = node["s"]
                if "t" in report:
                    history = self._history.setdefault(key, collections.deque(maxlen=64))
                    if not history or history[-1]["t"] < report["t"]:
                        history.append(report)
        return True

    @staticmethod
    def _parse(text: str) -> dict:
        """The stats line's JSON, every field checked. Raises ``ValueError`` saying what is wrong."""
        if len(text) > LINE_LIMIT:
            raise ValueError(f"a stats line of {len(text)} bytes (at most {LINE_LIMIT})")
        body = json.loads(text)  # ValueError (JSONDecodeError) when it is not JSON
        if not isinstance(body, dict) or body.get("v") != 1:
            raise ValueError("a stats line that is not a version 1 object")
        for name in ("t", "hb", "hbt"):
            if not _number(body.get(name)):
                raise ValueError(f"a stats line whose {name} is {body.get(name)!r}")
        if body.get("phase") not in ("registering", "running", "ending"):
            raise ValueError(f"a stats line whose phase is {str(body.get('phase'))[:40]!r}")
        own = body.get("self")
        if not isinstance(own, dict) or not all(_number(own.get(n)) for n in ("cpu", "rss", "pid")):
            raise ValueError("a stats line without the scheduler's own cpu, rss and pid")
        nodes = body.get("nodes")
        if not isinstance(nodes, list):
            raise ValueError("a stats line whose nodes are not a list")
        for node in nodes:
            if not isinstance(node, dict) or node.get("role") not in _NODE_ROLES or node.get("state") not in _STATES:
                raise ValueError(f"a stats line with the node {str(node)[:80]}")
            if not isinstance(node.get("rank"), int) or not _number(node.get("age")) or not isinstance(node.get("host"), str):
                raise ValueError(f"a stats line with the node {str(node)[:80]}")
            if not (node.get("pid") is None or _number(node.get("pid"))):
                raise ValueError(f"a stats line with the node {str(node)[:80]}")
            report = node.get("s")
            if not isinstance(report, dict) or not all(isinstance(k, str) and _number(v) for k, v in report.items()):
                raise ValueError(f"a stats line with the counters {str(report)[:80]}")
        return body

    @staticmethod
    def _key_of(node: dict, handles: "list[WatchedProcess]") -> tuple[str, int] | None:
        """Which process of pslaunch's a node is: by the launcher's rank it reports (``lr``), else by
        pid, else (workers) by its rank, which pslaunch fixed (``DMLC_WORKER_ID``)."""
        role = node["role"]
        launch_rank = node["s"].get("lr")
        if role == "server" and isinstance(launch_rank, int):
            # a replica that took a lost server's place reports as that server: its pid says which process it is
            for handle in handles:
                if handle.spec.role == "replica" and handle.pid is not None and handle.pid == node.get("pid"):
                    return "replica", handle.spec.rank
        if isinstance(launch_rank, int):
            return role, launch_rank
        for handle in handles:
            if handle.spec.role == role and handle.pid is not None and handle.pid == node.get("pid"):
                return role, handle.spec.rank
        if role == "worker" and node["rank"] >= 0:
            return role, node["rank"]
        return None

    # ---- rows ---------------------------------------------------------------------------------
    def rows(self, handles: "list[WatchedProcess]", now: float | None = None) -> list[Row]:
        """One ``Row`` per handle, in the handles' order (see the module docstring)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            rows = [self._row(handle, now) for handle in handles]
        for row in rows:
            row.straggler = False
        pick = straggler([r for r in rows if r.role == "worker" and not r.exited])
        if pick is not None:
            pick.straggler = True
        return rows

    def _row(self, handle: WatchedProcess, now: float) -> Row:
        spec = handle.spec
        status = handle.status
        row = Row(spec.name, spec.role, spec.rank, spec.host.label, handle.pid, "starting", handle.duration)
        if status is not None:
            row.exited = True
            row.exit_code, row.signal = status.code, status.signal
            row.state = status.describe().replace("exit code ", "exit ")
        if spec.role == "scheduler":
            if handle is self._scheduler and self._self:
                if status is None:
                    row.state = {"registering": "registering", "running": "running", "ending": "ending"}[self.phase]
                row.rss = int(self._self[-1][2])
                row.cpu_percent = _cpu_percent([(t, cpu) for t, cpu, _ in self._self])
            return row
        key = (spec.role, spec.rank)
        node = self._nodes.get(key)
        if node is None:
            if status is None and (self.phase in ("running", "ending") or handle.duration >= STARTING_SECONDS):
                row.state = "running"  # not (or not yet) a node of the runtime: its own code runs
            return row
        if status is None:
            row.state = node["state"]
            row.heartbeat_age = node["age"] + (now - node["received"])
            interval = self.heartbeat[0]
            row.late = node["state"] == "running" and interval > 0 and row.heartbeat_age > max(2.5 * interval, interval + 1.0)
        row.counters = dict(node["s"])
        row.rss = int(row.counters["rss"]) if "rss" in row.counters else None
        history = self._history.get(key)
        if history and len(history) >= 2:
            newest = history[-1]
            oldest = next(r for r in history if r["t"] >= newest["t"] - RATE_WINDOW)
            if oldest is newest:
                oldest = history[-2]
            span = newest["t"] - oldest["t"]
            if span > 0:
                row.rates = {name: max(0.0, newest[name] - oldest.get(name, 0.0)) / span
                             for name in newest if name not in ("t", "rss", "lr", "keys", "held_b", "kept_b", "queued", "waiting")}
                if "cpu" in row.rates:
                    row.cpu_percent = 100.0 * row.rates["cpu"]
                if "wait_s" in row.rates:
                    row.wait_share = min(1.0, row.rates["wait_s"])
        return row


def _cpu_percent(samples: list[tuple[float, float]]) -> float | None:
    if len(samples) < 2:
        return None
    newest = samples[-1]
    oldest = next(s for s in samples if s[0] >= newest[0] - RATE_WINDOW)
    if oldest is newest:
        oldest = samples[-2]
    span = newest[0] - oldest[0]
    return 100.0 * max(0.0, newest[1] - oldest[1]) / span if span > 0 else None


def straggler(workers: list[Row]) -> Row | None:
    """The worker that spends the most time per round not waiting, when it stands out (see the
    module docstring); None with fewer than two workers that have rates."""
    scored = []
    for row in workers:
        if row.wait_share is None or "rounds" not in row.rates:
            continue
        busy = 1.0 - row.wait_share
        scored.append((busy / max(row.rates["rounds"], 1e-3), row))
    if len(scored) < 2:
        return None
    scored.sort(key=lambda item: item[0])
    top, row = scored[-1]
    others = sorted(score for score, _ in scored[:-1])
    middle = others[len(others) // 2] if len(others) % 2 else (others[len(others) // 2 - 1] + others[len(others) // 2]) / 2
    return row if top > _STANDS_OUT * middle and top - middle > 1e-3 else None
