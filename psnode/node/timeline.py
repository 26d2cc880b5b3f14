"""A node's timeline: what it did and when, as Chrome / Perfetto trace events, streamed out.

``PSLAUNCH_TIMELINE`` turns it on (docs/env.md). Each node is one process of the trace (the
scheduler, then the servers, then the workers, by rank) and each of its threads a track:

* workers: ``push``, ``pull``, ``pushpull``, ``init``, ``row_sparse_pull`` and ``barrier`` of
  kvcore's API, one event per call named by its key (a call of many keys is named by their count),
  and ``wait``, the time a caller was blocked for replies (``worker_receiver``), nested in the call
  that waited;
* servers: ``merge`` of each push into its key's round, with ``update`` nested in the push that
  closed the round (a group of small keys merges and updates as one event);
* every node: ``register``; the scheduler: ``registration`` (until the address book left) and each
  ``barrier`` from the first arrival to the release.

Clocks: every node stamps events with its host's monotonic clock. Right after registration a node
asks the scheduler for its clock a few times (heartbeats with a ``clock`` field, ``SchedulerLink``)
and keeps the offset of the exchange with the shortest round trip; a node on the scheduler's host
(same boot id) uses offset 0. Events are written in the scheduler's clock, so the processes of
every host line up.

Memory is bounded: events wait in a queue of at most ``FLUSH_EVERY`` and are then formatted and
written out, and at every heartbeat. Where they go (``open_timeline``): with ``PSLAUNCH_TIMELINE=-``
(pslaunch sets it for ``--timeline``) as ``MARKER_TRACE`` lines on the process's stderr, each a
JSON array of at most ``LINE_LIMIT`` bytes, which pslaunch writes into its file; with a path, every
node appends to that file (one ``write`` per block, so nodes of one host never interleave inside an
event). The file is a JSON array: it starts with ``[`` and a metadata event, each event line starts
with a comma, and the scheduler of a job that ended in order writes the ``]``; Chrome's and
Perfetto's loaders accept the array without it too.

Timestamps and durations are whole microseconds, both ends of an event floored on one grid, so
nesting survives the rounding. Off (the default), nothing here runs: kvcore's calls and the
server's store are only wrapped when a timeline exists, and the receiver checks one attribute.

Thread-safety: ``add`` and the wrappers may be called from any thread (a deque append); ``flush``
takes the timeline's lock, and a thread that finds it taken leaves the flush to its holder.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from typing import Any, Callable, Hashable

from psnode.env import MARKER_TRACE, TIMELINE_TO_LAUNCHER, NodeEnv
from psnode.errors import EnvError

__all__ = ["Timeline", "open_timeline", "trace_pid", "FLUSH_EVERY", "LINE_LIMIT", "FILE_HEADER"]

#: Events queued before the recording thread formats and writes them.
FLUSH_EVERY = 4096
#: Longest ``MARKER_TRACE`` line (bytes): under a pipe's atomic write size, so lines never interleave.
LINE_LIMIT = 3800
#: How a timeline file starts (the scheduler's ``]`` ends it).
FILE_HEADER = '[{"name":"process_name","ph":"M","pid":0,"tid":0,"args":{"name":"pslaunch timeline"}}\n'
_CLOCK_PROBES = 5
_PREFIX_CACHE = 20000
_KEY_TEXT = 60


def trace_pid(role: str, rank: int, num_servers: int, num_workers: int) -> int:
    """The trace's process id of a node: 1 the scheduler, then the servers, then the workers, by rank
    (a node without a rank gets one past them all plus its OS pid)."""
    if role == "scheduler":
        return 1
    if rank < 0:
        return 2 + num_servers + num_workers + os.getpid()
    return 2 + rank if role == "server" else 2 + num_servers + rank


def _label(name: str, key: Any) -> str:
    if key is None:
        return name
    if isinstance(key, (list, tuple)):
        key = key[0] if len(key) == 1 else f"{len(key)} keys"
    text = str(key)
    return f"{name} {text if len(text) <= _KEY_TEXT else text[:_KEY_TEXT] + '...'}"


class _StderrSink:
    """Events as ``MARKER_TRACE`` lines on fd 2, for pslaunch (each line one ``write``)."""

    def write_events(self, events: list[str]) -> None:
        line: list[str] = []
        size = 0
        for event in events:
            if line and size + len(event) + 1 > LINE_LIMIT:
                self._line(line)
                line, size = [], 0
            line.append(event)
            size += len(event) + 1
        if line:
            self._line(line)

    @staticmethod
    def _line(events: list[str]) -> None:
        data = f"{MARKER_TRACE} [{','.join(events)}]\n".encode()
        try:
            os.write(2, data)
        except OSError:
            pass  # pslaunch is gone: nobody to tell

    def close(self, end_array: bool = False) -> None:
        """Nothing to close: pslaunch ends the file."""


class _FileSink:
    """Events appended to a file every node of the host shares (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.exists(path):
            # created whole with its header, or not at all: another node may be creating it right now
            tmp = f"{path}.{os.getpid()}.{os.urandom(3).hex()}"
            try:
                with open(tmp, "w", encoding="utf-8") as fh:
                    fh.write(FILE_HEADER)
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    pass
            except OSError as exc:
                raise EnvError(f"PSLAUNCH_TIMELINE={path!r}: cannot create the timeline file: "
                               f"{exc.strerror or exc}") from None
            finally:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            raise EnvError(f"PSLAUNCH_TIMELINE={path!r}: cannot open the timeline file: {exc.strerror or exc}") from None

    def write_events(self, events: list[str]) -> None:
        if events and self.fd >= 0:
            try:
                os.write(self.fd, ("," + "\n,".join(events) + "\n").encode())
            except OSError:
                pass  # a full disk must not stop the job; the trace just ends early

    def close(self, end_array: bool = False) -> None:
        if self.fd < 0:
            return
        try:
            if end_array:
                os.write(self.fd, b"]\n")
        except OSError:
            pass
        finally:
            os.close(self.fd)
            self.fd = -1


def open_timeline(env: NodeEnv, role: str) -> "Timeline | None":
    """The timeline of a ``role`` node when ``PSLAUNCH_TIMELINE`` asks for one, else None.

    Raises:
        EnvError: the file cannot be created or opened (the message names it).
    """
    if not env.timeline:
        return None
    sink = _StderrSink() if env.timeline == TIMELINE_TO_LAUNCHER else _FileSink(env.timeline)
    return Timeline(role, env.num_servers, env.num_workers, sink)


class Timeline:
    """The events of one node (see the module docstring). ``sink`` takes formatted events."""

    def __init__(self, role: str, num_servers: int, num_workers: int, sink: Any) -> None:
        self.role = role
        self.num_servers = num_servers
        self.num_workers = num_workers
        self.events: collections.deque = collections.deque()
        self.offset_ns = 0  # add to this host's monotonic clock to get the scheduler's
        self.clock_note = "the scheduler's clock" if role == "scheduler" else "not aligned"
        self.pid: int | None = None
        self._sink = sink
        self._lock = threading.Lock()
        self._tids: dict[int, int] = {}
        self._prefixes: dict[tuple[str, Hashable, int], str] = {}  # an event's JSON up to "ts"
        self._pending_meta: list[str] = []
        self._best_rtt: int | None = None
        self.closed = False

    # ---- recording ---------------------------------------------------------------------------
    @staticmethod
    def now() -> int:
        """This host's monotonic clock, in nanoseconds (what events are stamped with)."""
        return time.monotonic_ns()

    def add(self, name: str, key: Any, start_ns: int, end_ns: int) -> None:
        """Record an event ``name`` (of ``key``, or None) on the calling thread, from ``start_ns``
        to ``end_ns`` (``now()`` values)."""
        events = self.events
        events.append((name, key, start_ns, end_ns, threading.get_ident()))
        if len(events) >= FLUSH_EVERY:
            self.flush()

    def wrap(self, fn: Callable, name: str, key_of: Callable[[tuple], Any] | None = None) -> Callable:
        """``fn``, recording an event ``name`` for every call: of the key ``key_of(args)`` names,
        or of none when ``key_of`` is None."""
        events = self.events
        now = time.monotonic_ns
        ident = threading.get_ident
        flush = self.flush

        if key_of is None:
            def traced(*args: Any, **kwargs: Any) -> Any:
                start = now()
                try:
                    return fn(*args, **kwargs)
                finally:
                    events.append((name, None, start, now(), ident()))
                    if len(events) >= FLUSH_EVERY:
                        flush()
        else:
            def traced(*args: Any, **kwargs: Any) -> Any:
                start = now()
                try:
                    return fn(*args, **kwargs)
                finally:
                    events.append((name, key_of(args), start, now(), ident()))
                    if len(events) >= FLUSH_EVERY:
                        flush()

        traced.__wrapped__ = fn  # type: ignore[attr-defined]
        traced.__doc__ = fn.__doc__
        return traced

    # ---- clocks and naming -------------------------------------------------------------------
    def clock_sample(self, sent_ns: int, their_ns: int, received_ns: int, same_boot: bool) -> None:
        """One clock exchange with the scheduler: sent at ``sent_ns``, its clock read ``their_ns``,
        the answer back at ``received_ns`` (this host's clock). Keeps the shortest round trip's."""
        if same_boot:  # one kernel, one monotonic clock: nothing to measure
            self.offset_ns, self._best_rtt, self.clock_note = 0, 0, "the scheduler's host clock"
            return
        rtt = received_ns - sent_ns
        if rtt < 0 or (self._best_rtt is not None and rtt >= self._best_rtt):
            return
        self._best_rtt = rtt
        self.offset_ns = their_ns - (sent_ns + received_ns) // 2
        self.clock_note = f"offset {self.offset_ns / 1000:+.1f} us to the scheduler (round trip {rtt / 1000:.1f} us)"

    #: Clock exchanges a node makes at registration.
    CLOCK_PROBES = _CLOCK_PROBES

    def name_process(self, rank: int, host: str) -> None:
        """Name this node's process in the trace (``worker 1 (10.0.0.3, pid 812)``); events recorded
        so far are written from now on."""
        self.pid = trace_pid(self.role, rank, self.num_servers, self.num_workers)
        who = self.role if self.role == "scheduler" else f"{self.role} {rank}"
        name = json.dumps(f"{who} ({host}, pid {os.getpid()})")
        self._pending_meta += [
            f'{{"name":"process_name","ph":"M","pid":{self.pid},"tid":0,"args":{{"name":{name}}}}}',
            f'{{"name":"process_sort_index","ph":"M","pid":{self.pid},"tid":0,"args":{{"sort_index":{self.pid}}}}}',
            f'{{"name":"process_labels","ph":"M","pid":{self.pid},"tid":0,'
            f'"args":{{"labels":{json.dumps("clock: " + self.clock_note)}}}}}',
        ]

    # ---- writing ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Format and write the queued events (once the process is named); any thread."""
        if self.pid is None or not self._lock.acquire(blocking=False):
            return
        try:
            if self.closed:
                return
            self._sink.write_events(self._format())
        finally:
            self._lock.release()

    def _format(self) -> list[str]:
        events = self.events
        out, self._pending_meta = self._pending_meta, []
        offset = self.offset_ns
        prefixes = self._prefixes
        if len(prefixes) > _PREFIX_CACHE:
            prefixes.clear()
        for _ in range(len(events)):
            name, key, start, end, ident = events.popleft()
            try:
                prefix = prefixes[(name, key, ident)]
            except (KeyError, TypeError):  # TypeError: an unhashable key (a list of keys)
                prefix = self._prefix(name, key, ident, out)
            # whole microseconds, both ends floored on one grid: nesting survives, and integers format
            # several times faster than fractions (this loop is most of what a timeline costs)
            start = (start + offset) // 1000
            out.append(f'{prefix}{start},"dur":{(end + offset) // 1000 - start}}}')
        return out

    def _prefix(self, name: str, key: Any, ident: int, out: list[str]) -> str:
        """The start of an event's JSON up to its timestamp (cached per name, key and thread); a new
        thread's name goes to ``out`` first."""
        tid = self._tids.get(ident)
        if tid is None:
            tid = self._tids[ident] = len(self._tids) + 1
            out.append(f'{{"name":"thread_name","ph":"M","pid":{self.pid},"tid":{tid},'
                       f'"args":{{"name":{json.dumps(_thread_name(ident))}}}}}')
        prefix = (f'{{"name":{json.dumps(_label(name, key))},"cat":"{self.role}","ph":"X","pid":{self.pid},'
                  f'"tid":{tid},"ts":')
        if key is None or type(key) in (int, str):
            self._prefixes[(name, key, ident)] = prefix
        return prefix

    def close(self, end_array: bool = False) -> None:
        """Write what is queued and close the sink (``end_array``: end the file's JSON array, which
        only the scheduler of a job that ended in order does). Idempotent."""
        if self.pid is None:
            self.name_process(-1, "not registered")
        with self._lock:
            if self.closed:
                return
            self._sink.write_events(self._format())
            self.closed = True
            self._sink.close(end_array)


def _thread_name(ident: int) -> str:
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread.name
    return f"thread {ident}"
