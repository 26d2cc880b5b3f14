"""The scheduler's rendezvous values: small strings nodes leave for each other (NCCL's unique id).

A node sets ``key`` to a string once (``Cmd.RDV_SET``); any node asks for ``key``
(``Cmd.RDV_GET``) and is answered once it is set (``Cmd.RDV_VALUE``), at once when it already is.
It is how workers that share no connection yet agree on one value, as torch's TCPStore does.

Every field comes from the network, so everything is bounded and checked: keys are strings of at
most ``MAX_KEY`` characters, values strings of at most ``MAX_VALUE``, a job holds at most
``MAX_KEYS`` keys (set or asked for), and a key is set once (a second, different value is refused:
two ranks disagree). A refusal is a sentence the asking node raises. Single-threaded (the
scheduler's thread).
"""

from __future__ import annotations

from typing import Any

from psnode.errors import ProtocolError

__all__ = ["Rendezvous", "MAX_KEY", "MAX_VALUE", "MAX_KEYS"]

MAX_KEY = 200
MAX_VALUE = 4096
MAX_KEYS = 256


def _text(body: Any, field: str, limit: int) -> str:
    value = body.get(field) if isinstance(body, dict) else None
    if not isinstance(value, str):
        raise ProtocolError(f"a rendezvous request whose {field!r} is a {type(value).__name__}, not a string")
    if len(value) > limit:
        raise ProtocolError(f"a rendezvous {field} of {len(value)} characters (at most {limit})")
    return value


class Rendezvous:
    """The values of one job and who waits for which (see the module docstring)."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.waiting: dict[str, list[tuple[bytes, int]]] = {}

    def _room_for(self, key: str) -> None:
        if key not in self.values and key not in self.waiting and len(self.values) + len(self.waiting) >= MAX_KEYS:
            raise ProtocolError(f"rendezvous key {key!r} is one too many: a job holds at most {MAX_KEYS}")

    def set(self, body: Any) -> tuple[str, list[tuple[bytes, int]]]:
        """Set a key from a RDV_SET body; return the value and the ``(node, req_id)`` that waited for it.

        Raises:
            ProtocolError: a malformed body, too many keys, or a key already set to another value.
        """
        key = _text(body, "key", MAX_KEY)
        value = _text(body, "value", MAX_VALUE)
        old = self.values.get(key)
        if old is not None and old != value:
            raise ProtocolError(f"rendezvous key {key!r} was already set to another value; a key is set once")
        self._room_for(key)
        self.values[key] = value
        return value, self.waiting.pop(key, [])

    def get(self, node: bytes, req_id: int, body: Any) -> str | None:
        """The value asked for by a RDV_GET body, or None when it is not set yet (the asker waits).

        Raises:
            ProtocolError: a malformed body, or too many keys.
        """
        key = _text(body, "key", MAX_KEY)
        value = self.values.get(key)
        if value is not None:
            return value
        self._room_for(key)
        waiting = self.waiting.setdefault(key, [])
        if len(waiting) >= MAX_KEYS:
            raise ProtocolError(f"too many nodes wait for rendezvous key {key!r}")
        waiting.append((node, req_id))
        return None
