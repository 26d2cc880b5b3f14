"""The table printed when a job ends: one row per process (role, rank, host, pid, exit, duration, note)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from ..backends.base import ProcessHandle

__all__ = ["render_summary"]

_RED = ("root cause", "failed")


def render_summary(handles: "list[ProcessHandle]", notes: dict[int, str], colour: bool) -> str:
    """The summary table as text (coloured when ``colour``); ``notes`` maps handle ids to the last
    column (``root cause``, ``failed``, ``ended: a peer failed``, ``stopped by pslaunch``,
    ``unreachable``, ...)."""
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=colour, no_color=not colour, width=120)
    job = handles[0].spec.env.get("PSLAUNCH_JOB_ID", "")
    mode = " (allreduce: no servers)" if handles[0].spec.env.get("DMLC_NUM_SERVER") == "0" else ""
    table = Table(title=f"pslaunch job {job}{mode}", title_justify="left", box=box.SIMPLE_HEAD if colour else box.ASCII)
    for col in ("role", "rank", "host", "pid", "exit", "duration", "note"):
        table.add_column(col, justify="right" if col in ("rank", "pid", "duration") else "left")
    for h in handles:
        status = h.status
        exit_text = "running" if status is None else status.describe().replace("exit code ", "")
        note = notes.get(id(h), "")
        table.add_row(
            h.spec.role, str(h.spec.rank), h.spec.host.label, str(h.pid or "-"), exit_text,
            f"{h.duration:.1f}s", note, style="red" if note.startswith(_RED) else None,
        )
    console.print(table)
    # rich pads the title to the table's width: no line ends in spaces (a log, a diff, a terminal copy)
    return "".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines())
