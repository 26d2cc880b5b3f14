"""Output of the job's processes: each line prefixed with who printed it.

A ``LineSplitter`` per stream turns raw bytes into blocks of whole lines (partial lines are held
until their end or EOF, up to ``MAX_LINE`` bytes; ``\\r``-updated progress bars are shown at most
once a second and their last state; bytes that are not UTF-8 are replaced, never fatal). The
``Printer`` writes ``[worker.0@host] text`` lines, coloured per role on a terminal, plain
otherwise, and keeps the last lines of every process for the root-cause report. ``--log-dir``
keeps the lines of each process in its own file.

Throughput: a reader thread hands the printer a block of many lines at a time; the printer
prefixes the whole block with a few string operations and queues it for one writer thread, the
only one that writes pslaunch's stdout and stderr. No lock is held while writing, so a slow
terminal holds up the queue (and, once it is full, the processes' pipes), never a reader
thread's bookkeeping.

With the dashboard on (``divert``) the writer thread hands the text to the dashboard instead,
which prints it above its table. Marker lines the runtime writes for what pslaunch shows of a
running job (stats, timeline events) go to ``observer`` (``launcher.observe.observer``) when one is set.

Thread-safety: ``Printer`` methods may be called from any thread; a ``LineSplitter`` belongs to
one reader thread.
"""

from __future__ import annotations

import collections
import os
import queue
import re
import sys
import threading
import time
from typing import Callable, TextIO

from ..errors import ConfigError

__all__ = ["LineSplitter", "Printer", "ROLE_COLOURS", "RANK_COLOURS", "MAX_LINE"]

#: ANSI colour per role on a terminal.
ROLE_COLOURS = {"scheduler": "35", "server": "36", "worker": "32", "mpirun": "33"}
#: Workers' colours, by rank in turn: neighbouring ranks' lines tell apart at a glance.
RANK_COLOURS = ("32", "34", "92", "94", "96", "93", "95", "90")

#: Longest line shown whole (bytes); a longer one is shown in pieces of this size, each prefixed.
MAX_LINE = 1024 * 1024
_PROGRESS_INTERVAL = 1.0
_QUEUE_BLOCKS = 256  # blocks queued for the writer before readers wait (backpressure)
_CAPTURED = 400  # lines ``capture`` keeps of a process at most


class LineSplitter:
    """Split a byte stream into text; call ``feed`` with each chunk and ``close`` at EOF.

    ``emit(block)`` gets one or more complete lines joined by ``\\n``, without the final line
    terminator. A line longer than ``MAX_LINE`` bytes is emitted in pieces of that size. A ``\\r``
    (progress bar redraw) ends a "status" segment: the latest one is emitted at most once per
    second, and the final state when the line ends.
    """

    def __init__(self, emit: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 max_line: int = MAX_LINE) -> None:
        self._emit = emit
        self._clock = clock
        self._max = max_line
        self._buf = bytearray()
        self._last_progress = float("-inf")
        self._pending: bytes | None = None  # latest progress state not shown yet
        self._shown = False  # a progress state of the current line was shown

    @staticmethod
    def _text(data: bytes) -> str:
        return data.decode("utf-8", errors="replace")

    @staticmethod
    def _latest(segment: bytes) -> bytes:
        parts = [p for p in segment.split(b"\r") if p]
        return parts[-1] if parts else b""

    def _end_line(self, line: bytes) -> None:
        text = self._latest(line) if b"\r" in line else line
        if not text and self._pending is not None:
            text = self._pending
        if text or not self._shown:
            self._emit(self._text(text))
        self._pending = None
        self._shown = False
        self._last_progress = float("-inf")

    def feed(self, data: bytes) -> None:
        """Add ``data``; emit every line it completes."""
        if b"\r" not in data and self._pending is None and not self._shown:
            # The common case: plain lines. Decode and emit them as one block.
            cut = data.rfind(b"\n")
            if cut >= 0:
                if self._buf:
                    self._buf += data[:cut]
                    block = bytes(self._buf)
                    self._buf.clear()
                else:
                    block = data[:cut]
                self._emit(self._text(block))
                data = data[cut + 1 :]
            self._buf += data
        else:
            self._feed_slowly(data)
        while len(self._buf) > self._max:
            self._emit(self._text(bytes(self._buf[: self._max])))
            del self._buf[: self._max]

    def _feed_slowly(self, data: bytes) -> None:
        self._buf += data
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            self._end_line(line)
        if b"\r" in self._buf:
            head, _, tail = bytes(self._buf).rpartition(b"\r")
            self._buf = bytearray(tail)
            latest = self._latest(head)
            if latest:
                now = self._clock()
                if now - self._last_progress >= _PROGRESS_INTERVAL:
                    self._last_progress = now
                    self._emit(self._text(latest))
                    self._pending = None
                    self._shown = True
                else:
                    self._pending = latest

    def close(self) -> None:
        """End of stream: emit a final partial line or progress state, if any."""
        if self._buf or self._pending is not None:
            self._end_line(bytes(self._buf))
            self._buf.clear()


class _Log:
    """A ``--log-dir`` file (a process's, or pslaunch's own); writers share it under its own lock."""

    def __init__(self, path: str) -> None:
        self.lock = threading.Lock()
        self.path = path
        self.file = None
        self.failed = False

    def write(self, text: str) -> str | None:
        """Append ``text`` (opening the file the first time); the error in words when it cannot."""
        with self.lock:
            if self.failed:
                return None
            try:
                if self.file is None:
                    self.file = open(self.path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
                self.file.write(text)
                self.file.flush()
            except OSError as exc:
                self.failed = True
                return exc.strerror or str(exc)
            return None


class Printer:
    """Writes prefixed lines of every process to pslaunch's stdout / stderr.

    ``colour`` None means "if the stream is a terminal" (and ``NO_COLOR`` is not set).
    ``quiet`` drops the processes' lines from the screen (log files and last lines still get them);
    so does ``ranks`` for the workers whose rank it does not hold (the scheduler's and servers'
    lines still show). ``timestamps`` starts each line on the screen with the time it arrived.
    Raises ``ConfigError`` when ``log_dir`` cannot be created.
    """

    def __init__(
        self,
        out: TextIO | None = None,
        err: TextIO | None = None,
        colour: bool | None = None,
        quiet: bool = False,
        log_dir: str | None = None,
        keep_lines: int = 10,
        ranks: frozenset[int] | None = None,
        timestamps: bool = False,
    ) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        if colour is None:
            colour = _isatty(self.out) and "NO_COLOR" not in os.environ
        self.colour = colour
        self.quiet = quiet
        self.ranks = ranks
        self.timestamps = timestamps
        self.log_dir = log_dir
        if log_dir:
            try:
                os.makedirs(log_dir, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"--log-dir {log_dir}: cannot create it: {exc.strerror or exc}") from None
        self._keep = keep_lines
        self._last: dict[str, collections.deque[str]] = {}
        self._captured: dict[str, list[str]] = {}  # ``capture``: every line of a process, for a while
        self._logs: dict[object, _Log] = {}  # (process name, stream), and "pslaunch" for its own
        self._prefixes: dict[tuple[str, str], str] = {}
        self._table_lock = threading.Lock()  # only for adding entries to the dicts above
        self._queue: queue.Queue = queue.Queue(_QUEUE_BLOCKS)
        self._diverted = None  # the dashboard, while it draws: it prints the text above its table
        #: ``observer(handle, text)`` takes a marker line's text; True when it was the observer's
        self.observer: Callable | None = None
        self._writer = threading.Thread(target=self._write_loop, name="pslaunch-output", daemon=True)
        self._writer.start()

    def prefix(self, name: str, role: str) -> str:
        """``[name]``, coloured when colour is on: a worker by its rank (``RANK_COLOURS``), the
        others by ``role``."""
        if self.colour:
            rank = _rank_of(name) if role == "worker" else None
            colour = RANK_COLOURS[rank % len(RANK_COLOURS)] if rank is not None else ROLE_COLOURS.get(role, "0")
            return f"\x1b[{colour}m[{name}]\x1b[0m"
        return f"[{name}]"

    def _entry(self, table: dict, key, make):
        value = table.get(key)
        if value is None:
            with self._table_lock:
                value = table.setdefault(key, make())
        return value

    def lines(self, name: str, role: str, block: str, stream: str = "stdout") -> None:
        """Print ``block``, one or more lines of process ``name`` joined by ``\\n`` (``stream`` is
        ``stdout`` or ``stderr``). The lines also go to the process's ``--log-dir`` file and to its
        last lines. Blocks while the output queue is full."""
        last = self._entry(self._last, name, lambda: collections.deque(maxlen=self._keep))
        last.extend(block.rsplit("\n", self._keep)[-self._keep :])
        capture = self._captured.get(name)
        if capture is not None and len(capture) < _CAPTURED:
            capture.extend(block.split("\n")[: _CAPTURED - len(capture)])
        if self.log_dir:
            self._log(name, block, stream)
        if self.quiet or (self.ranks is not None and role == "worker" and _rank_of(name) not in self.ranks):
            return
        prefix = self._entry(self._prefixes, (name, role), lambda: self.prefix(name, role) + " ")
        if self.timestamps:
            now = time.time()
            prefix = f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now % 1 * 1000):03d} {prefix}"
        self._queue.put((stream, prefix + block.replace("\n", "\n" + prefix) + "\n"))

    line = lines  # one line is a block of one

    def log_path(self, name: str, stream: str = "stdout") -> str | None:
        """The ``--log-dir`` file of process ``name``: ``worker.0@host.log`` holds both streams in
        order, ``worker.0@host.stderr.log`` its stderr alone (``stream="stderr"``); None without a
        log dir."""
        if not self.log_dir:
            return None
        base = name.replace("/", "_").replace(":", "_")
        return os.path.join(self.log_dir, base + (".stderr.log" if stream == "stderr" else ".log"))

    def _log_file(self, name: str, stream: str) -> _Log:
        """The ``--log-dir`` file of process ``name`` for ``stream`` (made on first use)."""
        return self._entry(self._logs, (name, stream), lambda: _Log(self.log_path(name, stream)))  # type: ignore[arg-type]

    def _log(self, name: str, block: str, stream: str) -> None:
        for which in ("stdout", "stderr") if stream == "stderr" else ("stdout",):
            log = self._log_file(name, which)
            problem = log.write(block + "\n")
            if problem is not None:
                self.note(f"cannot write {log.path}: {problem}; {name}'s lines go to the screen only")

    def starting(self, names) -> None:
        """The processes ``names`` start (again): drop the last lines kept of them, so that a root
        cause quotes the new process's lines and never its predecessor's; with a log dir, make their
        files now, so that a process that prints nothing has them too."""
        for name in names:
            self._last.pop(name, None)
            if self.log_dir:
                for which in ("stdout", "stderr"):
                    self._log_file(name, which).write("")

    def capture(self, name: str) -> None:
        """From now on keep every line process ``name`` prints (up to ``_CAPTURED``), for ``captured``:
        a stalled worker's stack is longer than its last lines."""
        self._captured[name] = []

    def captured(self, name: str) -> list[str]:
        """The lines process ``name`` printed since ``capture(name)``, oldest first."""
        return list(self._captured.get(name, ()))

    def last_lines(self, name: str) -> list[str]:
        """The last lines process ``name`` printed (both streams), oldest first."""
        return list(self._last.get(name, ()))

    def note(self, text: str) -> None:
        """A line from pslaunch itself, on stderr (also when quiet, for warnings and errors)."""
        self.raw(f"pslaunch: {text}\n")

    def raw(self, text: str, stream: str = "stderr") -> None:
        """Write ``text`` as it is, in order with the lines queued before it; with a log dir also to
        its ``pslaunch.log`` (``record``)."""
        self.record(text)
        self._queue.put((stream, text))

    def record(self, text: str) -> None:
        """Write ``text`` to the log dir's ``pslaunch.log`` only (pslaunch's own lines and the
        summary, without colours); nothing without a log dir."""
        if self.log_dir:
            own = self._entry(self._logs, "pslaunch", lambda: _Log(os.path.join(self.log_dir, "pslaunch.log")))
            own.write(_COLOUR.sub("", text))

    def divert(self, target) -> None:
        """From now on hand what would be written to ``target.write(stream, text)`` (the dashboard;
        ``target.flush()`` on ``flush``); None writes to the streams again."""
        self._diverted = target

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything queued so far is written (at most ``timeout`` seconds)."""
        if not self._writer.is_alive():
            return
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return
        done.wait(timeout)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            items = [item]
            while len(items) < 64:  # write what is queued in one go, flush once
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            touched: set = set()
            stop = False
            for entry in items:
                if entry is None:
                    stop = True
                elif isinstance(entry, threading.Event):
                    self._flush_targets(touched)
                    touched.clear()
                    diverted = self._diverted
                    if diverted is not None:
                        diverted.flush()
                    entry.set()
                elif self._diverted is not None:
                    self._diverted.write(entry[0], entry[1])
                else:
                    target = self.err if entry[0] == "stderr" else self.out
                    try:
                        target.write(entry[1])
                        touched.add(target)
                    except (OSError, ValueError):
                        pass  # our own stdout went away (closed pipe); the job goes on, logs still get it
            self._flush_targets(touched)
            if stop:
                return

    @staticmethod
    def _flush_targets(targets: set) -> None:
        for target in targets:
            try:
                target.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Write what is queued, stop the writer and close the log files."""
        if self._writer.is_alive():
            try:
                self._queue.put(None, timeout=10)
            except queue.Full:
                pass
            self._writer.join(10)
        for log in self._logs.values():
            with log.lock:
                if log.file is not None:
                    log.file.close()
                    log.file = None


_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def _rank_of(name: str) -> int | None:
    """The rank in a process name ``role.rank@host`` (None when it has none)."""
    rank = name.split("@", 1)[0].rpartition(".")[2]
    return int(rank) if rank.isdigit() else None


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
