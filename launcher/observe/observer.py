"""Seeing the job while it runs: the dashboard, ``--metrics-port``, ``--timeline`` and ``--summary-json``.

``JobObserver.start`` builds what the configuration asks for (and nothing when it asks for nothing)
before any process starts, so a port or file that cannot be used fails the launch at once. It
takes the marker lines the runtime writes for pslaunch (``on_control``, called by the backends'
reader threads through the printer): ``STATS`` lines of the scheduler go to ``launcher.observe.jobstats``,
``TRACE`` lines of any node to the ``--timeline`` file. The supervisor tells it when the processes
are started (``attach``), when the job is stopped by Ctrl-Z and continued (``pause``/``resume``) and
when it is over (``finish``, which takes the dashboard off the screen and writes the summary JSON).

Thread-safety: ``on_control`` runs on reader threads; the rest on the supervisor's thread.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Sequence

from ..config import LaunchConfig
from ..errors import ConfigError, LaunchError
from ..planning.plan import Plan
from .jobstats import JobStats, Row
from .output import Printer
from .watched import AttemptRecord, JobEnd, ReplacementRecord, WatchedProcess

__all__ = ["JobObserver", "summary_document"]


class JobObserver:
    """What pslaunch shows and writes of a running job (see the module docstring)."""

    def __init__(self, config: LaunchConfig, plan: Plan, printer: Printer) -> None:
        self.config = config
        self.plan = plan
        self.printer = printer
        self.stats = JobStats()
        self.handles: list[WatchedProcess] = []
        self.dashboard = None
        self.metrics = None
        self.trace = None
        self.started = time.monotonic()
        # the workers replaced in place so far (``launcher.supervision.replacements``): the supervisor plugs it in
        self.replacements: Callable[[], Sequence[ReplacementRecord]] = tuple

    @classmethod
    def start(cls, config: LaunchConfig, plan: Plan, printer: Printer) -> "JobObserver | None":
        """The observer ``config`` asks for, listening and drawing, or None when nothing is asked.

        Raises ``ConfigError`` when the metrics port or the timeline file cannot be used.
        """
        if not (config.wants_stats or config.timeline):
            return None
        if config.summary_json:
            folder = os.path.dirname(os.path.abspath(config.summary_json))
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise ConfigError(f"--summary-json {config.summary_json}: cannot write in {folder}")
        observer = cls(config, plan, printer)
        try:
            if config.timeline:
                from .timeline import TraceFile

                observer.trace = TraceFile(config.timeline, plan.job_id)
            if config.metrics_port is not None:
                from .metrics import MetricsServer

                observer.metrics = MetricsServer(config.metrics_address, config.metrics_port, observer.metrics_text)
                if config.verbose:
                    printer.note(f"metrics at http://{config.metrics_address}:{observer.metrics.port}/metrics")
            if config.dashboard:
                from .dashboard import Dashboard

                observer.dashboard = Dashboard(printer.out, observer.draw)
                printer.divert(observer.dashboard)
                observer.dashboard.start()
        except BaseException:
            observer.close()
            raise
        printer.observer = observer.on_control
        return observer

    # ---- input --------------------------------------------------------------------------------
    def attach(self, handles: "list[WatchedProcess]") -> None:
        """The job's processes, started (the rows follow their order)."""
        self.handles = list(handles)

    def on_control(self, handle: WatchedProcess, text: str) -> bool:
        """Take a marker line of ``handle`` (``text`` follows the marker); False when it is not one
        of the observer's (``STATS``, ``TRACE``)."""
        verb, _, rest = text.partition(" ")
        if verb == "STATS":
            if handle.spec.role == "scheduler":  # only the scheduler speaks for the job
                self.stats.take_line(handle, rest, self.handles)
            return True
        if verb == "TRACE":
            if self.trace is not None:
                self.trace.take_line(rest)
            return True
        return False

    # ---- output -------------------------------------------------------------------------------
    def rows(self) -> list[Row]:
        """One row per process of the job (the plan's processes until they are started)."""
        return self.stats.rows(self.handles)

    def title(self, rows: list[Row]) -> str:
        """The line above the dashboard's table: the job, its size, and the straggler."""
        from .dashboard import clock

        workers = sum(1 for r in rows if r.role == "worker")
        servers = sum(1 for r in rows if r.role == "server")
        replicas = sum(1 for r in rows if r.role == "replica")
        held = f" ({replicas} replica(s))" if replicas else ""
        text = (f"pslaunch job {self.plan.job_id}: {servers} server(s){held}, {workers} worker(s), "
                f"{clock(time.monotonic() - self.started)}")
        lagging = next((r for r in rows if r.straggler), None)
        if lagging is not None and lagging.wait_share is not None:
            others = [r.wait_share for r in rows if r.role == "worker" and r is not lagging and r.wait_share is not None]
            text += (f"; straggler: {lagging.name} (waits {100 * lagging.wait_share:.0f}% of the time, the other "
                     f"workers {100 * sum(others) / max(1, len(others)):.0f}%)")
        late = [r.name for r in rows if r.late]
        if late:
            text += f"; late heartbeat: {', '.join(late)}"
        replaced = self.replacements()
        if replaced:
            text += "; " + replaced_text(replaced, clock)
        # the newest stall a server or the scheduler reported (PSLAUNCH_STALL_WARN), while it is recent
        stalls = [(at, said) for h in self.handles for at, said, _ in h.stalls if time.monotonic() - at < _STALL_SHOWN]
        if stalls:
            at, said = max(stalls, key=lambda item: item[0])
            node, _, what = said.partition(": stalled: ")
            text += f"; STALLED at {clock(at - self.started)}: {what} ({node})"
        return text

    def draw(self, width: int, max_lines: int) -> str:
        """The dashboard's table, ``width`` columns wide and at most ``max_lines`` lines."""
        from .dashboard import render_table

        rows = self.rows()
        return render_table(rows, self.title(rows), width, True, max_lines)

    def metrics_text(self) -> str:
        """What ``--metrics-port`` serves now."""
        from .metrics import render_metrics

        return render_metrics(self.rows(), self.plan.job_id)

    def pause(self) -> None:
        """Ctrl-Z: the dashboard leaves the screen (the shell's prompt comes next)."""
        if self.dashboard is not None:
            self.dashboard.pause()

    def resume(self) -> None:
        """The job continues: the dashboard comes back."""
        if self.dashboard is not None:
            self.dashboard.resume()

    def finish(self, notes: dict[int, str], failure: "JobEnd | None", exit_code: int,
               attempts: "Sequence[AttemptRecord]" = (), replacements: "Sequence[ReplacementRecord]" = ()) -> None:
        """The job is over (every reader thread finished): take the dashboard off the screen, end the
        timeline, write the summary JSON (with ``attempts``: each failure a restart followed, and the
        end, ``launcher.supervision.restarts``; ``replacements``: each worker replaced in place).
        Problems are printed as notes; none of them fails the job."""
        if self.dashboard is not None:
            self.printer.flush()
            self.printer.divert(None)
            self.dashboard.stop()
            self.dashboard = None
        if self.trace is not None:
            problem = self.trace.close()
            if problem:
                self.printer.note(problem)
        if self.config.summary_json:
            document = summary_document(self.plan.job_id, self.rows(), notes, failure, exit_code,
                                        time.monotonic() - self.started, self.printer, attempts, replacements)
            # the rounds and barriers said stalled (PSLAUNCH_STALL_WARN), by when pslaunch read them
            document["stalls"] = [{"process": h.spec.name, "at_s": round(at - self.started, 3), "text": text}
                                  for at, h, text in sorted(((at, h, text) for h in self.handles for at, text, _ in h.stalls),
                                                            key=lambda item: item[0])]
            problem = _write_json(self.config.summary_json, document)
            if problem:
                self.printer.note(problem)
        if self.stats.rejected and self.config.verbose:
            self.printer.note(f"{self.stats.rejected} stats line(s) of the scheduler could not be read: "
                              f"{self.stats.last_error}")

    def launch_failed(self, error: LaunchError) -> None:
        """The job could not start (pre-flight, rsync, spawn): the summary JSON says so."""
        if self.config.summary_json:
            document = summary_document(self.plan.job_id, [], {}, None, error.exit_code, time.monotonic() - self.started)
            document.update(ok=False, root_cause={"reason": str(error), "process": None, "last_lines": []})
            problem = _write_json(self.config.summary_json, document)
            if problem:
                self.printer.note(problem)

    def close(self) -> None:
        """Release everything (idempotent; ``finish`` first for the outputs)."""
        self.printer.observer = None
        if self.dashboard is not None:
            self.printer.divert(None)
            self.dashboard.stop()
            self.dashboard = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.trace is not None:
            self.trace.close()
            self.trace = None


def summary_document(job_id: str, rows: list[Row], notes: dict[int, str], failure: "JobEnd | None", exit_code: int,
                     duration: float, printer: Printer | None = None,
                     attempts: "Sequence[AttemptRecord]" = (),
                     replacements: "Sequence[ReplacementRecord]" = ()) -> dict[str, Any]:
    """The ``--summary-json`` document: the job's outcome and one entry per process (its exit,
    duration, bytes and counters, the summary table's note; the last lines of the root cause), with
    ``--max-restarts`` one entry per attempt (``launcher.supervision.restarts``) and one per worker
    replaced in place (``launcher.supervision.replacements``)."""
    processes = []
    by_name = {}
    for row in rows:
        entry: dict[str, Any] = {
            "name": row.name, "role": row.role, "rank": row.rank, "host": row.host, "pid": row.pid,
            "state": row.state, "exit_code": row.exit_code, "signal": row.signal,
            "duration_s": round(row.uptime, 3), "note": "",
        }
        counters = row.counters
        if row.role == "worker":
            entry.update(pushed_bytes=counters.get("push_b"), pulled_bytes=counters.get("pull_b"),
                         rounds=counters.get("rounds"), wait_s=counters.get("wait_s"))
        elif row.role in ("server", "replica"):
            entry.update(received_bytes=counters.get("push_b"), updates=counters.get("updates"),
                         keys=counters.get("keys"), held_bytes=counters.get("held_b"), kept_bytes=counters.get("kept_b"))
        if "cpu" in counters:
            entry["cpu_s"] = counters["cpu"]
        if "rss" in counters:
            entry["rss_bytes"] = counters["rss"]
        processes.append(entry)
        by_name[row.name] = entry
    for name, note in notes.items():
        if name in by_name:
            by_name[name]["note"] = note
    root = None
    if failure is not None:
        root = {"reason": failure.final_reason, "process": None, "last_lines": []}
        if failure.handle is not None:
            name = failure.handle.spec.name
            root["process"] = name
            root["last_lines"] = list(failure.quoted) or (printer.last_lines(name) if printer is not None else [])
    return {"version": 1, "job_id": job_id, "exit_code": exit_code, "ok": failure is None,
            "duration_s": round(duration, 3), "root_cause": root, "processes": processes,
            "attempts": [{"reason": a.reason, "exit_code": a.exit_code, "action": a.action} for a in attempts],
            "replacements": [r.as_dict() for r in replacements]}


#: Seconds the live table's title shows a stall after it was reported.
_STALL_SHOWN = 30.0


def replaced_text(replaced: "Sequence[ReplacementRecord]", clock: Callable[[float], str]) -> str:
    """The live table's words on the workers replaced in place: how many, and the newest: who, when,
    and whether it is still redoing its predecessor's steps or how long the others waited for it."""
    last = replaced[-1]
    name = last.process.split("@", 1)[0]
    if last.waited_s is not None:
        state = f"the others waited {last.waited_s:.1f} s"
    elif last.resumed_s is not None:
        state = "redoing its steps"
    else:
        state = "starting"
    count = f"{len(replaced)} replaced, last " if len(replaced) > 1 else "replaced: "
    return f"{count}{name} at {clock(last.ended_s)} ({state})"


def _write_json(path: str, document: dict) -> str | None:
    """Write ``document`` to ``path`` whole (a temporary file renamed over it); the problem, or None."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(document, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return f"--summary-json {path}: cannot write it: {exc.strerror or exc}"
    return None
