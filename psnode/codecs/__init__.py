"""How a pushed value is encoded on the wire: the codec table.

Every push record names its codec (``ENTRY.codec`` / ``ONE_PART``'s codec field, see
``psnode.protocol``). A server turns what arrived into the values it merges through one function,
``decode``; size checks compare the key's element count with what the bytes encode
(``encoded_nbytes``), so a compressed push is checked against the decoded size.

Adding a codec is one module beside this one (a ``Codec`` subclass) and one line in ``_TABLE``
(``register_codec`` adds one from elsewhere, as a test does).
A codec with parameters (a threshold) gets them through ``configure`` on every server before the
first push that uses it.

Codecs:
    0 ``raw``: the value's own bytes (numpy's in-memory layout); decoding is a zero-copy view.
    1 ``2bit``: MXNet's 2bit gradient compression of float32 values (``psnode.compression``), 16 per
      32-bit word; its threshold comes with ``configure``.
    2 ``1bit``: the 1bit compression, 32 values per word (decodes to +-1; takes a threshold too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import RequestRefused
from .base import Codec
from .onebit import OneBitCodec
from .raw import RawCodec
from .twobit import TwoBitCodec

__all__ = ["Codec", "RAW", "CodecTable", "codec_id", "codec_names", "register_codec"]

RAW = RawCodec.id

_TABLE: dict[int, type[Codec]] = {
    RawCodec.id: RawCodec,
    TwoBitCodec.id: TwoBitCodec,
    OneBitCodec.id: OneBitCodec,
}


def register_codec(cls: type[Codec]) -> None:
    """Add codec ``cls`` under its ``id`` (tables made afterwards know it).

    Raises:
        ValueError: the id is taken by another codec, or does not fit the wire's 16 bits.
    """
    if not 0 <= cls.id < 1 << 16:
        raise ValueError(f"codec {cls.name!r} has id {cls.id}; ids are 0..65535")
    taken = _TABLE.get(cls.id)
    if taken is not None and taken is not cls:
        raise ValueError(f"codec id {cls.id} is taken by {taken.name!r}")
    _TABLE[cls.id] = cls


def codec_id(name: str) -> int:
    """The id of the codec called ``name`` (``"2bit"`` -> 1).

    Raises:
        ValueError: no codec has that name (the message lists the known ones).
    """
    for cid, cls in _TABLE.items():
        if cls.name == name:
            return cid
    raise ValueError(f"no codec is called {name!r}; the codecs are {codec_names()}")


def codec_names() -> str:
    """``raw (0), ...``: the known codecs, for error messages."""
    return ", ".join(f"{cls.name} ({cid})" for cid, cls in sorted(_TABLE.items()))


class CodecTable:
    """The codecs one node uses, each configured once (``configure``) and shared by every key."""

    def __init__(self) -> None:
        self._codecs: dict[int, Codec] = {cid: cls() for cid, cls in _TABLE.items()}

    def get(self, codec_id: int) -> Codec:
        """The codec ``codec_id``.

        Raises:
            RequestRefused: no codec has that id (the message lists the known ones).
        """
        codec = self._codecs.get(codec_id)
        if codec is None:
            raise RequestRefused(f"a push encoded with unknown codec {codec_id}; the codecs are {codec_names()}")
        return codec

    def configure(self, codec_id: int, params: dict[str, Any]) -> None:
        """Set ``params`` for codec ``codec_id`` (for example a threshold).

        Raises:
            RequestRefused: an unknown codec, or parameters it refuses (the message says which).
        """
        self.get(codec_id).configure(params)

    def decode(self, codec_id: int, data: Any, dtype: np.dtype, count: int) -> np.ndarray:
        """The ``count`` values of ``dtype`` that ``data`` encodes with codec ``codec_id``.

        The caller has checked the length (``encoded_nbytes``). Raw values are a zero-copy view of
        ``data``; other codecs return a new array.

        Raises:
            RequestRefused: an unknown codec, or a dtype the codec does not carry.
        """
        return self.get(codec_id).decode(data, dtype, count)
