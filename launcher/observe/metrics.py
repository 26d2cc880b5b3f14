"""``--metrics-port``: the job's counters as Prometheus text, served by pslaunch while the job runs.

``render_metrics`` writes the rows of ``launcher.observe.jobstats`` in Prometheus' text format (version
0.0.4): one sample per process and metric, labelled ``job``, ``process``, ``role``, ``rank`` and
``host``. Counters are totals (Prometheus' ``rate()`` makes them rates); docs/observability.md lists
the names. ``MetricsServer`` answers ``GET /metrics`` on a thread of its own, on 127.0.0.1 unless an
address is given: the counters are no secret, but nothing outside this machine needs them unless
the user says so.
"""

from __future__ import annotations

import http.server
import threading
from typing import Callable

from ..errors import ConfigError
from .jobstats import Row

__all__ = ["MetricsServer", "render_metrics", "METRICS"]

# name, type, help, how to read it from a row (None: no sample for that row)
METRICS: list[tuple[str, str, str, Callable[[Row], float | None]]] = [
    ("pslaunch_up", "gauge", "1 while the process runs, 0 once it ended.", lambda r: 0.0 if r.exited else 1.0),
    ("pslaunch_exit_code", "gauge", "How the process ended: its exit code, or 128 + the signal.",
     lambda r: None if not r.exited else float(128 + r.signal if r.signal is not None else r.exit_code or 0)),
    ("pslaunch_uptime_seconds", "gauge", "Seconds since pslaunch started the process (until it ended).",
     lambda r: r.uptime),
    ("pslaunch_cpu_seconds_total", "counter", "CPU time (user + system) of the runtime node's process.",
     lambda r: r.counters.get("cpu")),
    ("pslaunch_resident_memory_bytes", "gauge", "Resident memory of the runtime node's process.",
     lambda r: None if r.rss is None else float(r.rss)),
    ("pslaunch_heartbeat_age_seconds", "gauge", "Seconds since the scheduler last heard the node.",
     lambda r: r.heartbeat_age),
    ("pslaunch_heartbeat_late", "gauge", "1 when the node's heartbeat is late.",
     lambda r: None if r.heartbeat_age is None else float(r.late)),
    ("pslaunch_worker_pushed_bytes_total", "counter", "Bytes a worker pushed.", lambda r: r.counters.get("push_b")
     if r.role == "worker" else None),
    ("pslaunch_worker_pulled_bytes_total", "counter", "Bytes a worker pulled.", lambda r: r.counters.get("pull_b")),
    ("pslaunch_worker_rounds_total", "counter", "Rounds of a worker: the pushes of its most pushed key.",
     lambda r: r.counters.get("rounds")),
    ("pslaunch_worker_wait_seconds_total", "counter", "Seconds a worker's callers were blocked waiting for replies.",
     lambda r: r.counters.get("wait_s")),
    ("pslaunch_worker_queued_messages", "gauge", "Messages a worker has queued to send.",
     lambda r: r.counters.get("queued")),
    ("pslaunch_worker_straggler", "gauge", "1 for the worker the others wait for (the straggler), else 0.",
     lambda r: float(r.straggler) if r.role == "worker" and not r.exited else None),
    ("pslaunch_server_keys", "gauge", "Key parts a server holds.", lambda r: r.counters.get("keys")),
    ("pslaunch_server_held_bytes", "gauge", "Bytes of values a server holds.", lambda r: r.counters.get("held_b")),
    ("pslaunch_server_kept_bytes", "gauge", "Bytes of earlier values a server keeps for replacements in place.",
     lambda r: r.counters.get("kept_b")),
    ("pslaunch_server_received_bytes_total", "counter", "Bytes of pushes a server received.",
     lambda r: r.counters.get("push_b") if r.role in ("server", "replica") else None),
    ("pslaunch_server_updates_total", "counter", "Key updates (rounds applied) of a server.",
     lambda r: r.counters.get("updates")),
    ("pslaunch_server_stalled_rounds", "gauge", "dist_sync rounds of a server stalled now (waiting past --stall-warn "
     "or --stall-timeout for a push).", lambda r: r.counters.get("stalled")),
    ("pslaunch_server_waiting_pulls", "gauge", "Pulls a server holds until a round closes.",
     lambda r: r.counters.get("waiting")),
]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(rows: list[Row], job_id: str) -> str:
    """The Prometheus text of ``rows`` (see the module docstring)."""
    lines = []
    job = _label(job_id)
    labels = [f'job="{job}",process="{_label(r.name)}",role="{r.role}",rank="{r.rank}",host="{_label(r.host)}"'
              for r in rows]
    for name, kind, text, read in METRICS:
        samples = []
        for row, label in zip(rows, labels):
            value = read(row)
            if value is not None:
                samples.append(f"{name}{{{label}}} {float(value):g}")
        if samples:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``text()`` at ``http://address:port/metrics`` on a daemon thread until ``close``.

    Raises ``ConfigError`` (exit 2, naming the address) when it cannot listen there.
    """

    def __init__(self, address: str, port: int, text: Callable[[], str]) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
                """Requests are not logged: the job's output is the screen's."""

        try:
            self.server = http.server.ThreadingHTTPServer((address, port), Handler)
        except OSError as exc:
            raise ConfigError(f"--metrics-port: cannot listen on {address}:{port}: {exc.strerror or exc}") from None
        self.server.daemon_threads = True
        self.address, self.port = address, self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="pslaunch-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the socket (waits for the serving thread, a second at most)."""
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(1.0)
