"""The scheduler's ledger: append-only logs that worker 0 writes and every worker reads.

A log is a sequence of opaque entries (bytes) under a name. Worker 0 appends (``Cmd.LEDGER_APPEND``;
the answer, ``LEDGER_ACK``, carries the entry's index); any worker reads from an index on
(``Cmd.LEDGER_READ``) and is answered with the entries from there (``LEDGER_ENTRIES``), at once when
there are some, else once one is appended, or with ``end`` once worker 0 has finished (nothing more
will come). It is how worker 0 tells every worker, however many and whenever they ask, where it
placed each key (``kvcore.stores.placement``): a record per batch of keys, so no single message grows with
the model, and a worker restarted alone reads the same records as the others did.

Every field comes from the network, so everything is bounded and checked: names are strings of at
most ``MAX_NAME`` characters, at most ``MAX_LOGS`` logs, an entry at most ``MAX_ENTRY`` bytes, all
entries together at most ``MAX_TOTAL`` bytes, a reply at most ``REPLY_BUDGET`` bytes of entries (at
least one entry), and at most ``MAX_WAITERS`` reads parked per log. A refusal is a sentence the
asking node raises. Who may append is the scheduler's check (worker 0 only). Single-threaded (the
scheduler's thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from psnode.errors import ProtocolError

__all__ = ["Ledger", "Answer", "MAX_NAME", "MAX_LOGS", "MAX_ENTRY", "MAX_TOTAL", "REPLY_BUDGET", "MAX_WAITERS"]

MAX_NAME = 100
MAX_LOGS = 64
MAX_ENTRY = 8 << 20
MAX_TOTAL = 512 << 20
REPLY_BUDGET = 16 << 20
MAX_WAITERS = 4096


@dataclass
class Answer:
    """A read to answer: who asked (``node``, ``req_id``), from which index, the entries, and
    whether the log has ended (its writer finished)."""

    node: bytes
    req_id: int
    start: int
    entries: list[bytes]
    end: bool


@dataclass
class _Log:
    entries: list[bytes] = field(default_factory=list)
    waiting: list[tuple[bytes, int, int]] = field(default_factory=list)  # (node, req_id, start)


def _name(body: Any) -> str:
    name = body.get("log") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"a ledger request whose 'log' is a {type(name).__name__}, not a non-empty string")
    if len(name) > MAX_NAME:
        raise ProtocolError(f"a ledger log name of {len(name)} characters (at most {MAX_NAME})")
    return name


class Ledger:
    """The logs of one job and the reads parked on them (see the module docstring)."""

    def __init__(self) -> None:
        self.logs: dict[str, _Log] = {}
        self.total = 0  # bytes of every entry held
        self.ended = False  # the writer finished: reads past the end are answered with ``end``

    def _log(self, name: str) -> _Log:
        log = self.logs.get(name)
        if log is None:
            if len(self.logs) >= MAX_LOGS:
                raise ProtocolError(f"ledger log {name!r} is one too many: a job holds at most {MAX_LOGS}")
            log = self.logs[name] = _Log()
        return log

    def append(self, body: Any, data: bytes) -> tuple[int, list[Answer]]:
        """Append ``data`` to the log ``body`` names; return its index and the parked reads it answers.

        Raises:
            ProtocolError: a malformed body, an entry too big, the ledger full, or too many logs.
        """
        name = _name(body)
        if len(data) > MAX_ENTRY:
            raise ProtocolError(f"a ledger entry of {len(data)} bytes for log {name!r} (at most {MAX_ENTRY})")
        if self.total + len(data) > MAX_TOTAL:
            raise ProtocolError(f"the ledger is full: {self.total} bytes held, and an entry of {len(data)} for log "
                                f"{name!r} would pass {MAX_TOTAL}")
        log = self._log(name)
        log.entries.append(bytes(data))
        self.total += len(data)
        waiting, log.waiting = log.waiting, []
        answers = [self._answer(log, node, req_id, start) for node, req_id, start in waiting]
        return len(log.entries) - 1, answers

    def read(self, node: bytes, req_id: int, body: Any, start: int) -> Answer | None:
        """The entries of the log ``body`` names from index ``start`` on; None when there are none
        yet and ``body["wait"]`` is true (the read is parked until an append or the end).

        Raises:
            ProtocolError: a malformed body, a negative start, too many logs or parked reads.
        """
        name = _name(body)
        wait = body.get("wait", False)
        if not isinstance(wait, bool):
            raise ProtocolError(f"a ledger read whose 'wait' is a {type(wait).__name__}, not a boolean")
        if start < 0:
            raise ProtocolError(f"a ledger read of log {name!r} from index {start}")
        log = self._log(name)
        if start < len(log.entries) or not wait or self.ended:
            return self._answer(log, node, req_id, start)
        if len(log.waiting) >= MAX_WAITERS:
            raise ProtocolError(f"too many reads wait on ledger log {name!r} (at most {MAX_WAITERS})")
        log.waiting.append((node, req_id, start))
        return None

    def end(self) -> list[Answer]:
        """The writer finished: answer every parked read with ``end`` (nothing more will come)."""
        self.ended = True
        answers = []
        for log in self.logs.values():
            waiting, log.waiting = log.waiting, []
            answers.extend(self._answer(log, node, req_id, start) for node, req_id, start in waiting)
        return answers

    def _answer(self, log: _Log, node: bytes, req_id: int, start: int) -> Answer:
        entries, size = [], 0
        for entry in log.entries[start:]:
            if entries and size + len(entry) > REPLY_BUDGET:
                break
            entries.append(entry)
            size += len(entry)
        return Answer(node, req_id, start, entries, self.ended and start + len(entries) >= len(log.entries))
