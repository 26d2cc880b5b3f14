"""Where worker 0 placed each key of a store, as every worker learns it: the placement book.

Worker 0 alone decides where keys go (``kvcore.stores.placement``) and initialises them on the servers;
then it writes its decisions into a log of the scheduler's ledger (``psnode.scheduler.ledger``), one
log per store (``placement/<n>`` for the n-th distributed store a process creates, the same n on
every worker). Any other worker learns a key's place from that log before its first push or pull of
the key: ``learn`` reads on from where it stopped until every key it needs is there, waiting (at
most ``PSLAUNCH_PLACEMENT_TIMEOUT`` seconds, then an error that names the keys) and never guessing.
So the workers agree whatever order, grouping or subset of keys each passes to ``init``, and a
worker restarted alone reads the very decisions the others took.

A record holds the decisions of up to ``RECORD_KEYS`` keys (int keys as arrays: about 11 bytes
each), so a call of a million keys is about 170 records of 64 KiB keys, none near a message limit.
An init the servers refused is written as a refusal record naming its keys and the error, so every
worker waiting for them raises the same error instead of waiting on.

Record layout: a 4-byte little-endian length, a JSON head, then (for ``placed``) the int keys'
arrays: keys ``<i8``, homes ``<u2``, split flags ``u1``. The head: ``{"kind": "placed", "ints": n,
"others": [[key, home, split], ...]}`` (str keys, and ints beyond 64 bits) or ``{"kind":
"refused", "keys": [...], "error": {"kind": name, "message": text}}``. A record that does not read
back so is an error naming the log, never a guess.
"""

from __future__ import annotations

import json
import struct
import time
from typing import Hashable, Iterable

import numpy as np

from psnode.node.bulk import batches, gc_paused
from psnode.worker.node import WorkerNode

from ..dist_errors import runtime_errors
from ..errors import DistributedError, DistTimeoutError, NodeDiedError, ServerError
from .placement import Decision, Placement

__all__ = ["PlacementBook", "encode_placed", "encode_refused", "decode", "RECORD_KEYS"]

RECORD_KEYS = 65536  # decisions in one record
_RECORD_TEXT = 1 << 20  # about this many bytes of str keys in one record's JSON head
_LENGTH = struct.Struct("<I")
_INT64 = (-(1 << 63), 1 << 63)
_ERRORS = {cls.__name__: cls for cls in (DistributedError, ServerError, DistTimeoutError, NodeDiedError)}


def _key_text(key: Hashable) -> int:
    return len(key) + 8 if isinstance(key, str) else 24


def _record(head: dict, arrays: Iterable[np.ndarray] = ()) -> bytes:
    text = json.dumps(head, separators=(",", ":")).encode()
    return b"".join([_LENGTH.pack(len(text)), text, *(a.tobytes() for a in arrays)])


def encode_placed(decisions: dict[Hashable, Decision]) -> list[bytes]:
    """``decisions`` as placement records (see the module docstring)."""
    records = []
    for chunk in batches(decisions.items(), RECORD_KEYS, _RECORD_TEXT, lambda item: _key_text(item[0])):
        ints = [(k, d) for k, d in chunk if type(k) is int and _INT64[0] <= k < _INT64[1]]
        others = [[k, d.home, d.split] for k, d in chunk if not (type(k) is int and _INT64[0] <= k < _INT64[1])]
        keys = np.fromiter((k for k, _ in ints), np.int64, len(ints))
        homes = np.fromiter((d.home for _, d in ints), np.uint16, len(ints))
        splits = np.fromiter((d.split for _, d in ints), np.uint8, len(ints))
        records.append(_record({"kind": "placed", "ints": len(ints), "others": others}, (keys, homes, splits)))
    return records


def encode_refused(keys: list[Hashable], error: BaseException) -> list[bytes]:
    """A refusal of ``keys`` with ``error`` (its class name and message) as records."""
    body = {"kind": type(error).__name__, "message": str(error)}
    return [_record({"kind": "refused", "keys": chunk, "error": body})
            for chunk in batches(keys, RECORD_KEYS, _RECORD_TEXT, _key_text)]


def decode(record: bytes, num_servers: int) -> tuple[dict[Hashable, Decision], list[Hashable], DistributedError | None]:
    """``(decisions, refused keys, their error)`` of one record.

    Raises:
        ValueError: a record that is not one (the message says what is wrong).
    """
    if len(record) < _LENGTH.size:
        raise ValueError(f"a record of {len(record)} bytes")
    (size,) = _LENGTH.unpack_from(record)
    try:
        head = json.loads(record[_LENGTH.size:_LENGTH.size + size])
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"a record whose head is not JSON: {exc}") from None
    body = memoryview(record)[_LENGTH.size + size:]
    if not isinstance(head, dict):
        raise ValueError(f"a record whose head is a {type(head).__name__}")
    if head.get("kind") == "refused":
        keys, error = head.get("keys"), head.get("error")
        if not isinstance(keys, list) or not isinstance(error, dict) or body.nbytes:
            raise ValueError("a refusal record without its keys and error")
        if not all(isinstance(k, (int, str)) and not isinstance(k, bool) for k in keys):
            raise ValueError("a refusal record whose keys are not ints or strs")
        kind = _ERRORS.get(str(error.get("kind")), DistributedError)
        return {}, keys, kind(str(error.get("message")))
    count, others = head.get("ints"), head.get("others")
    if head.get("kind") != "placed" or type(count) is not int or count < 0 or not isinstance(others, list):
        raise ValueError(f"a record of kind {head.get('kind')!r} without its counts")
    if body.nbytes != count * 11:
        raise ValueError(f"a record of {count} int keys with {body.nbytes} bytes of arrays (expected {count * 11})")
    keys = np.frombuffer(body, np.int64, count, 0)
    homes = np.frombuffer(body, np.uint16, count, count * 8)
    splits = np.frombuffer(body, np.uint8, count, count * 10)
    if count and (int(homes.max()) >= num_servers or int(splits.max()) > 1):
        raise ValueError(f"a record placing keys on server {int(homes.max())} of {num_servers}, or with split "
                         f"flags other than 0 and 1")
    decisions: dict[Hashable, Decision] = {}
    cache: dict[tuple[int, int], Decision] = {}
    for key, home, split in zip(keys.tolist(), homes.tolist(), splits.tolist()):
        decision = cache.get((home, split))
        if decision is None:
            decision = cache[(home, split)] = Decision(home, bool(split))
        decisions[key] = decision
    for entry in others:
        decision = Decision.from_note(entry[1:], num_servers) if isinstance(entry, list) and len(entry) == 3 else None
        if decision is None or not isinstance(entry[0], (int, str)) or isinstance(entry[0], bool):
            raise ValueError(f"a record with the malformed decision {str(entry)[:100]}")
        decisions[entry[0]] = decision
    return decisions, [], None


class PlacementBook:
    """One store's placement (``kvcore.stores.placement.Placement``) and its log in the ledger: worker 0
    publishes into it, the others learn from it. Called by the store from one thread at a time."""

    def __init__(self, worker: WorkerNode, ordinal: int, placement: Placement) -> None:
        self.worker = worker
        self.log = f"placement/{ordinal}"
        self.placement = placement
        self.refused: dict[Hashable, DistributedError] = {}  # keys worker 0's init could not place
        self._read = 0  # records of the log taken so far
        self._ended = False  # the log ended: worker 0 finished

    # ---- worker 0 -------------------------------------------------------------------------------
    def publish(self, decisions: dict[Hashable, Decision]) -> None:
        """Write ``decisions`` (of keys now on the servers) into the log; blocks until the scheduler
        holds them. Raises DistributedError: the scheduler refused them (the ledger is full)."""
        self._append(encode_placed(decisions))

    def publish_refusal(self, keys: list[Hashable], error: BaseException) -> None:
        """Tell every worker that ``keys`` were refused with ``error``."""
        self._append(encode_refused(keys, error))

    def _append(self, records: list[bytes]) -> None:
        with runtime_errors():
            futures = [self.worker.ledger_append(self.log, record) for record in records]
            for future in futures:
                self.worker.wait_for(future)
                future.result()

    # ---- every other worker ---------------------------------------------------------------------
    def learn(self, keys: list[Hashable], wait: bool = True) -> list[Hashable]:
        """Read the log until every one of ``keys`` is placed or refused; return those still
        unknown (none unless ``wait`` is False: then only what the log holds now is read).

        Raises:
            DistTimeoutError: ``PSLAUNCH_PLACEMENT_TIMEOUT`` passed first (naming the keys).
            DistributedError: worker 0 finished without placing them, a malformed record, or the
                refusal worker 0 met initialising one of them (its error: every worker raises it).
            NodeDiedError: a node died meanwhile.
        """
        decisions = self.placement.decisions
        missing = [k for k in keys if k not in decisions and k not in self.refused]
        limit = self.worker.env.placement_timeout
        deadline = time.monotonic() + limit
        while missing and not self._ended:
            with runtime_errors():
                future = self.worker.ledger_read(self.log, self._read, wait)
                if not self.worker.wait_for(future, max(0.0, deadline - time.monotonic())):
                    raise DistTimeoutError(
                        f"worker {self.worker.rank} waited {limit:g} s for worker 0 to place {_named(missing)} "
                        f"(PSLAUNCH_PLACEMENT_TIMEOUT): worker 0's init of a key puts it on the servers and tells "
                        "every worker where; has worker 0 called init for it?")
                page = future.result()
            with gc_paused():
                self._take(page.entries)
            self._ended = page.end
            missing = [k for k in missing if k not in decisions and k not in self.refused]
            if not wait and not page.entries:
                break
        if missing and self._ended:
            raise DistributedError(f"worker 0 finished without initialising {_named(missing)}; only worker 0's "
                                   "init puts a key on the servers, so no worker can use it")
        for key in keys:
            error = self.refused.get(key)
            if error is not None:
                raise type(error)(str(error))
        return missing

    def _take(self, records: list[bytes]) -> None:
        for record in records:
            try:
                decisions, refused, error = decode(record, self.placement.num_servers)
            except ValueError as exc:
                raise DistributedError(f"record {self._read} of ledger log {self.log!r} is malformed: {exc}") from None
            self._read += 1
            for key, decision in decisions.items():
                self.placement.remember(key, decision)
            for key in refused:
                self.refused[key] = error  # type: ignore[assignment]


def _named(keys: list[Hashable]) -> str:
    shown = ", ".join(repr(k) for k in keys[:5])
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return f"key{'s' if len(keys) > 1 else ''} {shown}{more}"
