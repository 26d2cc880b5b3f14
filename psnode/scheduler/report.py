"""What the scheduler tells of the job it runs: the stats line for pslaunch and its own timeline.

``JobReport`` is the scheduler's part for both (``psnode.scheduler.node``): under pslaunch with
``PSLAUNCH_STATS`` it writes, every that many seconds, the latest checked counters of every node
with its state and heartbeat age (``psnode.node.stats.StatsLine``); with ``PSLAUNCH_TIMELINE`` it records
registration and each barrier (from the first arrival to the release) and answers the nodes'
clock probes with its own clock. With neither, every method returns at once.

Single-threaded: the scheduler's thread calls everything.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from psnode.env import NodeEnv
from psnode.node.protocol import Group, pack_json
from psnode.node.stats import StatsLine
from psnode.node.timeline import open_timeline

__all__ = ["JobReport"]


class JobReport:
    """The scheduler's stats line and timeline (see the module docstring).

    ``phase`` is the job's: ``registering``, ``running`` (the address book left), ``ending`` (every
    worker finished).
    """

    def __init__(self, env: NodeEnv, fingerprint: str) -> None:
        self.env = env
        self.phase = "registering"
        self.stats = StatsLine(env.stats_interval) if env.stats_interval > 0 else None
        self.timeline = open_timeline(env, "scheduler")
        if self.timeline is not None:
            self.timeline.name_process(0, env.root_uri)
        self._boot = fingerprint.split(":")[0]  # a node on this host (same boot id) takes the offset as exact
        self._started = time.monotonic_ns()
        self._barrier_start: dict[int, int] = {}  # group -> when its first member arrived

    def clock(self, probe: int) -> bytes:
        """The answer to a node's clock probe: the probe back, this clock now, this host's boot id."""
        return pack_json({"clock": probe, "now": time.monotonic_ns(), "boot": self._boot})

    def tell(self, members: Iterable[Any], at_once: bool = False) -> None:
        """Write the stats line when one is due, or ``at_once``: each member's role, rank, host, pid,
        state (``registered``, ``running``, ``rejoining``: a dead worker waiting for its restart,
        ``finished``), heartbeat age and latest counters."""
        stats = self.stats
        if stats is None:
            return
        now = time.monotonic()
        if not (at_once or stats.due(now)):
            return
        running = "registered" if self.phase == "registering" else "running"
        nodes = []
        for member in members:
            peer = member.peer
            state = "finished" if member.finished else "rejoining" if member.away_since is not None else running
            nodes.append({"role": peer.role, "rank": peer.rank, "host": peer.host, "pid": peer.pid, "state": state,
                          "age": round(max(0.0, now - member.last_seen), 3), "s": member.report or {}})
        stats.emit(now, self.phase, nodes, (self.env.heartbeat_interval, self.env.heartbeat_timeout))

    def registered(self) -> None:
        """Every node registered and has the address book."""
        self.phase = "running"
        if self.timeline is not None:
            self.timeline.add("registration", None, self._started, time.monotonic_ns())

    def barrier_arrived(self, group: int) -> None:
        """A member arrived at ``group``'s barrier (the first one starts its event)."""
        if self.timeline is not None:
            self._barrier_start.setdefault(group, time.monotonic_ns())

    def barrier_done(self, group: int) -> None:
        """``group``'s barrier released its members."""
        if self.timeline is not None:
            self.timeline.add("barrier", Group(group).name.lower(), self._barrier_start.pop(group), time.monotonic_ns())

    def ended(self, members: Iterable[Any], in_order: bool) -> None:
        """Every worker finished: the last stats line; the timeline ends (``in_order``: every server
        acknowledged the shutdown, so every node wrote its events and the JSON array is closed)."""
        self.phase = "ending"
        self.tell(members, at_once=True)
        if self.timeline is not None:
            self.timeline.close(end_array=in_order)

    def close(self) -> None:
        """Write the timeline's last events (idempotent)."""
        if self.timeline is not None:
            self.timeline.close()
