"""Where each worker was when its script last set its resume scalars: the marks in its push streams.

Under ``PSLAUNCH_RESTART_SCOPE=worker`` a ``dist_sync`` worker that dies is replaced in place: the new
process takes its rank and redoes the steps since its predecessor's last *mark*. A script marks its
place by setting the scalars of ``kvcore.elastic.State`` (``state.step = s + 1`` after a step's pulls);
the worker then sends every server, with its next push, a ``MARK``: an id counting up, the scalars
(JSON), how many barriers of each group it had entered, the numbers of the barriers its set-up calls
had (``set_optimizer``, which a Trainer makes at its first step, after the scalars are restored: a
replacement redoes such a call by that number, not the next) and, for each key part of that server,
how many pushes of it the worker had issued. No answer is awaited, so a mark costs no round trip.

A server keeps each worker's newest ``KEPT`` marks. A replacement asks every server for its
predecessor's (``MARKS``), takes the newest one that every server holds and received every counted
push of, restores its scalars and counts its pushes on from its counts: the servers drop the pushes
it redoes that they took already and answer its pulls with the values its predecessor saw. For
that the store keeps each value back to the *floor*: the count of the oldest kept mark of any
worker still in the job (``floor``). Without marks nothing is kept.

Everything here comes from the network: sizes are bounded and the fields checked (``read_mark``).
"""

from __future__ import annotations

import json
from typing import Callable, Iterable

import numpy as np

from psnode.errors import ProtocolError
from psnode.node.protocol import MARK_COUNT, MAX_MARK_SCALARS

__all__ = ["Mark", "Marks", "KEPT", "read_mark", "marks_reply"]

#: Marks kept per worker: the newest, and the one before it in case the newest did not reach every server.
KEPT = 2
#: Set-up barriers a mark may name (``set_optimizer`` and ``set_gradient_compression`` calls).
MAX_SETUP_BARRIERS = 64


class Mark:
    """One mark of one worker: ``id``, ``scalars`` (JSON text) and its push counts, by key id."""

    __slots__ = ("id", "scalars", "barriers", "setup", "keys", "seqs")

    def __init__(self, mark_id: int, scalars: str, counts: np.ndarray, barriers: dict[str, int] | None = None,
                 setup: dict[str, int] | None = None) -> None:
        order = np.argsort(counts["key"], kind="stable")
        self.id = mark_id
        self.scalars = scalars
        self.barriers = barriers or {}  # barrier group (as text) -> barriers of it the worker had entered
        self.setup = setup or {}  # a set-up call's barrier ("set_optimizer#0:0") -> the number it had
        self.keys = counts["key"][order]
        self.seqs = counts["seq"][order]

    def count(self, key_id: int) -> int:
        """Pushes of key part ``key_id`` issued before this mark (0 when it names none)."""
        i = int(np.searchsorted(self.keys, key_id))
        return int(self.seqs[i]) if i < len(self.keys) and int(self.keys[i]) == key_id else 0


class Marks:
    """Every worker's newest marks on this server (see the module docstring). Single-threaded."""

    def __init__(self) -> None:
        self._kept: dict[int, list[Mark]] = {}  # worker -> its marks, oldest first

    def add(self, worker: int, mark: Mark) -> None:
        """Keep ``mark`` as ``worker``'s newest; a mark of the same or a higher id is one a replaced
        predecessor sent, which the replacement's marks supersede."""
        kept = [m for m in self._kept.get(worker, []) if m.id < mark.id]
        kept.append(mark)
        self._kept[worker] = kept[-KEPT:]

    def workers(self) -> list[int]:
        """The workers with kept marks."""
        return list(self._kept)

    def of(self, worker: int) -> list[Mark]:
        """``worker``'s kept marks, oldest first."""
        return list(self._kept.get(worker, []))

    def forget(self, worker: int) -> None:
        """``worker`` finished: its marks no longer hold values back."""
        self._kept.pop(worker, None)

    def floor(self, key_id: int, workers: Iterable[int]) -> int | None:
        """The oldest value of key part ``key_id`` a replacement of any of ``workers`` may pull: the
        count of each one's oldest kept mark (0 for one with none yet); None while no worker marked."""
        if not self._kept:
            return None
        floor: int | None = None
        for worker in workers:
            kept = self._kept.get(worker)
            count = kept[0].count(key_id) if kept else 0
            if floor is None or count < floor:
                floor = count
                if floor == 0:
                    break
        return floor


def read_mark(frames: list, max_parts: int) -> Mark:
    """The ``Mark`` of a ``MARK`` message's body frames: ``[JSON {"id", "scalars"}, counts]``.

    Raises:
        ProtocolError: a frame missing, malformed or too big (the message says which).
    """
    if len(frames) != 2:
        raise ProtocolError(f"a MARK of {len(frames) + 1} frames, expected 3 (header, JSON, counts)")
    body = bytes(frames[0].buffer)
    if len(body) > MAX_MARK_SCALARS + 256:
        raise ProtocolError(f"a MARK's JSON of {len(body)} bytes, more than {MAX_MARK_SCALARS + 256}")
    try:
        head = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"a MARK's JSON does not parse: {exc}") from None
    mark_id, scalars = (head.get("id"), head.get("scalars")) if isinstance(head, dict) else (None, None)
    if not isinstance(mark_id, int) or isinstance(mark_id, bool) or not 0 < mark_id < 1 << 62:
        raise ProtocolError(f"a MARK's id {mark_id!r} is not a positive integer")
    if not isinstance(scalars, dict):
        raise ProtocolError(f"a MARK's scalars are a {type(scalars).__name__}, not an object")
    barriers = head.get("barriers", {})
    if (not isinstance(barriers, dict) or len(barriers) > 3
            or not all(k in ("1", "2", "3") and type(v) is int and 0 <= v < 1 << 62 for k, v in barriers.items())):
        raise ProtocolError(f"a MARK's barrier counts {str(barriers)[:80]} are not a count per group (1, 2, 3)")
    setup = head.get("setup", {})
    if (not isinstance(setup, dict) or len(setup) > MAX_SETUP_BARRIERS
            or not all(isinstance(k, str) and len(k) <= 80 and type(v) is int and 0 < v < 1 << 62
                       for k, v in setup.items())):
        raise ProtocolError(f"a MARK's set-up barriers {str(setup)[:80]} are not at most {MAX_SETUP_BARRIERS} "
                            "names with their numbers")
    raw = frames[1].buffer
    if len(raw) % MARK_COUNT.itemsize or len(raw) // MARK_COUNT.itemsize > max_parts:
        raise ProtocolError(f"a MARK's counts of {len(raw)} bytes are not at most {max_parts} records of "
                            f"{MARK_COUNT.itemsize} bytes (the key parts this server holds)")
    counts = np.frombuffer(raw, MARK_COUNT).copy()
    if len(counts) and int(counts["seq"].max()) >= 1 << 62:
        raise ProtocolError("a MARK counts more than 2**62 pushes of a key part")
    return Mark(mark_id, json.dumps(scalars), counts, barriers, setup)


def marks_reply(marks: list[Mark], received: Callable[[int], int],
                versioned: Callable[[int], bool]) -> tuple[list[dict], list[bytes]]:
    """A ``MARKS_REPLY``'s JSON list and count frames for ``marks``: each mark's counts of versioned
    key parts only (a ``dist_async`` part's count starts again at zero: nothing of it is redone), and
    whether it is *complete*: ``received(key_id)``, the pushes this server took of each, reaches its
    count."""
    listed, frames = [], []
    for mark in marks:
        keep = np.fromiter((versioned(int(k)) for k in mark.keys), bool, len(mark.keys))
        keys, seqs = mark.keys[keep], mark.seqs[keep]
        complete = all(received(int(k)) >= int(s) for k, s in zip(keys, seqs))
        listed.append({"id": mark.id, "scalars": json.loads(mark.scalars), "barriers": mark.barriers, "setup": mark.setup,
                       "complete": complete})
        out = np.empty(len(keys), MARK_COUNT)
        out["key"], out["seq"] = keys, seqs
        frames.append(out.tobytes())
    return listed, frames
