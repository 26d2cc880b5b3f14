"""What a server sends back: pull replies gathered per batch, and push acknowledgements held to ride along.

Pulls answered while a batch of messages is handled are gathered (``answer``) and sent after the
batch (``flush``): one reply per request, small values packed into one data frame, values of
``OWN_FRAME`` bytes or more in frames of their own straight from the stored array (ZeroMQ reads it
in place; the store copies on write while such a send may still read it). A value a worker on this
host asked for in its shared memory is named where it lies when it is in one of this server's value
regions (the worker copies it out and writes the reply's receipt; ``psnode.server.shared_values``),
else written into the worker's region.

Push acknowledgements are held: a worker with a pull waiting here gets them with that pull's reply
(one message and one wake-up fewer per round), or after ``ACK_HOLD`` at the latest, so a worker that
waits for a push before anything else still hears of it. Other acknowledgements leave as soon as the
server is idle. The node's loop runs them through the ``Deferred`` interface (``due``,
``when_idle``, ``run``).

Single-threaded: the server's loop calls everything here.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import numpy as np

from psnode.log import logger
from psnode.node.membership import Membership, PeerInfo
from psnode.node.protocol import (
    FLAG_ACKS,
    FLAG_ERROR,
    IN_SERVER_MEMORY,
    IN_SHARED_MEMORY,
    MAX_ENTRIES,
    OWN_FRAME,
    PACK_LIMIT,
    Cmd,
    pack_entries,
    pack_header,
    pack_json,
    pack_value,
    with_flags,
)
from psnode.server.shared_values import Receipt, give_up
from psnode.server.store import Shard
from psnode.transport import same_host
from psnode.transport.base import Transport

__all__ = ["Replies", "ACK_HOLD", "pull_reply"]

_OWN_FRAMES = 1024  # big values (a frame each) in one reply message

ACK_HOLD = 0.002  # longest a push acknowledgement waits for a pull reply of its worker to ride along


def pull_reply(req_id: int, meta: bytes, payload: Any) -> list:
    """The frames of a pull reply whose values lie in one payload frame."""
    return [pack_header(Cmd.PULL_REPLY, req_id), meta, payload]


class Replies:
    """The replies of one server (see the module docstring).

    ``members``: the address book (workers by rank, once registered); ``memory``: where the shards
    live (its ``host`` gives a host array of a stored value); ``attached``: the workers'
    shared-memory regions this server has mapped.
    """

    def __init__(self, transport: Transport, members: Membership, memory: Any, attached: same_host.Attachments,
                 alone_from: int = 0) -> None:
        self.transport = transport
        # values of this many bytes or more go in a reply of their own (0: none): a job's data lanes
        # take such a reply, and the worker reads it straight into the pull's out
        self.alone_from = alone_from or 1 << 62
        self.members = members
        self.memory = memory
        self.attached = attached
        self.answers: dict[tuple[int, int], list[tuple[int, Shard]]] = defaultdict(list)  # until ``flush``
        self._acks: dict[int, list[tuple[int, int]]] = defaultdict(list)  # worker -> (req_id, parts)
        self._pulls_waiting: dict[int, set[int]] = defaultdict(set)  # worker -> pull req_ids not answered yet
        self._regions: dict[tuple[int, int, int], tuple[int, int]] = {}  # pulls answered in shared memory
        self._encoded: dict[tuple[int, int, int], Any] = {}  # pull parts answered in a codec (half width)
        # values a same-host worker copies out of this server's memory: its receipt cell and the last
        # number given, per (worker, pull region) (psnode.server.shared_values)
        self.shared = getattr(memory, "shared", None)
        self._receipts: dict[tuple[int, int], list] = {}
        self.due: float | None = None
        self.when_idle = False

    # ---- bookkeeping of requests -----------------------------------------------------------
    def pull_arrived(self, worker: int, req_id: int) -> None:
        """A pull of ``worker`` is being served: acknowledgements may wait for its reply."""
        self._pulls_waiting[worker].add(req_id)

    def pulls_waiting(self) -> int:
        """Pulls being served that wait for a round to close (for the heartbeats' report)."""
        return sum(len(reqs) for reqs in self._pulls_waiting.values())

    def in_shared_memory(self, worker: int, req_id: int, index: int, ref: int, nbytes: int) -> None:
        """Part ``index`` of pull ``req_id`` is to be answered in the worker's region ``ref``."""
        self._regions[(worker, req_id, index)] = (ref, nbytes)

    def encoded(self, worker: int, req_id: int, index: int, codec: Any) -> None:
        """Part ``index`` of pull ``req_id`` is to be answered encoded by ``codec`` (``encode_reply``)."""
        self._encoded[(worker, req_id, index)] = codec

    def forget_regions(self, worker: int, req_id: int) -> None:
        """A refused pull answers nothing in shared memory, nor encoded."""
        for held in (self._regions, self._encoded):
            if held:
                for slot in [s for s in held if s[:2] == (worker, req_id)]:
                    del held[slot]

    def forget_worker(self, worker: int) -> None:
        """Worker ``worker`` was replaced by a restarted one: drop what was held for its predecessor
        (and count what it was reading in this server's memory as read)."""
        for slot in [s for s in self._receipts if s[0] == worker]:
            give_up(self._receipts.pop(slot)[0])
        self._acks.pop(worker, None)
        self._pulls_waiting.pop(worker, None)
        for held in (self._regions, self._encoded):
            for slot in [s for s in held if s[0] == worker]:
                del held[slot]
        for slot in [s for s in self.answers if s[0] == worker]:
            del self.answers[slot]

    def ack(self, worker: int, req_id: int, parts: int) -> None:
        """Acknowledge ``parts`` parts of push ``req_id`` (sent with the worker's next reply, or soon)."""
        self._acks[worker].append((req_id, parts))

    def answer(self, worker: int, req_id: int, index: int, shard: Shard) -> None:
        """Answer part ``index`` of pull ``req_id`` with ``shard``'s value (sent at ``flush``)."""
        self.answers[(worker, req_id)].append((index, shard))

    # ---- sending -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Send the gathered pull replies, one message per request."""
        answers, self.answers = self.answers, defaultdict(list)
        host = self.memory.host
        for (worker, req_id), parts in answers.items():
            if len(parts) == 1 and not self._regions and not self._encoded:  # one small part: the common reply
                index, shard = parts[0]
                if not shard.error and shard.nbytes < OWN_FRAME:
                    self.send_to(worker, [pack_value(req_id, index, host(shard.stored).tobytes())], req_id)
                    continue
            errors = [s.error for _, s in parts if s.error]
            if errors:
                self.refuse(self.members.workers[worker], Cmd.PULL_REPLY, req_id, errors[0])
                continue
            self._send_parts(worker, req_id, parts)

    def _send_parts(self, worker: int, req_id: int, parts: list[tuple[int, Shard]]) -> None:
        """Reply with ``parts``: in messages of at most ``MAX_ENTRIES`` parts and ``PACK_LIMIT`` bytes
        of small values each (the parts of several pull messages of one request may be answered in
        one flush), big values in frames of their own, those of ``alone_from`` bytes or more in a message of their own."""
        start, size, frames, full = 0, 0, 0, False
        for end, (_, shard) in enumerate(parts):
            own = shard.nbytes >= OWN_FRAME
            small = 0 if own else shard.nbytes
            alone = shard.nbytes >= self.alone_from
            if end > start and (full or alone or end - start >= MAX_ENTRIES or size + small > PACK_LIMIT
                                or frames + own > _OWN_FRAMES):
                self._send_message(worker, req_id, parts[start:end])
                start, size, frames = end, 0, 0
            size += small
            frames += own
            full = alone
        self._send_message(worker, req_id, parts[start:])

    def _send_message(self, worker: int, req_id: int, parts: list[tuple[int, Shard]]) -> None:
        host = self.memory.host
        entries = []
        small: list[np.ndarray] = []
        own: list[np.ndarray] = []  # frames of their own, in frame order
        big: list[Shard] = []  # the stored values among them: ZeroMQ reads them in place, tracked
        offset = 0
        for index, shard in parts:
            codec = self._encoded.pop((worker, req_id, index), None) if self._encoded else None
            if codec is not None:  # a new array: in the payload, or a frame of its own (nothing to track)
                data = codec.encode_reply(host(shard.stored))
                if data.nbytes >= OWN_FRAME:
                    own.append(data)
                    entries.append((shard.key_id, index, len(own), codec.id, 0, data.nbytes, 0))
                else:
                    small.append(data)
                    entries.append((shard.key_id, index, 0, codec.id, offset, data.nbytes, 0))
                    offset += data.nbytes
                continue
            region = self._regions.pop((worker, req_id, index), None) if self._regions else None
            if region is not None and region[1] == shard.nbytes:
                value = host(shard.stored)
                served = self._serve_shared(worker, region[0], value, shard) if self.shared is not None else None
                if served is not None:  # the worker copies it out of this server's region
                    entries.append((shard.key_id, index, IN_SERVER_MEMORY, 0, served[0], shard.nbytes, served[1]))
                    continue
                # mapped and checked when the pull arrived (ServerNode._pull): here only looked up
                view = self.attached.view(region[0], region[1], self.members.workers[worker].pid)
                np.copyto(view, value.view(np.uint8))
                entries.append((shard.key_id, index, IN_SHARED_MEMORY, 0, 0, shard.nbytes, 0))
            elif shard.nbytes >= OWN_FRAME:
                big.append(shard)
                own.append(host(shard.stored).reshape(-1))
                entries.append((shard.key_id, index, len(own), 0, 0, shard.nbytes, 0))
            else:
                small.append(host(shard.stored))
                entries.append((shard.key_id, index, 0, 0, offset, shard.nbytes, 0))
                offset += shard.nbytes
        if len(small) == 1:
            payload: Any = small[0].tobytes()
        elif small:
            payload = (b"".join([a.tobytes() for a in small]) if len(small) < 64
                       else np.concatenate([a.reshape(-1).view(np.uint8) for a in small]))
        else:
            payload = b""
        frames = [pack_header(Cmd.PULL_REPLY, req_id), pack_entries(entries), payload, *own]
        tracker = self.send_to(worker, frames, req_id, track=bool(big))
        if tracker is not None:
            for shard in big:
                shard.trackers.append(tracker)

    def _serve_shared(self, worker: int, pull_ref: int, value: np.ndarray, shard: Shard) -> tuple[int, int] | None:
        """``(region reference, receipt)`` when ``value`` lies in one of this server's value regions,
        which the worker's pull region ``pull_ref`` then reads until it writes the receipt into its
        cell; None: copy it into the pull region."""
        served = self.shared.region_of(value)
        if served is None:
            return None
        slot = (worker, pull_ref)
        entry = self._receipts.get(slot)
        if entry is None:
            try:
                cell = self.attached.view(pull_ref, 8, self.members.workers[worker].pid,
                                          same_host.receipt_offset(shard.nbytes)).view(np.uint64)
            except (OSError, ValueError):  # a region without a receipt cell: copy into it instead
                return None
            entry = self._receipts[slot] = [cell, int(cell[0])]
        entry[1] += 1
        receipt = Receipt(entry[0], entry[1])
        shard.trackers.append(receipt)  # the store writes a new array while the worker may still read this one
        return served.read_by(receipt), entry[1]

    def send_to(self, worker: int, frames: list, pull_req: int | None = None, track: bool = False) -> Any:
        """Send a reply to ``worker`` (``pull_req``: the pull it answers), with its held-back push
        acknowledgements as a last frame."""
        if pull_req is not None:
            self._pulls_waiting[worker].discard(pull_req)
        pairs = self._acks.pop(worker, None)
        if pairs:
            frames[0] = with_flags(frames[0], FLAG_ACKS)
            frames.append(np.array(pairs, dtype=np.uint64).tobytes())
        return self.transport.send(self.members.workers[worker].uid.encode(), frames, track=track)

    def reply(self, peer: PeerInfo, cmd: int, req_id: int, arg: int) -> None:
        """Send a reply that carries no data (an init or updater acknowledgement)."""
        self.transport.send(peer.uid.encode(), [pack_header(cmd, req_id, arg)])

    def refuse(self, peer: PeerInfo, cmd: int, req_id: int, message: str) -> None:
        """Answer request ``req_id`` of ``peer`` with an error reply ``cmd`` carrying ``message``."""
        logger.info("a server refuses a request of %s: %s", peer.describe(), message)
        if cmd == Cmd.PULL_REPLY:
            self._pulls_waiting[peer.rank].discard(req_id)
            self.forget_regions(peer.rank, req_id)
        self.transport.send(peer.uid.encode(), [pack_header(cmd, req_id, flags=FLAG_ERROR), pack_json({"error": message})])

    # ---- the held acknowledgements (``node.Deferred``) ----------------------------------------
    def after_batch(self) -> None:
        """Send the batch's pull replies; decide when the acknowledgements no reply took along leave."""
        if self.answers:
            self.flush()
        if not self._acks:
            self.when_idle = False
            self.due = None
            return
        waiting = self._pulls_waiting
        if all(waiting.get(worker) for worker in self._acks):
            self.when_idle = False
            if self.due is None:
                self.due = time.monotonic() + ACK_HOLD
        else:
            self.when_idle = True

    def run(self) -> None:
        """Send the acknowledgements no pull reply took along."""
        acks, self._acks = self._acks, defaultdict(list)
        self.when_idle = False
        self.due = None
        workers = self.members.workers
        for worker, pairs in acks.items():
            body = np.array(pairs, dtype=np.uint64).tobytes()
            self.transport.send(workers[worker].uid.encode(), [pack_header(Cmd.PUSH_ACK, 0, len(pairs)), body])

