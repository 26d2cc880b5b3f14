"""The stall inspector's common part: when a wait is stalled, and how a node says so.

Three kinds of node hold waits that can stall: a server (a ``dist_sync`` round of a key waiting for
pushes), the scheduler (a barrier waiting for ranks) and a worker (a collective waiting for its
peers). Each keeps a ``StallClock`` and says what it finds through ``say_stall``, so the two
thresholds mean the same everywhere:

* ``PSLAUNCH_STALL_WARN`` (``--stall-warn``): the wait is said once, in the node's log, naming what
  waits on whom;
* ``PSLAUNCH_STALL_TIMEOUT`` (``--stall-timeout``, 0: never): the wait is said once more, as fatal.
  Under pslaunch the marker carries ``"fatal": true`` and pslaunch ends the job with it as the root
  cause (it asks the missing worker for its stack first); a job started by hand fails at the node
  that found it (``StalledError``), which its peers then hear of as that node's failure.

Each threshold is per wait: a wait's clock starts when it last made progress (the server: its last
push; the scheduler: the barrier's first arrival; a worker: the collective's start).
"""

from __future__ import annotations

import json
from typing import Any, Hashable, Sequence

from psnode.env import MARKER_STALL, NodeEnv
from psnode.errors import PSNodeError
from psnode.log import logger

from .stats import stderr_line

__all__ = ["StallClock", "StalledError", "say_stall"]

WARN, FATAL = "warn", "fatal"


class StalledError(PSNodeError):
    """A wait passed ``PSLAUNCH_STALL_TIMEOUT``: the message says what waited on whom."""


class StallClock:
    """Which threshold each wait (named by any hashable) has passed and was said: quiet, then warned,
    then fatal; each level is said once. Single-threaded (its node's loop or its watcher)."""

    def __init__(self, warn: float, timeout: float) -> None:
        self.warn = warn
        self.timeout = timeout
        self._said: dict[Hashable, str] = {}

    @classmethod
    def of(cls, env: NodeEnv) -> "StallClock":
        """The clock of the job's settings (``PSLAUNCH_STALL_WARN``, ``PSLAUNCH_STALL_TIMEOUT``)."""
        return cls(env.stall_warn, env.stall_timeout)

    @property
    def on(self) -> bool:
        """Whether either threshold is set."""
        return self.warn > 0 or self.timeout > 0

    @property
    def least(self) -> float:
        """The smaller threshold that is set (inf when none is): a wait shorter than this is no stall."""
        return min((t for t in (self.warn, self.timeout) if t > 0), default=float("inf"))

    def due(self, wait: Hashable, waited: float) -> str | None:
        """``FATAL`` or ``WARN`` when ``wait``, stalled for ``waited`` seconds, passed a threshold not
        said yet (now counted as said), else None."""
        said = self._said.get(wait)
        if said == FATAL:
            return None
        if self.timeout > 0 and waited >= self.timeout:
            self._said[wait] = FATAL
            return FATAL
        if said is None and self.warn > 0 and waited >= self.warn:
            self._said[wait] = WARN
            return WARN
        return None

    def setting(self, level: str) -> str:
        """The setting a line of ``level`` quotes: ``PSLAUNCH_STALL_WARN=60``."""
        if level == FATAL:
            return f"PSLAUNCH_STALL_TIMEOUT={self.timeout:g}"
        return f"PSLAUNCH_STALL_WARN={self.warn:g}"

    def forget(self, keep: set) -> None:
        """Drop what was said of waits not in ``keep`` (they ended): the table stays as small as the
        waits open now."""
        self._said = {wait: level for wait, level in self._said.items() if wait in keep}


def say_stall(env: NodeEnv, node: str, text: str, workers: Sequence[int], level: str, timeline: Any = None,
              waited: float = 0.0, what: str = "") -> StalledError | None:
    """Say ``text`` (``stalled: ...``) of node ``node`` (``server 1``) in its log and, under pslaunch, as a
    ``STALL`` marker naming the worker ranks it waits for; with the node's ``timeline``
    (``PSLAUNCH_TIMELINE``), also as a ``stalled`` event over the ``waited`` seconds it covers, named
    by ``what`` waits (``round 4 of key 0``) and for whom (a trace's names are short).
    Returns the error the node must fail with (a fatal stall in a job started by hand), else None."""
    if level == FATAL:
        text += "; the job ends (--stall-timeout)"
    logger.warning("%s: %s", node, text)
    if timeline is not None:
        now = timeline.now()
        missing = ", ".join(str(w) for w in workers)
        label = f"{what} for worker{'s' if len(workers) > 1 else ''} {missing}" if workers else what
        timeline.add("stalled", label, now - int(waited * 1e9), now)
        timeline.flush()
    if env.supervised:  # pslaunch's verdict and summary name what the job waits on
        said = {"node": node, "text": text, "workers": list(workers), "fatal": level == FATAL}
        stderr_line(f"{MARKER_STALL} {json.dumps(said)}")
        return None
    return StalledError(f"{node}: {text}") if level == FATAL else None
