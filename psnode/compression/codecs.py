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
    3 ``fp16``, 4 ``bf16``: float32 values at half width (``psnode.compression.schemes``); these two also
      encode pull replies, when a pull asks for them (its entry's codec).
    5 ``1bit_scaled``: a sign bit per value and a float32 scale per block (configured: ``block``).
    6 ``topk``, 7 ``randomk``: ``k`` uint32 indices then their ``k`` float32 values (configured: ``ratio``).
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from psnode.compression import compressed_nbytes
from psnode.compression.schemes import HalfScheme, ScaledSignScheme, Scheme, SparseScheme, ThresholdScheme, to_half
from psnode.errors import RequestRefused

__all__ = ["Codec", "RawCodec", "QuantizedCodec", "TwoBitCodec", "OneBitCodec", "SchemeCodec", "HalfCodec",
           "ScaledSignCodec", "SparseCodec", "RAW", "CodecTable", "codec_id", "codec_names", "register_codec"]


class Codec(abc.ABC):
    """One way of encoding a pushed value: a wire id, a name, and how to decode it.

    Encoding happens where the value and its residuals live (the worker, in kvcore); a server only
    decodes.
    """

    id: int
    name: str
    encodes_replies = False
    """Whether a pull may ask for its reply in this codec (``encode_reply``)."""

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

    def encode_reply(self, values: np.ndarray) -> np.ndarray:
        """A pull reply's bytes for ``values`` (a stored value; only codecs that ``encodes_replies``)."""
        raise RequestRefused(f"the {self.name} codec does not encode pull replies")


class RawCodec(Codec):
    """The value's in-memory bytes; decoding is a view of the message, nothing is copied."""

    id = 0
    name = "raw"

    def encoded_nbytes(self, count: int, dtype: np.dtype) -> int:
        return count * dtype.itemsize

    def decode(self, data: Any, dtype: np.dtype, count: int) -> np.ndarray:
        return np.frombuffer(data, dtype=dtype, count=count)


# ---- codecs that decode through a scheme (``psnode.compression.schemes``) -------------------------------


class SchemeCodec(Codec):
    """A codec that decodes through a ``Scheme``, made from its configured parameters (``_make``):
    float32 values only, and none before the parameters came (unless ``_default`` gives a scheme)."""

    def __init__(self) -> None:
        self.scheme: Scheme | None = self._default()

    def _default(self) -> Scheme | None:
        """The scheme before any parameters came (None: the codec needs them)."""
        return None

    def _make(self, params: dict[str, Any]) -> Scheme:
        raise NotImplementedError

    def configure(self, params: dict[str, Any]) -> None:
        try:
            self.scheme = self._make(params)
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestRefused(f"the {self.name} codec cannot use the parameters {params}: {exc}") from None

    def _ready(self, dtype: np.dtype) -> Scheme:
        if dtype != np.float32:
            raise RequestRefused(f"{self.name} pushes carry float32 values, but the key holds {dtype}")
        if self.scheme is None:
            raise RequestRefused(
                f"a {self.name} push arrived before the compression parameters; every worker calls "
                "set_gradient_compression before pushing (rank 0 sends them to the servers)"
            )
        return self.scheme

    def encoded_nbytes(self, count: int, dtype: np.dtype) -> int:
        return self._ready(dtype).encoded_nbytes(count)

    def decode(self, data: Any, dtype: np.dtype, count: int) -> np.ndarray:
        try:
            return self._ready(dtype).decode(data, size=count)
        except (TypeError, ValueError) as exc:
            raise RequestRefused(f"a {self.name} push that does not decode: {exc}") from None


# ---- the quantized codecs ----------------------------------------------------------------------
# What the ``2bit`` and ``1bit`` codecs share: a threshold set once per job, and decoding through
# ``psnode.compression`` (numpy, on the host).
#
# A worker quantizes with a residual it keeps and pushes the packed words; the server turns them back
# into float32 values before the round merges them (arrival order, as MXNet's server sums). The
# threshold reaches every server in a ``SET_CODEC`` message (rank 0 sends it when training code calls
# ``set_gradient_compression``) at full float32 precision: a push that arrives before it is refused.


class QuantizedCodec(SchemeCodec):
    """A codec of ``psnode.compression``'s kind ``kind``: float32 values only, one threshold (a
    ``ThresholdScheme``)."""

    kind: str

    @property
    def threshold(self) -> np.float32 | None:
        """The threshold configured, or None before the parameters came."""
        return None if self.scheme is None else self.scheme.threshold

    def _make(self, params: dict[str, Any]) -> Scheme:
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
            return ThresholdScheme(self.kind, value)
        except ValueError as exc:
            raise RequestRefused(str(exc)) from None

    def encoded_nbytes(self, count: int, dtype: np.dtype) -> int:
        return compressed_nbytes(count, self.kind)  # known before the threshold is: a size is checked first


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


# ---- the codecs of the types beyond MXNet's ------------------------------------------------------------


class HalfCodec(SchemeCodec):
    """float32 values at half width; needs no parameters and also encodes pull replies."""

    encodes_replies = True

    def _default(self) -> Scheme:
        return HalfScheme(self.name)

    def _make(self, params: dict[str, Any]) -> Scheme:
        if params:
            raise ValueError(f"it takes none, got {sorted(params)}")
        return HalfScheme(self.name)

    def encode_reply(self, values: np.ndarray) -> np.ndarray:
        # float32: the server refused a pull in this codec of any other key when it came
        return to_half(self.name, values.reshape(-1)).view(np.uint8)


class Fp16Codec(HalfCodec):
    """IEEE half precision (``psnode.compression.schemes``)."""

    id = 3
    name = "fp16"


class Bf16Codec(HalfCodec):
    """bfloat16 (``psnode.compression.schemes``)."""

    id = 4
    name = "bf16"


class ScaledSignCodec(SchemeCodec):
    """Sign bits and a scale per block; configured with ``{"block": values}``."""

    id = 5
    name = "1bit_scaled"

    def _make(self, params: dict[str, Any]) -> Scheme:
        block = params["block"]
        if isinstance(block, bool) or not isinstance(block, int):
            raise TypeError(f"block must be an integer, got {block!r}")
        return ScaledSignScheme(block)


class SparseCodec(SchemeCodec):
    """Indices and values; configured with ``{"ratio": fraction sent}``."""

    def _make(self, params: dict[str, Any]) -> Scheme:
        return SparseScheme(self.name, params["ratio"])


class TopKCodec(SparseCodec):
    """``topk`` (``psnode.compression.schemes``)."""

    id = 6
    name = "topk"


class RandomKCodec(SparseCodec):
    """``randomk``, laid out as ``topk`` (``psnode.compression.schemes``)."""

    id = 7
    name = "randomk"


RAW = RawCodec.id

_TABLE: dict[int, type[Codec]] = {
    RawCodec.id: RawCodec,
    TwoBitCodec.id: TwoBitCodec,
    OneBitCodec.id: OneBitCodec,
    Fp16Codec.id: Fp16Codec,
    Bf16Codec.id: Bf16Codec,
    ScaledSignCodec.id: ScaledSignCodec,
    TopKCodec.id: TopKCodec,
    RandomKCodec.id: RandomKCodec,
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
