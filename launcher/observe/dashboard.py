"""The live view of a job on a terminal: a table of every process under the scrolling output.

``render_table`` draws the rows of ``launcher.observe.jobstats`` as a fixed-width table: process, state,
uptime, CPU% and RSS; for workers push and pull MB/s, rounds/s and the share of time spent waiting
for the servers; for servers keys, bytes held, updates/s and pulls waiting for a round; the age of
the last heartbeat. The straggler's row is highlighted and says so, and so is a late heartbeat. It
fits the terminal: narrower, the gaps shrink, then columns leave, the least useful first
(``_DROP_ORDER``); the process, its state and the note stay, and the title takes two lines.

``Dashboard`` keeps that table at the bottom of the terminal while the processes' lines scroll
above it. The printer hands it the lines (``write``) instead of writing them; a drawing thread, at
most ``REDRAWS_PER_SECOND`` times a second, erases the table, writes the lines that came since,
and draws the table again below them, in one write: a chatty job costs one redraw per tick, not one
per line, and its lines are written as they are (their colours intact). A flood of lines is written
as it comes, the table erased until the next tick, so the table never slows the output. A table
taller than the terminal is cut, so the cursor can always climb back to its top.

Thread-safety: every method may be called from any thread; one lock orders the writes.
"""

from __future__ import annotations

import os
import textwrap
import threading
import time
from typing import Callable, TextIO

from .jobstats import Row
from .terminal import in_foreground

__all__ = ["Dashboard", "render_table", "clock", "REDRAWS_PER_SECOND"]

#: The most the table is redrawn per second.
REDRAWS_PER_SECOND = 4
_PENDING_LIMIT = 256 << 10  # bytes of lines held for the next redraw before they are written at once


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


def clock(seconds: float) -> str:
    """``m:ss``, or ``hHmm`` from an hour on: how the dashboard shows a duration."""
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}"


_COLUMNS = [("process", "<"), ("state", "<"), ("up", ">"), ("cpu%", ">"), ("rss", ">"), ("push MB/s", ">"),
            ("pull MB/s", ">"), ("rounds/s", ">"), ("wait", ">"), ("keys", ">"), ("held", ">"), ("upd/s", ">"),
            ("pulls waiting", ">"), ("heartbeat", ">"), ("note", "<")]
#: The order in which columns leave a table too wide for the terminal: the first one first. The
#: process, its state and the note (the straggler, a late heartbeat) always stay; columns no row has
#: a value in leave before any of these.
_DROP_ORDER = ("pulls waiting", "up", "rss", "held", "upd/s", "keys", "cpu%", "heartbeat", "wait", "rounds/s",
               "pull MB/s", "push MB/s")
_ROLE_CODE = {"scheduler": "35", "server": "36", "replica": "36", "worker": "32"}
_STRAGGLER, _LATE, _FAILED = "1;7", "1;33", "31"  # reverse video, bold yellow, red


def _cells(row: Row) -> list[str]:
    worker, server = row.role == "worker", row.role in ("server", "replica")
    counters = row.counters
    notes = []
    if row.straggler:
        notes.append("<< straggler")
    if row.late:
        notes.append(f"late heartbeat ({row.heartbeat_age:.1f}s)")
    return [
        row.name,
        row.state,
        clock(row.uptime),
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
    ]


def render_table(rows: list[Row], title: str, width: int, colour: bool, max_lines: int | None = None) -> str:
    """The table of ``rows`` as text of lines at most ``width`` columns wide (coloured when
    ``colour``), at most ``max_lines`` lines (rows that do not fit are counted in a last line).

    Formatted here rather than by rich's table layout: it is redrawn four times a second while the
    job runs, and this costs a fraction of a millisecond where rich's layout took tens.
    """
    cells = [_cells(row) for row in rows]
    widths = [max([len(name)] + [len(c[i]) for c in cells]) for i, (name, _) in enumerate(_COLUMNS)]
    kept, gap = _fit(cells, widths, width)

    def line(values: list[str]) -> str:
        text = gap.join(f"{values[i]:{_COLUMNS[i][1]}{widths[i]}}" for i in kept).rstrip()
        return " " + text if len(text) < width else " " + text[: width - 2]

    # a narrow terminal gets the title on two lines rather than without its straggler
    titles = textwrap.wrap(title, max(20, width - 1))[:2] or [""]
    head = [*titles, "", line([name for name, _ in _COLUMNS])]
    head.append(" " + "─" * min(width - 2, len(head[-1]) - 1))
    shown = len(rows)
    if max_lines is not None and len(head) + shown > max_lines:
        shown = max(1, max_lines - len(head) - 1)
    out = head[:]
    for row, values in zip(rows[:shown], cells[:shown]):
        text = line(values)
        if not colour:
            out.append(text)
        elif row.straggler or row.late or (row.exited and (row.exit_code or row.signal)):
            code = _STRAGGLER if row.straggler else _LATE if row.late else _FAILED
            out.append(f"\x1b[{code}m{text}\x1b[0m")
        else:  # the name in its role's colour, as the output's prefixes
            cut = 1 + len(row.name)
            out.append(f"{text[:1]}\x1b[{_ROLE_CODE.get(row.role, '0')}m{text[1:cut]}\x1b[0m{text[cut:]}")
    if shown < len(rows):
        out.append(f" ... and {len(rows) - shown} more processes")
    if colour:
        for i in range(len(titles)):
            out[i] = f"\x1b[1m{out[i]}\x1b[0m"
    return "\n".join(out) + "\n"


def _fit(cells: list[list[str]], widths: list[int], width: int) -> tuple[list[int], str]:
    """The columns that fit in ``width`` (indices, in order) and the gap between them: three spaces
    while every column fits, then two, then columns leave: the empty ones, then ``_DROP_ORDER``."""
    kept = list(range(len(_COLUMNS)))

    def total(gap: int) -> int:
        return 1 + sum(widths[i] for i in kept) + gap * (len(kept) - 1)

    if total(3) < width:
        return kept, "   "
    names = [name for name, _ in _COLUMNS]
    empty = [i for i in kept if not any(c[i] for c in cells) and names[i] in _DROP_ORDER]
    for i in [*empty, *(names.index(name) for name in _DROP_ORDER)]:
        if total(2) < width:
            break
        if i in kept:
            kept.remove(i)
    return kept, "  "


class Dashboard:
    """The table at the bottom of the terminal ``out`` (see the module docstring).

    ``draw(width, max_lines)`` returns the table's text. ``start`` begins drawing, ``pause`` erases
    the table and stops until ``resume``, ``stop`` erases it for good (the lines held are written).
    ``holds_terminal()`` says whether pslaunch is the terminal's foreground job (None: cannot tell);
    it defaults to asking the terminal ``out``.
    """

    def __init__(self, out: TextIO, draw: Callable[[int, int], str],
                 holds_terminal: Callable[[], bool | None] | None = None) -> None:
        self.out = out
        self._draw = draw
        self._holds_terminal = holds_terminal or self._foreground
        self._lock = threading.Lock()
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
        """Print ``text`` above the table at the next redraw. A flood of lines (more than
        ``_PENDING_LIMIT`` bytes held) is written at once, the table erased until the next redraw:
        the table costs the output no throughput."""
        with self._lock:
            self._pending.append(text)
            self._pending_size += len(text)
            if not self._drawing or self._pending_size > _PENDING_LIMIT:
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

    def _foreground(self) -> bool | None:
        try:
            return in_foreground(self.out.fileno())
        except (OSError, ValueError, AttributeError):
            return None

    def _redraw(self, table: bool) -> None:
        """Erase the table, write the held lines, draw the table (when ``table``); one write. Lock held."""
        parts = []
        # Only the foreground job draws and erases: where a shell has the terminal (pslaunch run
        # with `&`, or a script that ran it stopped by Ctrl-Z) the lines below the table are the
        # shell's, and a table drawn there would never be erased. The terminal is asked only when
        # there is a table to erase or draw: lines written while paused cost no system call each.
        holds = bool(self._height or table) and self._holds_terminal() is not False
        if self._height and holds:  # to the table's first line, then clear to the end of the screen
            parts.append(f"\r\x1b[{self._height}F\x1b[J")
        parts += self._pending
        self._pending.clear()
        self._pending_size = 0
        self._height = 0
        if table and holds:
            columns, lines = self._size()
            try:
                text = self._draw(columns - 1, lines - 2)
            except Exception as exc:  # a drawing bug must not stop the job's output
                text = f"(the dashboard cannot be drawn: {type(exc).__name__}: {exc})\n"
            parts.append(text)
            self._height = text.count("\n")
        if not parts:
            return
        try:
            self.out.write("".join(parts))
            self.out.flush()
        except (OSError, ValueError):
            pass  # the terminal went away; the job goes on
