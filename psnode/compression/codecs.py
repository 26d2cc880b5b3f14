"""How a pushed value is encoded on the wire: the codec table.

Every push record names its codec (``ENTRY.codec`` / ``ONE_PART``'s codec field, see
``psnode.node.protocol``). A server turns what arrived into the values it merges through one function,
``decode``; size checks compare the key's element count with what the bytes encode
(``encoded_nbytes``), so a compressed push is checked against the decoded size.

Adding a codec is one ``Codec`` subclass here and one line in ``_TABLE`` (``register_codec`` adds
one from elsewhere, as a test does).
A codec with parameters (a threshold) gets them through ``configure`` on every server before the
first push that uses it.

Codecs:
    0 ``raw``: the value's own bytes (numpy's in-memory layout); decoding is a zero-copy view.
    1 ``2bit``: MXNet's 2bit gradient compression of float32 values (``psnode.compression``), 16 per
      32-bit word; its threshold comes with ``configure``.
    2 ``1bit``: the 1bit compression, 32 values per word (decodes to +-1; takes a threshold too).
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from psnode.compression import check_threshold, compressed_nbytes, dequantize
from psnode.errors import RequestRefused

__all__ = ["Codec", "RawCodec", "QuantizedCodec", "TwoBitCodec", "OneBitCodec", "RAW", "CodecTable", "codec_id",
           "codec_names", "register_codec"]


class Codec(abc.ABC):
    """One way of encoding a pushed value: a wire id, a name, and how to decode it.

    Encoding happens where the value and its residuals live (the worker, in kvcore); a server only
    decodes.
    """

    id: int
    name: str

    def configure(self, params: dict[str, Any]) -> None:
        """Take the job's parameters for this codec (none by default).

        Raises:
            RequestRefused: parameters this codec cannot use.
        """

    @abc.abstractmethod
    def encoded_nbytes(self, count: int, dtype: np.dtype) -> int:
        """The bytes the encoding of ``count`` values of ``dtype`` takes on the wire."""

    @abc.abstractmethod
    def decode(self, data: Any, dtype: np.dtype, count: int) -> np.ndarray:
        """The ``count`` values ``data`` encodes (``data`` is ``encoded_nbytes(count, dtype)`` long)."""


class RawCodec(Codec):
    """The value's in-memory bytes; decoding is a view of the message, nothing is copied."""

    id = 0
    name = "raw"

    def encoded_nbytes(self, count: int, dtype: np.dtype) -> int:
        return count * dtype.itemsize

    def decode(self, data: Any, dtype: np.dtype, count: int) -> np.ndarray:
        return np.frombuffer(data, dtype=dtype, count=count)


# ---- the quantized codecs ----------------------------------------------------------------------
# What the ``2bit`` and ``1bit`` codecs share: a threshold set once per job, and decoding through
# ``psnode.compression`` (numpy, on the host).
#
# A worker quantizes with a residual it keeps and pushes the packed words; the server turns them back
# into float32 values before the round merges them (arrival order, as MXNet's server sums). The
# threshold reaches every server in a ``SET_CODEC`` message (rank 0 sends it when training code calls
# ``set_gradient_compression``) at full float32 precision: a push that arrives before it is refused.


class QuantizedCodec(Codec):
    """A codec of ``psnode.compression``'s kind ``kind``: float32 values only, one threshold."""

    kind: str

    def __init__(self) -> None:
        self.threshold: np.float32 | None = None

    def configure(self, params: dict[str, Any]) -> None:
        """Take ``{"threshold": t}``: a JSON number that is finite (and greater than 0 for 2bit).

        Raises:
            RequestRefused: a missing or bad threshold (the message names it).
        """
        if "threshold" not in params:
            raise RequestRefused(f"the {self.name} codec needs a threshold, got the parameters {sorted(params)}")
        value = params["threshold"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestRefused(f"the {self.name} codec's threshold must be a number, got {value!r}")
        try:
            self.threshold = check_threshold(self.kind, value)
        except ValueError as exc:
            raise RequestRefused(str(exc)) from None

    def encoded_nbytes(self, count: int, dtype: np.dtype) -> int:
        return compressed_nbytes(count, self.kind)

    def decode(self, data: Any, dtype: np.dtype, count: int) -> np.ndarray:
        if dtype != np.float32:
            raise RequestRefused(f"{self.name} pushes carry float32 values, but the key holds {dtype}")
        if self.threshold is None:
            raise RequestRefused(
                f"a {self.name} push arrived before the compression parameters; every worker calls "
                "set_gradient_compression before pushing (rank 0 sends them to the servers)"
            )
        return dequantize(self.kind, data, self.threshold, size=count)


class TwoBitCodec(QuantizedCodec):
    """Codes ``11`` / ``10`` / ``00`` decode to ``+t`` / ``-t`` / 0 (``psnode.compression``)."""

    id = 1
    name = "2bit"
    kind = "2bit"


class OneBitCodec(QuantizedCodec):
    """Bits 1 / 0 decode to +1 / -1 (``psnode.compression``); the threshold only matters to the worker."""

    id = 2
    name = "1bit"
    kind = "1bit"


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
