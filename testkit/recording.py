"""A transport for tests that look at what travels: the zmq transport, noting every message's command."""

from __future__ import annotations

from typing import Any, Sequence

from psnode.node.protocol import peek, unpack_header
from psnode.transport.base import register_transport
from psnode.transport.zeromq import ZmqTransport

__all__ = ["RecordingTransport", "use_recording_transport"]


class RecordingTransport(ZmqTransport):
    """The zmq transport, noting the command of every message sent (``sent_cmds``) and the
    ``(command, flags)`` of every message received (``received``)."""

    def __init__(self, identity: bytes, **kwargs: Any) -> None:
        super().__init__(identity, **kwargs)
        self.sent_cmds: list[int] = []
        self.received: list[tuple[int, int]] = []

    def send(self, peer: bytes, frames: Sequence[Any], track: bool = False, block: bool = True) -> Any:
        self.sent_cmds.append(peek(frames[0])[0])
        return super().send(peer, frames, track, block)

    def recv(self) -> tuple[bytes, list[Any]]:
        sender, frames = super().recv()
        self.received.append(unpack_header(frames[0])[:2])
        return sender, frames


def use_recording_transport() -> str:
    """Register ``RecordingTransport`` as ``recording`` and return that name, for
    ``PSLAUNCH_TRANSPORT`` in a test's own process (set it before the node starts)."""
    register_transport("recording", RecordingTransport)
    return "recording"
