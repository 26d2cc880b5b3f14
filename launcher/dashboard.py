"""The live view of a job on a terminal: a table of every process under the scrolling output.

``render_table`` draws the rows of ``launcher.jobstats`` with rich: role, rank and host, state,
uptime, CPU% and RSS; for workers push and pull MB/s, rounds/s and the share of time spent waiting
for the servers; for servers keys, bytes held, updates/s and pulls waiting for a round; the age of
the last heartbeat. The straggler's row is highlighted and says so, and so is a late heartbeat.

``Dashboard`` keeps that table at the bottom of the terminal while the processes' lines scroll
above it. The printer hands it the lines (``write``) instead of writing them; a drawing thread, at
most ``REDRAWS_PER_SECOND`` times a second, erases the table, writes the lines that came since,
and draws the table again below them, in one write: a chatty job costs one redraw per tick, not one
per line, and its lines are written as they are (their colours intact). A table taller than the
terminal is cut, so the cursor can always climb back to its top.

Thread-safety: every method may be called from any thread; one lock orders the writes.
"""

from __future__ import annotations

import io
import os
import threading
import time
from typing import Callable, TextIO

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .jobstats import Row

__all__ = ["Dashboard", "render_table", "REDRAWS_PER_SECOND"]

#: The most the table is redrawn per second.
REDRAWS_PER_SECOND = 4
_PENDING_LIMIT = 1 << 20  # bytes of lines held for the next redraw before the printer waits
_ROLE_STYLE = {"scheduler": "magenta", "server": "cyan", "worker": "green"}


def _bytes(value: float | None) -> str:
    if value is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return ""


def _rate(row: Row, name: str, scale: float = 1.0, digits: int = 1) -> str:
    value = row.rates.get(name)
    return "" if value is None else f"{value / scale:.{digits}f}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds:.1f}s"


def _uptime(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}"


def render_table(rows: list[Row], title: str, width: int, colour: bool, max_lines: int | None = None) -> str:
    """The table of ``rows`` as text ``width`` columns wide (coloured when ``colour``), at most
    ``max_lines`` lines (rows that do not fit are counted in a last line)."""
    shown = rows
    while True:
        text = _render(shown, title, width, colour, len(rows) - len(shown))
        if max_lines is None or text.count("\n") <= max_lines or len(shown) <= 1:
            return text
        shown = shown[: max(1, len(shown) - (text.count("\n") - max_lines))]


def _render(rows: list[Row], title: str, width: int, colour: bool, hidden: int) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=colour, no_color=not colour, color_system="standard" if colour else None,
                      highlight=False, emoji=False, legacy_windows=False)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, expand=False,
                  caption=f"... and {hidden} more processes" if hidden else None, caption_justify="left")
    columns = [("process", "left"), ("state", "left"), ("up", "right"), ("cpu%", "right"), ("rss", "right"),
               ("push MB/s", "right"), ("pull MB/s", "right"), ("rounds/s", "right"), ("wait", "right"),
               ("keys", "right"), ("held", "right"), ("upd/s", "right"), ("pulls waiting", "right"),
               ("heartbeat", "right"), ("note", "left")]
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
    for row in rows:
        worker, server = row.role == "worker", row.role == "server"
        notes = []
        if row.straggler:
            notes.append("<< straggler")
        if row.late:
            notes.append(f"late heartbeat ({row.heartbeat_age:.1f}s)")
        style = None
        if row.straggler:
            style = "bold reverse"
        elif row.late:
            style = "bold yellow"
        elif row.exited and (row.exit_code or row.signal):
            style = "red"
        counters = row.counters
        table.add_row(
            Text(row.name, style=_ROLE_STYLE.get(row.role, "")),
            row.state,
            _uptime(row.uptime),
            "" if row.cpu_percent is None else f"{row.cpu_percent:.0f}",
            _bytes(row.rss),
            _rate(row, "push_b", 1e6, 2) if worker else "",
            _rate(row, "pull_b", 1e6, 2) if worker else "",
            _rate(row, "rounds") if worker else "",
            "" if not worker or row.wait_share is None else f"{100 * row.wait_share:.0f}%",
            str(int(counters["keys"])) if server and "keys" in counters else "",
            _bytes(counters.get("held_b")) if server else "",
            _rate(row, "updates") if server else "",
            str(int(counters["waiting"])) if server and "waiting" in counters else "",
            _age(row.heartbeat_age),
            " ".join(notes),
            style=style,
        )
    console.print(table)
    return buffer.getvalue()


class Dashboard:
    """The table at the bottom of the terminal ``out`` (see the module docstring).

    ``draw(width, max_lines)`` returns the table's text. ``start`` begins drawing, ``pause`` erases
    the table and stops until ``resume``, ``stop`` erases it for good (the lines held are written).
    """

    def __init__(self, out: TextIO, draw: Callable[[int, int], str]) -> None:
        self.out = out
        self._draw = draw
        self._lock = threading.Condition()
        self._pending: list[str] = []
        self._pending_size = 0
        self._height = 0  # lines of the table on the screen now
        self._drawing = False
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start drawing (a daemon thread)."""
        with self._lock:
            self._drawing = True
        self._thread = threading.Thread(target=self._loop, name="pslaunch-dashboard", daemon=True)
        self._thread.start()

    def write(self, stream: str, text: str) -> None:  # noqa: ARG002 - both streams go to the one terminal
        """Print ``text`` above the table at the next redraw; waits while too much is held."""
        with self._lock:
            while self._drawing and self._pending_size > _PENDING_LIMIT:
                self._lock.wait(1.0)
            self._pending.append(text)
            self._pending_size += len(text)
            if not self._drawing:
                self._redraw(table=False)

    def flush(self) -> None:
        """Write the lines held now (and the table)."""
        with self._lock:
            self._redraw(table=self._drawing)

    def pause(self) -> None:
        """Erase the table and write the lines held (pslaunch is about to stop on Ctrl-Z)."""
        with self._lock:
            self._drawing = False
            self._redraw(table=False)

    def resume(self) -> None:
        """Draw again after ``pause``."""
        with self._lock:
            if not self._stopped:
                self._drawing = True
                self._redraw(table=True)

    def stop(self) -> None:
        """Erase the table for good and write the lines held."""
        with self._lock:
            self._stopped = True
            self._drawing = False
            self._redraw(table=False)
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def _loop(self) -> None:
        interval = 1.0 / REDRAWS_PER_SECOND
        while True:
            time.sleep(interval)
            with self._lock:
                if self._stopped:
                    return
                if self._drawing:
                    self._redraw(table=True)

    def _size(self) -> tuple[int, int]:
        try:
            size = os.get_terminal_size(self.out.fileno())
            return max(20, size.columns), max(4, size.lines)
        except (OSError, ValueError, AttributeError):
            return 120, 40

    def _redraw(self, table: bool) -> None:
        """Erase the table, write the held lines, draw the table (when ``table``); one write. Lock held."""
        parts = []
        if self._height:  # to the table's first line, then clear to the end of the screen
            parts.append(f"\r\x1b[{self._height}F\x1b[J")
        parts += self._pending
        self._pending.clear()
        self._pending_size = 0
        self._height = 0
        if table:
            columns, lines = self._size()
            try:
                text = self._draw(columns - 1, lines - 2)
            except Exception as exc:  # a drawing bug must not stop the job's output
                text = f"(the dashboard cannot be drawn: {type(exc).__name__}: {exc})\n"
            parts.append(text)
            self._height = text.count("\n")
        self._lock.notify_all()
        if not parts:
            return
        try:
            self.out.write("".join(parts))
            self.out.flush()
        except (OSError, ValueError):
            pass  # the terminal went away; the job goes on
