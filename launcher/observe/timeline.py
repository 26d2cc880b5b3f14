"""``--timeline FILE``: the job's Chrome / Perfetto trace, written as the nodes send their events.

pslaunch sets ``PSLAUNCH_TIMELINE=-`` in every process (docs/env.md); each runtime node then writes
its events as ``PSLAUNCH-TRACE [...]`` marker lines on its stderr, which pslaunch reads on every
backend. ``TraceFile.take_line`` checks a line (JSON, an array of event objects, a bounded size; a
bad one is counted and left out) and appends its events to the file at once, so pslaunch holds no
more than a line in memory however long the job runs. The file is a JSON array (Chrome's "JSON
Array Format"): ``[`` and a metadata event naming the job, a line per batch of events, each
starting with a comma, and ``]`` when pslaunch closes it.

Thread-safety: ``take_line`` is called by the reader threads of every process; a lock orders the
writes.
"""

from __future__ import annotations

import json
import threading

from ..errors import ConfigError

__all__ = ["TraceFile", "LINE_LIMIT"]

#: Longest trace line taken (bytes); the runtime writes at most 3800.
LINE_LIMIT = 1 << 20


class TraceFile:
    """The ``--timeline`` file of job ``job_id`` at ``path``, opened (and truncated) now.

    Raises ``ConfigError`` (exit 2, naming the path) when it cannot be written.
    """

    def __init__(self, path: str, job_id: str) -> None:
        self.path = path
        self.events = 0
        self.rejected = 0
        self._lock = threading.Lock()
        try:
            self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise ConfigError(f"--timeline {path}: cannot write it: {exc.strerror or exc}") from None
        title = json.dumps(f"pslaunch job {job_id}")
        self._file.write(f'[{{"name":"process_name","ph":"M","pid":0,"tid":0,"args":{{"name":{title}}}}}\n')

    def take_line(self, text: str) -> bool:
        """Append the events of one marker line (the JSON array after ``TRACE``); False (and counted)
        when it is not an array of event objects."""
        text = text.strip()
        try:
            if len(text) > LINE_LIMIT:
                raise ValueError("too long")
            events = json.loads(text)
            if not isinstance(events, list) or not all(
                    isinstance(e, dict) and isinstance(e.get("ph"), str) and isinstance(e.get("pid"), int)
                    for e in events):
                raise ValueError("not an array of trace events")
        except ValueError:
            with self._lock:
                self.rejected += 1
            return False
        if not events:
            return True
        with self._lock:
            if self._file is None:
                return False
            try:
                self._file.write("," + text[1:-1] + "\n")  # checked above: the array's items, as sent
            except OSError:
                self.rejected += 1
                return False
            self.events += len(events)
        return True

    def close(self) -> str | None:
        """End the JSON array and close the file; returns why the file may be incomplete, or None."""
        with self._lock:
            if self._file is None:
                return None
            try:
                self._file.write("]\n")
                self._file.close()
            except OSError as exc:
                return f"--timeline {self.path}: writing it failed: {exc.strerror or exc}"
            finally:
                self._file = None
        if self.rejected:
            return f"--timeline {self.path}: {self.rejected} line(s) of events could not be read and were left out"
        return None
