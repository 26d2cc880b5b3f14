"""Which server holds each key: placed so that every server carries the same bytes.

A ``dist_sync`` round waits for its busiest server, so the servers' bytes should be equal. A
mixing hash of the key id (``kvcore.sharding``'s default) spreads keys evenly by *count*, not by
bytes: on ResNet-50 with 16 servers the busiest holds 1.48x the mean. ``Placement`` decides instead,
one ``kv.init`` call at a time (the Trainer inits every parameter in one call):

1. keys of ``bigarray_bound`` elements or more are split over every server, as always;
2. the others, largest first, each go whole to the server that carries the fewest bytes so far
   (ties: the lowest rank), greedy "longest processing time first";
3. a key of at least ``SPLIT_MIN_BYTES`` that would lift its server above ``1 + SLACK`` times the
   mean the servers will carry once the call is placed is split over every server instead, as a big
   array is; only in a call of at least as many whole keys as servers, where the fit can be judged.
   (BERT-base on 16 servers: 48 keys of 2.25 MiB fill every server equally; its 1.5 MiB position
   table would tip one over by 5%: it is split.)

The decision is worker 0's: it places the keys of its ``init`` call, initialises them on the servers
with that layout, and hands its decisions to the other workers with the init barrier, so every
worker agrees however its own calls were ordered or which keys it passed. A worker restarted alone
(``--restart-scope worker``) makes its script's init calls again and decides by the same rule from
them. A restore from a checkpoint places the checkpoint's keys as one call (the servers re-shard from
any earlier layout). Decisions are ``(home, split)`` per key, small enough for a barrier note.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable

import numpy as np

from .sharding import KeyLayout, key_id, layout

__all__ = ["Placement", "Decision", "SLACK", "SPLIT_MIN_BYTES"]

#: How far above the mean a whole key may lift its server before it is split instead.
SLACK = 0.02
#: Keys smaller than this stay whole: splitting them would cost a message per server per push for
#: little balance.
SPLIT_MIN_BYTES = 64 << 10


@dataclass(frozen=True)
class Decision:
    """Where one key goes: whole on server ``home``, or split over every server (``split``: its
    first part on ``home``)."""

    home: int
    split: bool

    def as_note(self) -> list:
        return [self.home, self.split]

    @classmethod
    def from_note(cls, value: object, num_servers: int) -> "Decision | None":
        """The decision a barrier note carries, or None when it is malformed."""
        if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], int) and not isinstance(value[0], bool)
                and 0 <= value[0] < num_servers and isinstance(value[1], bool)):
            return cls(value[0], value[1])
        return None


@dataclass(frozen=True)
class KeyRequest:
    """A key to place: its shape, dtype and compression word (``kvcore.sharding.layout``)."""

    key: Hashable
    shape: tuple[int, ...]
    dtype: np.dtype
    word: int = 1

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class Placement:
    """The bytes each server carries, and the decision for every key placed or learnt. Not
    thread-safe (the store calls it from ``init`` and ``restore``, which are collective)."""

    def __init__(self, num_servers: int, bigarray_bound: int) -> None:
        self.num_servers = num_servers
        self.bigarray_bound = bigarray_bound
        self.load = [0] * num_servers
        self.decisions: dict[Hashable, Decision] = {}

    def layout(self, request: KeyRequest) -> KeyLayout:
        """The layout of a key by its decision (by the hash rule when there is none yet)."""
        decision = self.decisions.get(request.key)
        home, split = (None, None) if decision is None else (decision.home, decision.split)
        return layout(request.key, tuple(request.shape), request.dtype, self.num_servers, self.bigarray_bound,
                      request.word, home, split)

    def place(self, requests: Iterable[KeyRequest]) -> dict[Hashable, Decision]:
        """Decide every key of one init call that has no decision yet (see the module docstring);
        returns the decisions of all of ``requests``' keys."""
        requests = list(requests)
        fresh = [r for r in requests if r.key not in self.decisions]
        big = [r for r in fresh if r.size >= self.bigarray_bound and r.size > 0]
        whole = sorted((r for r in fresh if not r.size >= self.bigarray_bound or r.size == 0),
                       key=lambda r: (-r.nbytes, key_id(r.key)))
        for request in big:
            self._take(request, Decision(layout(request.key, request.shape, request.dtype, self.num_servers,
                                                self.bigarray_bound, request.word).parts[0].server, True))
        mean = (sum(self.load) + sum(r.nbytes for r in whole)) / self.num_servers
        judged = len(whole) >= self.num_servers > 1
        for request in whole:
            home = min(range(self.num_servers), key=lambda s: (self.load[s], s))
            over = self.load[home] + request.nbytes > mean * (1 + SLACK)
            split = judged and over and request.nbytes >= SPLIT_MIN_BYTES and request.size >= self.num_servers
            self._take(request, Decision(home, split))
        return {r.key: self.decisions[r.key] for r in requests}

    def adopt(self, request: KeyRequest, decision: Decision) -> None:
        """Take another party's decision for ``request`` (worker 0's, from the init barrier)."""
        old = self.decisions.get(request.key)
        if old is not None:
            self._carry(request, old, -1)
        self._take(request, decision)

    @staticmethod
    def note_of(decisions: dict[Hashable, Decision]) -> list:
        """``decisions`` as worker 0's init barrier note carries them: ``[key, home, split]`` each."""
        return [[key, *decision.as_note()] for key, decision in decisions.items()]

    def adopt_note(self, requests: list[KeyRequest], placed: object) -> None:
        """Take worker 0's decisions (``note_of``, from the wire: malformed entries are skipped) for
        this init call's keys, and remember those of the keys this worker did not pass; a key worker
        0 did not initialise keeps this worker's own decision (the servers do not hold it: using it
        fails there, as it always did)."""
        theirs = {}
        for entry in placed if isinstance(placed, list) else []:
            if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], (int, str)):
                decision = Decision.from_note(entry[1:], self.num_servers)
                if decision is not None:
                    theirs[(type(entry[0]), entry[0])] = decision
        mine = []
        for request in requests:
            decision = theirs.pop((type(request.key), request.key), None)
            if decision is None:
                mine.append(request)
            else:
                self.adopt(request, decision)
        self.place(mine)
        for (_, key), decision in theirs.items():
            self.remember(key, decision)

    def remember(self, key: Hashable, decision: Decision) -> None:
        """Keep worker 0's decision for a key this worker has not passed to ``init`` yet (its shape
        unknown here: its bytes are not counted), so that a later init of it takes the same place."""
        self.decisions.setdefault(key, decision)

    def _take(self, request: KeyRequest, decision: Decision) -> None:
        self.decisions[request.key] = decision
        self._carry(request, decision, 1)

    def _carry(self, request: KeyRequest, decision: Decision, sign: int) -> None:
        lay = layout(request.key, request.shape, request.dtype, self.num_servers, self.bigarray_bound, request.word,
                     decision.home, decision.split)
        itemsize = np.dtype(request.dtype).itemsize
        for part in lay.parts:
            self.load[part.server] += sign * part.size * itemsize

    def balance(self) -> float:
        """The busiest server's bytes over the mean (1.0: even; 1.0 when nothing is placed)."""
        total = sum(self.load)
        return max(self.load) * self.num_servers / total if total else 1.0
