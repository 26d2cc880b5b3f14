"""Where a key lives on the servers: a 64-bit key id, and the servers holding its parts.

A key of fewer than ``bigarray_bound`` elements goes whole to one server chosen by a mixing hash
of its id (so consecutive int keys spread evenly). A bigger key is split evenly across all servers,
and into parts of at most ``PART_BYTES`` (a multiple of the server count, dealt round robin), so
no message carries a giant frame (receive buffers stay reusable) and servers can work on one part
while the next arrives. Splits follow rows when the key has enough rows (so a row-sparse pull asks
each server only for its rows), else elements. The servers hold a split key as flat 1-D shards,
each with its own part id. The first part goes to a server chosen by the key's hash, so the larger
pieces of uneven splits do not always land on server 0.

A key whose pushes are compressed (``word``: 16 values per 32-bit word for 2bit, 32 for 1bit) is
split on whole compressed words, as MXNet splits it: every part but the last holds a multiple of
``word`` elements, so its packed words carry no padding and its length is its word count times
``word``. Row splits then fall on rows that are also word boundaries (when there are enough).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Hashable

import numpy as np

__all__ = ["KeyLayout", "Part", "key_id", "layout", "mix64", "PART_BYTES"]

_MASK = (1 << 64) - 1
PART_BYTES = 4 << 20


def mix64(value: int) -> int:
    """SplitMix64's finaliser: a cheap, well-mixed 64-bit hash of an integer."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def key_id(key: Hashable) -> int:
    """The 64-bit id of a user key: ints map to themselves (mod 2**64), strs to a BLAKE2b digest."""
    if isinstance(key, str):
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return int(key) & _MASK


@dataclass(frozen=True)
class Part:
    """A contiguous slice ``[start, stop)`` of the key's flat elements, held by ``server``."""

    server: int
    start: int
    stop: int
    id: int  # the id the server knows this part by (the key's id when the key is not split)

    @property
    def size(self) -> int:
        """Number of elements."""
        return self.stop - self.start


@dataclass(frozen=True)
class KeyLayout:
    """How one key is spread over the servers."""

    key: Hashable
    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    parts: tuple[Part, ...]
    split: bool
    row_size: int  # elements per row; 0 when the key is split by elements (rows do not align)


def layout(key: Hashable, shape: tuple[int, ...], dtype: np.dtype, num_servers: int, bigarray_bound: int,
           word: int = 1, home: int | None = None, split: bool | None = None) -> KeyLayout:
    """Decide the parts of ``key`` (see the module docstring); split bounds are multiples of ``word``
    elements (the values per compressed word; 1: anywhere).

    ``home``: the server of a whole key, or of a split key's first part (default: by the key's hash);
    ``split``: split the key over the servers, or keep it whole (default: split at ``bigarray_bound``
    elements). ``kvcore.stores.placement`` chooses both so that the servers carry equal bytes."""
    kid = key_id(key)
    size = math.prod(shape)
    rows = shape[0] if shape else 1
    row_size = size // rows if rows else 0
    home = mix64(kid) % num_servers if home is None else home
    if split is None:
        split = size >= bigarray_bound
    if not split or size == 0:
        return KeyLayout(key, kid, shape, np.dtype(dtype), (Part(home, 0, size, kid),), False, row_size)
    nbytes = size * np.dtype(dtype).itemsize
    chunks = -(-nbytes // PART_BYTES)
    units = -(-size // word)  # compressed words (elements when word is 1)
    count = min(units, num_servers * max(1, -(-chunks // num_servers)))
    step = math.lcm(row_size, word) if row_size else 0  # elements per block of whole rows and words
    if len(shape) >= 1 and step and size // step >= count:
        blocks = size // step
        bounds = [step * (blocks * i // count) for i in range(count)] + [size]
    else:
        bounds = [min(size, word * (units * i // count)) for i in range(count)] + [size]
        row_size = 0
    parts = tuple(
        Part((home + i) % num_servers, bounds[i], bounds[i + 1], mix64(kid ^ ((i + 1) * 0x9E3779B97F4A7C15 & _MASK)) | 1 << 63)
        for i in range(count)
    )
    return KeyLayout(key, kid, shape, np.dtype(dtype), parts, True, row_size)
