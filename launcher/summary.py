"""The table printed when a job ends: one row per process (role, rank, host, pid, exit, duration)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from .backends.base import ProcessHandle
    from .output import Printer

__all__ = ["print_summary"]


def print_summary(handles: "list[ProcessHandle]", stopped: set[int], failure, printer: "Printer") -> None:
    """Print the summary table on pslaunch's stderr (plain text when it is not a terminal)."""
    console = Console(file=printer.err, force_terminal=printer.colour, no_color=not printer.colour, width=120)
    job = handles[0].spec.env.get("PSLAUNCH_JOB_ID", "")
    mode = " (allreduce: no servers)" if handles[0].spec.env.get("DMLC_NUM_SERVER") == "0" else ""
    table = Table(title=f"pslaunch job {job}{mode}", title_justify="left", box=box.SIMPLE_HEAD if printer.colour else box.ASCII)
    for col in ("role", "rank", "host", "pid", "exit", "duration", "note"):
        table.add_column(col, justify="right" if col in ("rank", "pid", "duration") else "left")
    for h in handles:
        status = h.poll()
        exit_text = "running" if status is None else status.describe().replace("exit code ", "")
        note = ""
        if failure is not None and failure.handle is h:
            note = "root cause"
        elif id(h) in stopped:
            note = "stopped by pslaunch"
        elif status is not None and not status.ok:
            note = "failed"
        style = "red" if note in ("root cause", "failed") else None
        table.add_row(
            h.spec.role, str(h.spec.rank), h.spec.host.label, str(h.pid or "-"), exit_text,
            f"{h.duration:.1f}s", note, style=style,
        )
    console.print(table)
