"""A job past ``--stall-timeout``: the worker it waits for, its stack, and the verdict.

A node that holds a wait (a server's round, the scheduler's barrier, a worker's collective) says it
fatal in a ``STALL`` marker once the wait passed ``PSLAUNCH_STALL_TIMEOUT`` (``psnode.node.stalls``).
``StallEnd`` then asks the first worker it waits for for its Python stack (``ProcessHandle.dump_stack``),
collects what that worker prints (``Printer.capture``) until its output has been quiet a moment (at
most ``STACK_WAIT`` seconds), and gives the job's root cause: the stall's line, the worker named
with where its main thread is, that thread's stack quoted, exit code ``EXIT_STALLED``. Owned by the
supervisor's loop (one thread).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Sequence

from .verdict import Failure, who

if TYPE_CHECKING:
    from ..backends.base import ProcessHandle

__all__ = ["StallEnd", "EXIT_STALLED", "main_thread_stack"]

#: pslaunch's exit code when a wait passed ``--stall-timeout`` (docs/launcher.md).
EXIT_STALLED = 86
STACK_WAIT = 3.0  # seconds the stack gets to arrive
_QUIET = 0.3  # seconds without a new line after which the stack is complete
_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):$")
_RUNTIME = ("/psnode/", "/kvcore/", "/pscontract/")  # frames of the bundled runtime: where a user's call waits
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')


def main_thread_stack(lines: Sequence[str]) -> list[str]:
    """The main thread's block of a ``faulthandler`` dump in ``lines`` (its header and frames, the
    innermost call first): the last thread it lists (it lists the newest thread first)."""
    start = None
    for index, line in enumerate(lines):
        if _HEADER.match(line.strip()):
            start = index
    if start is None:
        return []
    block = [lines[start].strip()]
    for line in lines[start + 1:]:
        if not _FRAME.match(line):
            break
        block.append(line.strip())
    return block


def _where(block: Sequence[str]) -> str | None:
    """Where a stack block is, in the user's terms: its innermost frame (``load_batch (train.py:58)``),
    or, when that is the runtime's own (a wait inside ``kv.pull``), the innermost frame of the
    user's code and the runtime's call it is in (``<module> (train.py:21) in allreduce``)."""
    frames = [m for m in map(_FRAME.match, block) if m]
    if not frames:
        return None
    said = [f"{m['func']} ({m['file'].rsplit('/', 1)[-1]}:{m['line']})" for m in frames]
    for index, frame in enumerate(frames):
        if not any(part in frame["file"] for part in _RUNTIME):
            return said[index] + (f" in {frames[index - 1]['func']}" if index else "")
    return said[0]


class StallEnd:
    """The stall that ends the job, once the stack of the worker it waits for is in (see the module
    docstring)."""

    def __init__(self, printer, backend_name: str) -> None:
        self.printer = printer
        self.backend_name = backend_name
        self._culprit: "ProcessHandle | None" = None
        self._asked: float | None = None  # when the stack was asked for (None: not yet)
        self._lines = 0
        self._changed = 0.0
        self._reachable = False

    def verdict(self, handles: Sequence["ProcessHandle"], now: float) -> Failure | None:
        """None while no wait passed the timeout or the stack may still come; then the failure."""
        fatal = min((h.fatal_stall for h in handles if h.fatal_stall is not None), default=None)
        if fatal is None:
            return None
        _, text, ranks = fatal
        if self._asked is None:
            self._asked = self._changed = now
            self._culprit = next((h for h in handles if h.spec.role == "worker" and h.spec.rank in ranks
                                  and h.status is None), None)
            if self._culprit is not None:
                self.printer.capture(self._culprit.spec.name)
                self._reachable = self._culprit.dump_stack()
        culprit = self._culprit
        if culprit is None:
            return Failure(text, EXIT_STALLED)
        lines = self.printer.captured(culprit.spec.name)
        if len(lines) != self._lines:
            self._lines, self._changed = len(lines), now
        stack = main_thread_stack(lines)
        if self._reachable and now - self._asked < STACK_WAIT and (not stack or now - self._changed < _QUIET):
            return None
        where = _where(stack)
        if where is not None:
            return Failure(f"{text}; {who(culprit)} is in {where}", EXIT_STALLED, culprit, quoted=tuple(stack))
        why = ("it wrote no stack in time" if self._reachable
               else f"--launcher {self.backend_name} cannot ask it for its stack")
        return Failure(f"{text}; it waits for {who(culprit)} ({why})", EXIT_STALLED, culprit)
