"""Link liveness over ssh: pslaunch pings every remote guard, hears its answers, and calls a host lost
when nothing at all came from it for the link timeout (``--link-timeout``, default 15 s).

A network partition delivers no end-of-input and no error: TCP keeps the connection open and
paramiko's keepalive never times out. So each side watches the other. ``LinkWatch`` writes
``PING`` to every remote process's guard every ``interval`` seconds (a fifth of the timeout, at
most 2 s); a guard that hears no line for the timeout stops its process group (``launcher.on_node.guard``).
Each guard answers ``PING`` with a ``PONG`` marker on its stderr, and anything that arrives from a
host (output too) counts as hearing from it; a host silent for the timeout is lost: its processes
are unreachable, and the job fails naming it. ``PongFilter`` takes the answers out of the stderr
stream before it is split into lines, so that they never cut a line a process is writing.

Time that pslaunch itself did not run (stopped with Ctrl-Z or by a debugger, a frozen machine) is
not the hosts' silence: a gap of more than half the timeout between two looks moves every host's
last-heard time forward by the gap. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Hashable

from ...config import DEFAULT_LINK_TIMEOUT
from ...on_node.guard import PING, PONG

__all__ = ["LinkWatch", "PongFilter"]


class PongFilter:
    """Removes ``PONG`` markers from a byte stream that arrives in chunks (a marker may be cut in
    two by a read). Not thread-safe: one per stream."""

    def __init__(self) -> None:
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        """The chunk without the markers; a tail that may start a marker is held for the next chunk
        (``b""`` is the end of the stream: what is held comes out)."""
        if not data:
            held, self._held = self._held, b""
            return held
        data = self._held + data
        self._held = b""
        if PONG in data:
            data = data.replace(PONG, b"")
        cut = data.rfind(PONG[:1])
        if cut >= 0 and PONG.startswith(data[cut:]):
            data, self._held = data[:cut], data[cut:]
        return data


class LinkWatch:
    """Pings the remote processes and keeps, per host, when pslaunch last heard from it."""

    def __init__(self, timeout: float = DEFAULT_LINK_TIMEOUT, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.interval = max(0.2, min(2.0, timeout / 5))
        self._clock = clock
        self._lock = threading.Lock()
        self._heard: dict[Hashable, float] = {}
        self._watched: set = set()
        self._senders: list[Callable[[bytes], None]] = []
        self._looked = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, host: Hashable, send: Callable[[bytes], None] | None = None, counting: bool = True) -> None:
        """Watch ``host``: it counts as just heard from (with ``counting``; else from the first word
        it sends: a host still being started is not silent). ``send(PING)`` is called every
        interval from now on, when given."""
        with self._lock:
            now = self._look()  # (time before the first host, the pre-flight check say, is no gap)
            self._watched.add(host)
            if counting:
                self._heard.setdefault(host, now)
            if send is not None:
                self._senders.append(send)
        if send is not None and self._thread is None and self.timeout > 0:
            self._thread = threading.Thread(target=self._run, name="pslaunch-link-ping", daemon=True)
            self._thread.start()

    def heard(self, host: Hashable) -> None:
        """Something arrived from ``host`` (ignored for a host that is not watched)."""
        now = self._clock()
        with self._lock:
            if host in self._watched:
                self._heard[host] = now

    def _look(self) -> float:
        """Now, after moving every last-heard time past a gap in which pslaunch did not run (lock held)."""
        now = self._clock()
        gap = now - self._looked
        if gap > self.timeout / 2:
            for host in self._heard:
                self._heard[host] += gap
        self._looked = now
        return now

    def silent_for(self, host: Hashable) -> float:
        """Seconds since anything arrived from ``host`` (0 while it is not counted yet)."""
        with self._lock:
            now = self._look()
            return now - self._heard.get(host, now)

    def last_heard(self, host: Hashable) -> float:
        """When anything last arrived from ``host`` (``time.monotonic``)."""
        with self._lock:
            self._look()
            return self._heard.get(host, self._clock())

    def lost(self, host: Hashable) -> bool:
        """Whether ``host`` was silent for the timeout (never with a timeout of 0)."""
        return self.timeout > 0 and self.silent_for(host) > self.timeout

    def in_doubt(self, host: Hashable) -> bool:
        """Whether ``host`` missed answers (more than two ping intervals of silence): it may be lost."""
        return self.timeout > 0 and self.silent_for(host) > 2 * self.interval + 0.5

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self._look()
                senders = list(self._senders)
            for send in senders:
                send(PING)

    def close(self) -> None:
        """Stop pinging."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.interval + 1)
