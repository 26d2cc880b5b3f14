"""How a worker's push and pull calls become messages to the servers.

The calls speak in *parts*: ``(server rank, key id, array)``. Small parts of one call headed to one
server travel in one message, packed into one data frame; each part of 64 KiB or more travels in a
message of its own (sent from its buffer without a copy), so the server merges and answers it while
the next one is still arriving; parts of 1 MiB or more to a server on this host go through shared
memory (``same_host.WorkerRegions``, owned here). A part so big that the job's workers together could
send more than the servers' push window of it is offered first and sent once its server invites it
(``psnode.server.invitations``; ``offers`` keeps the messages until then). A push held back by the outbox carries the next pull to
its server (``worker_outbox.Outbox``); every request is tracked in the ``RequestTable``, which
writes the replies into the outs.

Thread-safety: as the ``WorkerNode`` that owns it, every method may be called from any thread.
"""

from __future__ import annotations

import concurrent.futures
import operator
from itertools import accumulate, repeat
from typing import Any, Sequence

import numpy as np

from psnode.compression.codecs import RAW
from psnode.errors import ProtocolError
from psnode.node.protocol import (
    ENTRY_STRUCT,
    FLAG_OFFER,
    MAX_ENTRIES,
    OWN_FRAME,
    PACK_LIMIT,
    Cmd,
    pack_entries,
    pack_header,
)
from psnode.transport import same_host
from psnode.worker.outbox import Outbox
from psnode.worker.requests import RequestTable

__all__ = ["DataPath"]

_NBYTES = operator.attrgetter("nbytes")
_STALE_OFFERS = 256  # offers held before those of ended pushes are looked for
# the most bytes a push may have to be written through its data lanes from the caller's values
# (``Outbox.write_through``); a bigger one is copied, so its copies overlap the lanes' writes
THROUGH_PER_PUSH = 16 << 20



def _flat_bytes(value: np.ndarray) -> np.ndarray:
    """``value``'s bytes as a flat uint8 array (a view when it is C-contiguous)."""
    if not value.flags.c_contiguous:
        value = np.ascontiguousarray(value)
    return value.reshape(-1).view(np.uint8)


class DataPath:
    """The push and pull of key parts (see the module docstring): ``requests`` tracks them,
    ``outbox`` sends them, ``regions`` are this worker's shared memory for big same-host parts.

    ``num_workers`` and ``push_window`` (``PSLAUNCH_PUSH_WINDOW``, 0: none) decide which parts are
    offered before they are sent: those of which the job's workers could together send more than the window.
    """

    def __init__(self, requests: RequestTable, outbox: Outbox, regions: same_host.WorkerRegions,
                 num_workers: int = 1, push_window: int = 0) -> None:
        self.requests = requests
        self.outbox = outbox
        self.regions = regions
        self.num_workers = num_workers
        self.push_window = push_window
        self.offers: dict[tuple[int, int, int], tuple[list, int]] = {}  # (server, req, index) -> (message, priority)

    # ---- push -----------------------------------------------------------------------------
    def push(self, parts: Sequence[tuple[int, int, np.ndarray]], priority: int = 0, copy: bool = True,
             future: Any = None, codec: int = RAW) -> Any:
        """Push ``(server, key id, value)`` parts; returns at once.

        With ``copy=True`` the caller may change the values as soon as push returns: each is copied,
        or, when its data lane to the server is idle, written into that lane's socket from the
        caller's array before push returns (the kernel's copy is the only one); with ``copy=False``
        the caller hands them over and must not change them until the future is done.
        ``codec``: how the values are encoded (``psnode.compression.codecs``); with any codec but ``RAW`` each
        value is the encoded bytes. The future is done when every server has received its parts.
        """
        future = future or concurrent.futures.Future()
        if len(parts) == 1 and parts[0][2].nbytes < OWN_FRAME:
            return self._push_small(*parts[0], priority, future, codec)
        by_server = _by_server(parts)
        requests, outbox = self.requests, self.outbox
        req = requests.track(future, len(parts), None, "push", frozenset(by_server))
        through = None  # whether this push's big parts may be written through (known at the first)
        for server, items in by_server.items():
            entries = []
            small = []
            offset = 0
            packed = 0  # messages of packed small values sent for this server so far
            key_ids, values = [item[1] for item in items], [item[2] for item in items]
            sizes = list(map(_NBYTES, values))
            total = sum(sizes)
            seqs = requests.next_pushes(key_ids, server, total)
            if max(sizes) < OWN_FRAME and total <= PACK_LIMIT and len(items) <= MAX_ENTRIES:
                # small values only (a list of small keys), in one message: no Python step per part
                entries = list(zip(key_ids, range(len(items)), repeat(0), repeat(codec), accumulate(sizes, initial=0),
                                   sizes, seqs))
                message = _packed_push(req, entries, values)
                if len(by_server) == 1 and outbox.hold(server, message, priority, req):
                    return future
                outbox.enqueue(server, message, priority, req)
                continue
            for i, (_, key_id, value) in enumerate(items):
                nbytes = value.nbytes
                seq = seqs[i]
                if entries and (len(entries) >= MAX_ENTRIES or (small and offset + nbytes > PACK_LIMIT)):
                    # the receiver's frame limit: start another message
                    outbox.enqueue(server, _packed_push(req, entries, small), priority, req)
                    entries, small, offset, packed = [], [], 0, packed + 1
                region = (self.regions.region((key_id, server, 0), nbytes)
                          if nbytes >= same_host.SHM_MIN and server in self.regions.servers else None)
                if region is not None:  # same host: one copy into shared memory, the server reads it there
                    np.copyto(region.array, _flat_bytes(value))
                    region.busy = future
                    entries.append((key_id, i, same_host.IN_SHARED_MEMORY, codec, region.ref, nbytes, seq))
                elif nbytes >= OWN_FRAME:
                    # its own message: the server merges and answers it while the next part arrives
                    entry = ENTRY_STRUCT.pack(key_id, i, 1, codec, 0, nbytes, seq)
                    own = [pack_header(Cmd.PUSH, req, 1), entry, b"", _flat_bytes(value)]
                    offered = self.push_window and nbytes * self.num_workers > self.push_window
                    if through is None:
                        through = copy and sum([part[2].nbytes for part in parts]) <= THROUGH_PER_PUSH
                    if through and not offered and outbox.write_through(server, own):
                        continue  # an idle data lane took it from the caller's array (the rest of a part it took, copied)
                    if copy:
                        own[3] = outbox.copy_for_send((key_id, server), own[3])
                    if offered:
                        if len(self.offers) > _STALE_OFFERS:
                            self._drop_stale_offers()
                        self.offers[(server, req, i)] = (own, priority)  # before the offer: its invitation may come at once
                        own = [pack_header(Cmd.PUSH, req, 1, FLAG_OFFER), entry]
                    outbox.enqueue(server, own, priority, req)
                else:
                    small.append(value)
                    entries.append((key_id, i, 0, codec, offset, nbytes, seq))
                    offset += nbytes
            if not entries:
                continue
            message = _packed_push(req, entries, small)
            if len(by_server) == 1 and not packed and outbox.hold(server, message, priority, req):
                return future
            outbox.enqueue(server, message, priority, req)
        outbox.pump()
        return future

    def _drop_stale_offers(self) -> None:
        """Forget the offers of pushes that ended without an invitation (a server refused the offer)."""
        pending = self.requests.pending
        for slot in [s for s in self.offers if s[1] not in pending]:
            self.offers.pop(slot, None)

    def invited(self, server: int, req: int, index: int) -> None:
        """Server ``server`` invites the value of part ``index`` of push ``req``: send it (any thread).

        Raises:
            ProtocolError: nothing of that push was offered to that server (the message is counted as
                malformed; no request fails).
        """
        offer = self.offers.pop((server, req, index), None)
        if offer is None:
            raise ProtocolError(f"an invitation of server {server} for part {index} of push {req}, "
                                "which was not offered to it")
        if req not in self.requests.pending:  # the push failed meanwhile: its value is not wanted
            return
        self.outbox.enqueue(server, offer[0], offer[1], req)
        self.outbox.pump()

    def push_part(self, server: int, key_id: int, value: np.ndarray, priority: int = 0, future: Any = None,
                  codec: int = RAW, copy: bool = True) -> Any:
        """``push([(server, key_id, value)], priority, copy, codec=codec)``, for callers with one part."""
        if value.nbytes < OWN_FRAME:
            return self._push_small(server, key_id, value, priority, future or concurrent.futures.Future(), codec)
        return self.push([(server, key_id, value)], priority, copy, future, codec)

    def _push_small(self, server: int, key_id: int, value: np.ndarray, priority: int, future: Any,
                    codec: int = RAW) -> Any:
        """``push`` of one small part: the same message, built without the general bookkeeping."""
        requests = self.requests
        req = requests.track(future, 1, None, "push", server)
        seq = requests.next_push(key_id, server, value.nbytes)
        message = [pack_header(Cmd.PUSH, req, 1), ENTRY_STRUCT.pack(key_id, 0, 0, codec, 0, value.nbytes, seq),
                   value.tobytes()]
        if not self.outbox.hold(server, message, priority, req):
            self.outbox.send(server, message, priority, req)
        return future

    # ---- pull -----------------------------------------------------------------------------
    def pull(self, parts: Sequence[tuple[int, int, np.ndarray]], priority: int = 0, future: Any = None,
             codecs: Sequence[int] | None = None) -> Any:
        """Pull ``(server, key id, out)`` parts into the C-contiguous arrays ``out``; returns at once.

        Each value includes every push of the key this worker issued before. The outs must stay
        alive and untouched until the future is done. ``codecs[i]``: the codec part ``i``'s reply
        comes in (one that ``encodes_replies``, ``psnode.compression.codecs``; its ``out`` then takes
        the encoded bytes, which the caller decodes); None: every part raw.
        """
        future = future or concurrent.futures.Future()
        regions = self.regions
        if len(parts) == 1 and (parts[0][2].nbytes < same_host.SHM_MIN or parts[0][0] not in regions.servers):
            return self._pull_one(*parts[0], priority, future, codecs[0] if codecs else RAW)
        requests, outbox = self.requests, self.outbox
        # the outs as writable bytes (as ``_writable_bytes``, without a call per out)
        targets = [memoryview(out).cast("B") if out.size else _NO_BYTES for _, _, out in parts]
        req = requests.track(future, len(parts), targets, "pull", tuple(part[0] for part in parts))
        request = requests.pending.get(req)
        by_server = _by_server(parts, indexed=True)
        held = outbox.take_held(next(iter(by_server)), priority) if len(by_server) == 1 else None
        if held is None:
            outbox.release_held()  # a held push that cannot carry this pull leaves on its own
        for server, items in by_server.items():
            if len(items) > 1 or held is None:
                items = self._pull_big_alone(server, items, req, priority, codecs)
            if not items:
                continue
            counts = requests.push_counts  # (``requests.pushes`` of each part, without a call per part)
            entries = [(key_id, index, 0, codecs[index] if codecs else RAW, 0, out.nbytes,
                        counts.get((key_id, server), 0)) for index, (_, key_id, out) in items]
            if server in regions.servers and request is not None:
                shm_min = same_host.SHM_MIN
                for j, (index, (_, key_id, out)) in enumerate(items):
                    if out.nbytes < shm_min or (codecs and codecs[index] != RAW):
                        continue  # a small value, or an encoded reply: it comes over the socket
                    region = regions.region((key_id, server, 1), out.nbytes)
                    if region is not None:  # the server writes the value into shared memory
                        region.busy = future
                        if request.regions is None:
                            request.regions = {}
                        request.regions[index] = region
                        entries[j] = (key_id, index, same_host.IN_SHARED_MEMORY, RAW, region.ref, out.nbytes, entries[j][6])
            for chunk in _reply_sized(entries):  # each reply fits the frame limit
                message = [pack_header(Cmd.PULL, req, len(chunk)), pack_entries(chunk)]
                if held is not None:  # the held push carries this pull; the server acknowledges it with the reply
                    if request is not None:
                        request.carried = held[4]
                    outbox.join(held, message, req)
                    held = None
                    continue
                outbox.enqueue(server, message, priority, req)
        outbox.pump()
        return future

    def pull_part(self, server: int, key_id: int, out: np.ndarray, priority: int = 0, future: Any = None) -> Any:
        """``pull([(server, key_id, out)], priority)``, for callers with one part."""
        if out.nbytes < same_host.SHM_MIN or server not in self.regions.servers:
            return self._pull_one(server, key_id, out, priority, future or concurrent.futures.Future())
        return self.pull([(server, key_id, out)], priority, future)

    def _pull_big_alone(self, server: int, items: list, req: int, priority: int,
                        codecs: Sequence[int] | None = None) -> list:
        """Send a pull message of its own for each big part answered over the socket (as pushes
        do, so that the server answers each as soon as its round closes); the other items."""
        if max([item[1][2].nbytes for item in items], default=0) < OWN_FRAME:
            return items  # none is big (a list of small keys: no step per part)
        rest = []
        local = server in self.regions.servers
        for item in items:
            index, (_, key_id, out) = item
            codec = codecs[index] if codecs else RAW
            if out.nbytes >= OWN_FRAME and not (local and out.nbytes >= same_host.SHM_MIN and codec == RAW):
                seq = self.requests.pushes(key_id, server)
                self.outbox.enqueue(server, _pull_message(req, key_id, index, out.nbytes, seq, codec), priority, req)
            else:
                rest.append(item)
        return rest

    def _pull_one(self, server: int, key_id: int, out: np.ndarray, priority: int, future: Any, codec: int = RAW) -> Any:
        """``pull`` of one part answered in a message: the same request, built without the general bookkeeping."""
        requests, outbox = self.requests, self.outbox
        req = requests.track(future, 1, [_writable_bytes(out)], "pull", server)
        seq = requests.pushes(key_id, server)
        held = outbox.take_held(server, priority) if outbox.held.item is not None else None
        if held is not None:  # the held push carries this pull; the server acknowledges it with the reply
            request = requests.pending.get(req)
            if request is not None:
                request.carried = held[4]
            if codec != RAW or not outbox.join_compact(held, req, key_id, seq):  # (the compact form pulls raw)
                outbox.join(held, _pull_message(req, key_id, 0, out.nbytes, seq, codec), req)
            return future
        outbox.send(server, _pull_message(req, key_id, 0, out.nbytes, seq, codec), priority, req)
        return future

    def pull_rows(self, parts: Sequence[tuple[int, int, np.ndarray, np.ndarray]], priority: int = 0,
                  future: Any = None) -> Any:
        """Pull the rows ``rows`` (int64, local to the part) of ``(server, key id, rows, out)`` parts into ``out``."""
        future = future or concurrent.futures.Future()
        requests = self.requests
        targets = [_writable_bytes(out) for _, _, _, out in parts]
        req = requests.track(future, len(parts), targets, "row_sparse_pull", tuple(part[0] for part in parts))
        for server, all_items in _by_server(parts, indexed=True).items():
            for first in range(0, len(all_items), MAX_ENTRIES):
                items = all_items[first:first + MAX_ENTRIES]
                entries = []
                chunks, offset = [], 0
                for index, (_, key_id, rows, out) in items:
                    rows = np.ascontiguousarray(rows, dtype=np.int64)
                    entries.append((key_id, index, 0, RAW, offset, rows.nbytes, requests.pushes(key_id, server)))
                    offset += rows.nbytes
                    chunks.append(rows)
                payload = np.concatenate(chunks) if chunks else b""
                self.outbox.enqueue(server, [pack_header(Cmd.ROWS, req, len(items)), pack_entries(entries), payload],
                                    priority, req)
        self.outbox.pump()
        return future


_NO_BYTES = memoryview(bytearray(0))  # the bytes of an empty out: nothing is ever written there


def _writable_bytes(out: np.ndarray) -> memoryview:
    """``out``'s bytes as a writable flat memoryview (a C-contiguous out; an empty one is fine too)."""
    return memoryview(out).cast("B") if out.size else _NO_BYTES


def _packed_push(req: int, entries: list, small: list) -> list:
    """A push message of small values packed into one data frame (copied here: the caller may change
    its arrays as soon as push returns)."""
    payload: Any = small[0].tobytes() if len(small) == 1 else b"".join([v.tobytes() for v in small])
    return [pack_header(Cmd.PUSH, req, len(entries)), pack_entries(entries), payload]


def _reply_sized(entries: list) -> list[list]:
    """``entries`` of one pull cut into runs whose values fit one reply frame (``PACK_LIMIT``), of at
    most ``MAX_ENTRIES`` parts each."""
    if len(entries) <= MAX_ENTRIES and sum([entry[5] for entry in entries]) <= PACK_LIMIT:
        return [entries]  # all in one reply (the common case: no step per part)
    chunks, chunk, size = [], [], 0
    for entry in entries:
        nbytes = entry[5] if entry[2] != same_host.IN_SHARED_MEMORY else 0  # values in shared memory take no frame
        if chunk and (size + nbytes > PACK_LIMIT or len(chunk) >= MAX_ENTRIES):
            chunks.append(chunk)
            chunk, size = [], 0
        chunk.append(entry)
        size += nbytes
    chunks.append(chunk)
    return chunks


def _pull_message(req: int, key_id: int, index: int, nbytes: int, seq: int, codec: int = RAW) -> list:
    """The frames of a pull of one part (``index``: its place in the request): header and meta."""
    return [pack_header(Cmd.PULL, req, 1), ENTRY_STRUCT.pack(key_id, index, 0, codec, 0, nbytes, seq)]


def _by_server(parts: Sequence, indexed: bool = False) -> dict[int, list]:
    """``parts`` grouped by their server (``part[0]``), in order; with ``indexed``, as ``(index, part)``."""
    servers = {part[0] for part in parts}
    if len(servers) == 1:  # one server (a list of keys often goes to one): no step per part
        return {servers.pop(): list(enumerate(parts)) if indexed else list(parts)}
    by_server: dict[int, list] = {}
    for index, part in enumerate(parts):
        by_server.setdefault(part[0], []).append((index, part) if indexed else part)
    return by_server
