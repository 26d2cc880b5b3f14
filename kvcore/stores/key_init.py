"""How a distributed store's keys reach the servers, and how every worker learns where they went.

``KeyInit`` owns a store's ``Placement`` (``kvcore.stores.placement``), its ``PlacementBook`` (the log of
worker 0's decisions in the scheduler's ledger) and worker 0's ``DeferredInits``. ``init`` does what
the worker's part is:

- worker 0 records the keys, with a copy of each value, and ``send`` places everything recorded as
  one call, initialises it on the servers and writes the decisions into the book (before worker 0's
  next call that reaches the servers: ``settle``, or after a quiet spell);
- every other worker reads the book until it holds every key of its call (waiting, never guessing);
- a worker restarted alone reads the book too; worker 0 restarted alone places the keys the book
  does not hold yet.

The layouts of the keys once on the servers go to the store through ``take_layouts``. A key is
initialised once in a job: worker 0 refuses, on every worker, a key another store of its process put
on the servers (``_initialised``, per worker node). Called by the store from one thread at a time
(the quiet-spell send runs under ``DeferredInits``' lock).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Hashable

import numpy as np

from psnode.node.bulk import gc_paused
from psnode.worker.node import WorkerNode

from .. import arrays
from ..dist_errors import runtime_errors
from ..errors import DistributedError, ServerError
from .deferred_init import DeferredInits
from .placement import KeyRequest, Placement
from .placement_book import PlacementBook
from .sharding import KeyLayout

__all__ = ["KeyInit"]

# Per worker node (a test runs several in one process): how many dist stores it made (a store's
# placement log is named by its ordinal, the same on every worker), and the keys worker 0 put on the
# servers through any of them.
_ordinals: "weakref.WeakKeyDictionary[WorkerNode, itertools.count]" = weakref.WeakKeyDictionary()
_initialised: "weakref.WeakKeyDictionary[WorkerNode, set]" = weakref.WeakKeyDictionary()


class KeyInit:
    """One dist store's init path (see the module docstring). ``sync``: keys merged per round;
    ``take_layouts(layouts)``: the store takes the layouts of keys now on the servers."""

    def __init__(self, worker: WorkerNode, sync: bool, take_layouts: Callable[[list[KeyLayout]], None]) -> None:
        self.worker = worker
        self.sync = sync
        self.take_layouts = take_layouts
        self.placement = Placement(worker.num_servers, worker.env.bigarray_bound)  # where keys go, by bytes
        ordinal = next(_ordinals.setdefault(worker, itertools.count()))
        self.book = PlacementBook(worker, ordinal, self.placement)  # worker 0 tells, the others learn
        self.deferred = DeferredInits(self.send)  # worker 0's init calls, placed together
        deferred = weakref.ref(self.deferred)
        worker.before_close(lambda: (d := deferred()) is not None and d.close())

    def init(self, requests: list[KeyRequest], values: list[Any]) -> None:
        """This worker's part of an init call of ``requests`` (rank 0's ``values`` are the keys'):
        see the module docstring. Blocking on a worker other than 0 until the keys are placed.

        Raises:
            ServerError: worker 0 refused a key (on every worker); DistTimeoutError,
                DistributedError, NodeDiedError: see ``PlacementBook.learn``.
        """
        worker = self.worker
        if worker.rank == 0 and not worker.rejoined:
            self._record(requests, values)
            return
        keys = [r.key for r in requests]
        if worker.rank == 0:  # restarted alone: what the book holds was placed; what it lacks, this worker places
            missing = set(self.book.learn(keys, wait=False))
            for request in requests:  # their bytes count where this worker places the missing ones
                if request.key not in missing:
                    self.placement.adopt(request, self.placement.decisions[request.key])
            if missing:
                self.send([(r, value) for r, value in zip(requests, values) if r.key in missing])
        else:
            self.book.learn(keys)
        self.take_layouts([self.placement.layout(r) for r in requests])

    def settle(self) -> None:
        """Worker 0: send the init calls recorded so far, before a call that reaches the servers (and
        raise the error a send in the background met)."""
        if self.deferred:
            self.deferred.flush()

    def _record(self, requests: list[KeyRequest], values: list[Any]) -> None:
        initialised = _initialised.setdefault(self.worker, set())
        clash = [r.key for r in requests if r.key in initialised]
        if clash:
            error = ServerError(f"key {clash[0]!r} is already initialised on the servers: another store of this "
                                "process initialised it, and a key is initialised once in a job")
            self.book.publish_refusal([r.key for r in requests], error)
            raise error
        initialised.update(r.key for r in requests)
        self.deferred.add([(r, np.array(arrays.asnumpy(value), copy=True)) for r, value in zip(requests, values)])

    def send(self, items: list[tuple[KeyRequest, Any]]) -> None:
        """Place the keys of ``items`` (every init call recorded since the last send) as one call,
        initialise them on the servers (blocking), then tell every worker where they went. A refusal
        of the servers is told to every worker too, and raised."""
        with gc_paused():  # a million keys' layouts and messages: objects that live on, or soon gone
            requests = [r for r, _ in items]
            decisions = self.placement.place(requests)
            layouts = [self.placement.layout(r) for r in requests]
            parts = []
            for lay, (_, value) in zip(layouts, items):
                flat = np.ascontiguousarray(arrays.asnumpy(value)).reshape(-1)
                for part in lay.parts:
                    data = flat[part.start:part.stop] if lay.split else flat.reshape(lay.shape)
                    parts.append((part.server, part.id, lay.key, data, lay.row_size or 1))
            try:
                with runtime_errors():
                    # a worker 0 started again alone redoes an init its predecessor may have sent
                    future = self.worker.init(parts, self.sync, redo=self.worker.rejoined)
                    self.worker.wait_for(future)
                    future.result()
            except DistributedError as exc:  # every rank must learn it: they would believe the keys exist
                keys: list[Hashable] = [r.key for r in requests]
                _initialised.get(self.worker, set()).difference_update(keys)
                self.book.publish_refusal(keys, exc)
                raise
            self.book.publish(decisions)
            self.take_layouts(layouts)
