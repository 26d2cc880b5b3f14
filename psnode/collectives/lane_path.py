"""The collectives' big segments on lanes (``psnode.transport.lanes``): which messages go there, and how a
lane's messages reach the ops.

**Sending.** A message whose data frame is tracked (``base.TRACK_MIN`` bytes or more: ring,
broadcast and allgather segments) goes on the lane to its peer when that peer has one and is
reached over TCP (another host, or ``PSLAUNCH_SAME_HOST=tcp``); the rest, and everything for peers
reached through the same-host path, keeps the node's transport. A lane that cannot be opened sends
what it holds, and everything after, through the transport. Ops do not rely on the order of
messages between two paths: each message names its step and segment.

**Receiving.** Each message's prefix (header and record frames) is checked before its data is
read (``wire.unpack_prefix``), with the sender known from the lane's handshake; an op that
expects that exact segment may name where its data goes (``Op.destination``: the ring's allgather
reads each summed segment straight into the value), else it lands in the lane's buffer. The
message then takes the same way as one from the transport (``Engine.take``). A lane message that
fails those checks closes the lane and fails the op it names, if any, on every worker.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from psnode.errors import ProtocolError
from psnode.node.membership import PeerInfo, endpoint_of

from . import wire
from .base import Tag

__all__ = ["LanePath", "LANE_MAX"]

LANE_MAX = 64 << 20  # the most data bytes of one lane message (a ring segment is at most 4 MiB)


class LanePath:
    """One engine's use of its worker's lanes (see the module docstring); thread-safe."""

    prefix_size = wire.PREFIX

    def __init__(self, engine: Any, lanes: Any) -> None:
        self.engine = engine
        self.lanes = lanes
        self._tcp: dict[str, bool] = {}  # uid -> the peer is reached over TCP
        self._count_lock = threading.Lock()
        self.received = 0  # messages taken from lanes (counted for tests and the curious)

    def start(self) -> None:
        """Accept the peers' lanes."""
        self.lanes.serve(self, self._known)

    def _known(self, uid: bytes) -> PeerInfo | None:
        peer = self.engine.conn.members.peers.get(uid)
        return peer if peer is not None and peer.role == "worker" else None

    # ---- sending -----------------------------------------------------------------------------------
    def send(self, peer: PeerInfo, frames: list) -> Any:
        """Queue ``frames`` (header, record, data) for ``peer`` on its lane; a tracker, or None when
        the message takes the transport instead."""
        if not peer.lane_port or len(frames) != 3 or len(frames[2]) > LANE_MAX:
            return None
        tcp = self._tcp.get(peer.uid)
        if tcp is None:
            conn = self.engine.conn
            endpoint = endpoint_of(peer, conn.transport, conn.me.fingerprint, conn.env.same_host)
            tcp = self._tcp[peer.uid] = endpoint.startswith("tcp://")
        if not tcp:
            return None
        return self.lanes.send(peer.uid.encode(), (peer.host, peer.lane_port), peer.describe(), frames,
                               lambda again: self.engine.send_on_transport(peer, again))

    # ---- receiving (each lane's thread) ----------------------------------------------------------------
    def parse(self, peer: PeerInfo, prefix: bytes) -> tuple[int, tuple[Tag, wire.Record]]:
        """Data bytes after ``prefix``, and its tag and record.

        Raises:
            ProtocolError: a prefix no collective sends on a lane, or more data than a lane carries.
        """
        key_id, version, record, size = wire.unpack_prefix(prefix)
        if size > LANE_MAX:
            raise ProtocolError(f"a lane message of {size} data bytes (at most {LANE_MAX})")
        return size, ((key_id, version), record)

    def destination(self, peer: PeerInfo, message: tuple[Tag, wire.Record], size: int) -> Any:
        """Where the op of this message wants its data read, or None."""
        view = self.engine.destination(peer.rank, *message)
        if view is None or view.nbytes != size:
            return None
        return view.view(np.uint8)

    def deliver(self, peer: PeerInfo, message: tuple[Tag, wire.Record], body: Any) -> None:
        """Give the message to the engine, as one from the transport."""
        with self._count_lock:
            self.received += 1
        if self.engine.take(peer, message[0], message[1], body):
            self.engine.conn.transport.wake()  # a caller may wait in the transport's poll: nothing else comes there

    def refused(self, peer: PeerInfo, prefix: bytes, why: str) -> None:
        """The lane from ``peer`` sent what no collective sends: fail the op it named, if any."""
        self.engine.refuse(peer, wire.peek_tag(prefix), f"{why} (on its lane, which this worker closed)")
