"""Output of the job's processes: each line prefixed with who printed it.

A ``LineSplitter`` per stream turns raw bytes into lines (partial lines are held until their end
or EOF; ``\\r``-updated progress bars are shown at most once a second and their last state; bytes
that are not UTF-8 are replaced, never fatal). The ``Printer`` writes ``[worker.0@host] text``
lines, coloured per role on a terminal, plain otherwise, and keeps the last lines of every process
for the root-cause report. ``--log-dir`` keeps the lines of each process in its own file.

Thread-safety: ``Printer`` methods may be called from any thread (one lock); a ``LineSplitter``
belongs to one reader thread.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Callable, TextIO

__all__ = ["LineSplitter", "Printer", "ROLE_COLOURS"]

#: ANSI colour per role on a terminal.
ROLE_COLOURS = {"scheduler": "35", "server": "36", "worker": "32", "mpirun": "33"}

_MAX_LINE = 64 * 1024
_PROGRESS_INTERVAL = 1.0


class LineSplitter:
    """Split a byte stream into text lines; call ``feed`` with each chunk and ``close`` at EOF.

    ``emit(text)`` gets each complete line without its terminator. A line longer than 64 KiB is
    emitted in pieces. A ``\\r`` (progress bar redraw) ends a "status" segment: the latest one is
    emitted at most once per second, and the final state when the line ends.
    """

    def __init__(self, emit: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._emit = emit
        self._clock = clock
        self._buf = bytearray()
        self._last_progress = float("-inf")
        self._pending: bytes | None = None  # latest progress state not shown yet
        self._shown = False  # a progress state of the current line was shown

    def _text(self, data: bytes) -> str:
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
        while len(self._buf) > _MAX_LINE:
            self._emit(self._text(bytes(self._buf[:_MAX_LINE])))
            del self._buf[:_MAX_LINE]

    def close(self) -> None:
        """End of stream: emit a final partial line or progress state, if any."""
        if self._buf or self._pending is not None:
            self._end_line(bytes(self._buf))
            self._buf.clear()


class Printer:
    """Writes prefixed lines of every process to pslaunch's stdout / stderr.

    ``colour`` None means "if the stream is a terminal" (and ``NO_COLOR`` is not set).
    ``quiet`` drops the processes' lines from the screen (log files and last lines still get them).
    """

    def __init__(
        self,
        out: TextIO | None = None,
        err: TextIO | None = None,
        colour: bool | None = None,
        quiet: bool = False,
        log_dir: str | None = None,
        keep_lines: int = 10,
    ) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        if colour is None:
            colour = self.out.isatty() and "NO_COLOR" not in os.environ
        self.colour = colour
        self.quiet = quiet
        self.log_dir = log_dir
        self._lock = threading.Lock()
        self._last: dict[str, collections.deque[str]] = {}
        self._logs: dict[str, object] = {}
        self._keep = keep_lines
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    def prefix(self, name: str, role: str) -> str:
        """``[name]``, coloured for ``role`` when colour is on."""
        if self.colour:
            return f"\x1b[{ROLE_COLOURS.get(role, '0')}m[{name}]\x1b[0m"
        return f"[{name}]"

    def line(self, name: str, role: str, text: str, stream: str = "stdout") -> None:
        """Print one line ``text`` of process ``name`` (``stream`` is ``stdout`` or ``stderr``).

        The line also goes to the process's ``--log-dir`` file and to its last lines.
        """
        with self._lock:
            self._last.setdefault(name, collections.deque(maxlen=self._keep)).append(text)
            self._log(name, text)
            if self.quiet:
                return
            target = self.err if stream == "stderr" else self.out
            try:
                target.write(f"{self.prefix(name, role)} {text}\n")
                target.flush()
            except (OSError, ValueError):
                pass  # our own stdout went away (closed pipe); the job goes on, logs still get it

    def log_path(self, name: str) -> str | None:
        """The ``--log-dir`` file of process ``name`` (``worker.0@host.log``), None without a log dir."""
        if not self.log_dir:
            return None
        return os.path.join(self.log_dir, name.replace("/", "_").replace(":", "_") + ".log")

    def _log(self, name: str, text: str) -> None:
        if not self.log_dir:
            return
        log = self._logs.get(name)
        if log is None:
            log = open(self.log_path(name), "a", encoding="utf-8", errors="replace")  # noqa: SIM115
            self._logs[name] = log
        log.write(text + "\n")  # type: ignore[attr-defined]
        log.flush()  # type: ignore[attr-defined]

    def last_lines(self, name: str) -> list[str]:
        """The last lines process ``name`` printed (both streams), oldest first."""
        with self._lock:
            return list(self._last.get(name, ()))

    def note(self, text: str) -> None:
        """A line from pslaunch itself, on stderr (also when quiet, for warnings and errors)."""
        with self._lock:
            try:
                self.err.write(f"pslaunch: {text}\n")
                self.err.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Close the log files."""
        with self._lock:
            for log in self._logs.values():
                log.close()  # type: ignore[attr-defined]
            self._logs.clear()
