"""Which server holds each key: placed so that every server carries the same bytes.

A ``dist_sync`` round waits for its busiest server, so the servers' bytes should be equal. A
mixing hash of the key id (``kvcore.stores.sharding``'s default) spreads keys evenly by *count*, not by
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

The decision is worker 0's alone: it places the keys of its init calls (gathered, so a model
initialised one parameter per call is placed as one call: ``kvcore.stores.deferred_init``), initialises
them on the servers with that layout, and then tells every worker where they went through the
scheduler's ledger (``kvcore.stores.placement_book``). Every other worker learns a key's place from there
before its first use of it, so the workers agree whatever order, grouping or subset of keys each
passes to ``init``. A worker restarted alone reads the same decisions. A restore from a checkpoint
places the checkpoint's keys as one call (the servers re-shard from any earlier layout).
"""

from __future__ import annotations

import functools
import heapq
import math
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

    @classmethod
    def from_note(cls, value: object, num_servers: int) -> "Decision | None":
        """The decision ``[home, split]`` from the wire (``kvcore.stores.placement_book``), or None when it
        is malformed."""
        if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], int) and not isinstance(value[0], bool)
                and 0 <= value[0] < num_servers and isinstance(value[1], bool)):
            return cls(value[0], value[1])
        return None


@dataclass(frozen=True)
class KeyRequest:
    """A key to place: its shape, dtype and compression word (``kvcore.stores.sharding.layout``)."""

    key: Hashable
    shape: tuple[int, ...]
    dtype: np.dtype
    word: int = 1

    @functools.cached_property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @functools.cached_property
    def size(self) -> int:
        return math.prod(self.shape)


class Placement:
    """The bytes each server carries, and the decision for every key placed or learnt. Not
    thread-safe (the store calls it from ``init`` and ``restore``, which are collective)."""

    def __init__(self, num_servers: int, bigarray_bound: int) -> None:
        self.num_servers = num_servers
        self.bigarray_bound = bigarray_bound
        self.load = [0] * num_servers
        self.decisions: dict[Hashable, Decision] = {}
        self._counted: set[Hashable] = set()  # keys whose bytes ``load`` holds

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
        lightest = [(load, server) for server, load in enumerate(self.load)]  # a heap: the least loaded first
        heapq.heapify(lightest)
        for request in whole:
            load, home = lightest[0]
            over = load + request.nbytes > mean * (1 + SLACK)
            split = judged and over and request.nbytes >= SPLIT_MIN_BYTES and request.size >= self.num_servers
            self._take(request, Decision(home, split))
            if split:  # its parts went to every server
                lightest = [(load, server) for server, load in enumerate(self.load)]
                heapq.heapify(lightest)
            else:
                heapq.heapreplace(lightest, (self.load[home], home))
        return {r.key: self.decisions[r.key] for r in requests}

    def adopt(self, request: KeyRequest, decision: Decision) -> None:
        """Take worker 0's decision for ``request``, counting its bytes (a restarted worker 0 decides
        later keys knowing what the servers carry)."""
        if request.key in self._counted:
            self._carry(request, self.decisions[request.key], -1)
        self._take(request, decision)

    def remember(self, key: Hashable, decision: Decision) -> None:
        """Keep worker 0's decision for a key (learnt from the placement book; its shape unknown
        here, so its bytes are counted only by ``adopt``, once this worker inits it)."""
        self.decisions[key] = decision

    def _take(self, request: KeyRequest, decision: Decision) -> None:
        self.decisions[request.key] = decision
        self._counted.add(request.key)
        self._carry(request, decision, 1)

    def _carry(self, request: KeyRequest, decision: Decision, sign: int) -> None:
        if not decision.split:  # whole on its home
            self.load[decision.home] += sign * request.nbytes
            return
        lay = layout(request.key, request.shape, request.dtype, self.num_servers, self.bigarray_bound, request.word,
                     decision.home, decision.split)
        itemsize = np.dtype(request.dtype).itemsize
        for part in lay.parts:
            self.load[part.server] += sign * part.size * itemsize

    def balance(self) -> float:
        """The busiest server's bytes over the mean (1.0: even; 1.0 when nothing is placed)."""
        total = sum(self.load)
        return max(self.load) * self.num_servers / total if total else 1.0
