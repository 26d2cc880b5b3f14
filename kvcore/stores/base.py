"""The KVStore interface and the argument checks every store shares.

``KVStoreBase`` implements the public API of MXNet's KVStore (init, push, pull, pushpull,
row_sparse_pull, set_updater, set_optimizer, barrier, optimizer-state save/load). It normalises the
call forms (see ``keys.group``), validates keys, shapes and dtypes against what each key was
initialised with, and hands the stores a single form through the ``_init_keys``, ``_push_groups``,
``_pull_groups`` and ``_pull_rows`` hooks. A new store (local, distributed) implements those hooks.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np

from psnode.node.bulk import gc_paused
from psnode.node.values import VALUE_DTYPES

from .. import arrays
from ..compression import GradientCompression, check_store_type, parse_params
from ..errors import (
    CompressionError,
    DTypeMismatchError,
    DuplicateKeyError,
    OptimizerError,
    OutShapeError,
    ReadOnlyOutError,
    ShapeMismatchError,
    UninitializedKeyError,
    ValueCountError,
)
from ..handles import Handle
from ..optim.base import Optimizer, Updater
from ..sparse import RowSparseArray
from .keys import KeyKind, group, is_key_list

__all__ = ["KVStoreBase", "KeyMeta", "UpdaterFn"]

#: The API calls a timeline records (``KVStoreBase._trace_calls``), each named by its key.
TRACED_CALLS = ("push", "pull", "pushpull", "row_sparse_pull", "init")

UpdaterFn = Callable[[Hashable, Any, Any], None]
"""``updater(key, merged, stored)``: mutates ``stored`` in place from the merged pushed value."""


@dataclass(frozen=True)
class KeyMeta:
    """What a key was initialised with: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))


class KVStoreBase(abc.ABC):
    """A key-value store for data-parallel training, with MXNet KVStore semantics.

    Keys are ints or strs (never both in one store). Values are numpy or CuPy arrays. A key must be
    initialised once with ``init`` before it is pushed or pulled; every later value for it must have
    the same shape and dtype.

    Thread-safety: a store is meant to be used from one thread; the local store locks internally,
    but the order of calls from several threads is not defined.
    """

    def __init__(self, store_type: str) -> None:
        self._type = store_type
        self._kinds = KeyKind()
        self._meta: dict[Hashable, KeyMeta] = {}
        self._updater: UpdaterFn | None = None
        self._compression: GradientCompression | None = None

    def _trace_calls(self, timeline: Any) -> None:
        """With a timeline (``PSLAUNCH_TIMELINE``, ``psnode.node.timeline``) each call of ``TRACED_CALLS``
        and ``barrier`` on this store is an event named by its key (its first argument); without
        one (None) nothing is wrapped, so the calls cost what they did."""
        if timeline is None:
            return
        for name in TRACED_CALLS:
            setattr(self, name, timeline.wrap(getattr(self, name), name, _first_argument))
        self.barrier = timeline.wrap(self.barrier, "barrier")  # type: ignore[method-assign]

    # ---- properties -------------------------------------------------------------------------
    @property
    def type(self) -> str:
        """The name the store was created with (``local``, ``device``, ``dist_sync``, ...)."""
        return self._type

    @property
    def rank(self) -> int:
        """This worker's rank (0 for a local store)."""
        return 0

    @property
    def num_workers(self) -> int:
        """Number of workers sharing the store (1 for a local store)."""
        return 1

    @property
    def elastic(self) -> bool:
        """True in an elastic job (``-n MIN:MAX``): ``num_workers`` may change at a step boundary."""
        return False

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of the workers ``num_workers`` counts (an elastic job's may have gaps)."""
        return tuple(range(self.num_workers))

    @property
    def member_index(self) -> int:
        """This worker's place among ``members``: the part of the data it takes (``SplitSampler``)."""
        return self.members.index(self.rank)

    @property
    def local_rank(self) -> int:
        """This worker's index among the workers on its host (0 for a local store)."""
        return 0

    @property
    def collectives(self) -> Any:
        """The workers' collectives (``kvcore.collectives.Collectives``) when the store sums among
        the workers themselves (``allreduce``), else None: the Trainer then sums gradients in place
        through them, without the store's copies."""
        return None

    # ---- public API -------------------------------------------------------------------------
    def init(self, key: Any, value: Any) -> None:
        """Initialise one key or a list of keys with their values.

        For a key given a list of arrays, the first array is the initial value.

        Raises:
            DuplicateKeyError: a key is already initialised (the message names it).
            KeyTypeError, ValueCountError: malformed keys or value lists.
        """
        with gc_paused():  # a call of many keys makes many objects that all live on
            self._init(key, value)

    def _init(self, key: Any, value: Any) -> None:
        groups = group(key, value, "value", self._kinds)
        seen: set[Hashable] = set()
        for k, _ in groups:
            if k in self._meta or k in seen:
                raise DuplicateKeyError(f"key {k!r} is already initialised; init() takes each key once")
            seen.add(k)
        pairs = []
        for k, values in groups:
            first = values[0]
            if isinstance(first, RowSparseArray):
                first = first.todense()
            dtype = np.dtype(first.dtype)
            if dtype not in VALUE_DTYPES:
                known = ", ".join(sorted(str(d) for d in VALUE_DTYPES))
                raise DTypeMismatchError(f"key {k!r}: dtype {dtype} is not one a KVStore holds; use one of {known}")
            pairs.append((k, first))
        self._init_keys(pairs)
        for k, first in pairs:
            self._meta[k] = KeyMeta(tuple(first.shape), np.dtype(first.dtype))

    def push(self, key: Any, value: Any, priority: int = 0, copy: bool = True) -> Handle:
        """Push one value, or a list of per-device values that are summed first, for each key.

        The merged value is handed to the updater (by default it replaces the stored value).
        Returns a ``Handle``; the caller may modify ``value`` as soon as push returns (a big value
        is copied, or written into its server's idle data lane before push returns). Higher
        ``priority`` goes first when a store queues work. With gradient compression on (see
        ``set_gradient_compression``) each value is quantized with its own residual first.

        ``copy=False`` (the distributed stores; the others ignore it): a big numpy value that goes
        to its server over the network is sent from the caller's array instead of a copy, so
        ``push`` returns sooner and the round moves a pass less memory. The caller then must not
        change ``value`` until the returned handle is done (``handle.wait()``; a pull of the key
        that follows the push has waited for it too).

        Raises:
            UninitializedKeyError, ShapeMismatchError, DTypeMismatchError: naming key and values
                (DTypeMismatchError also for a key that is not float32 while compression is on).
        """
        groups = []
        metas, ndarray, compressed = self._meta, np.ndarray, self._compression is not None
        for k, values in group(key, value, "value", self._kinds):
            meta = metas.get(k) or self._require(k, "push")
            # a host array of the key's shape and dtype passes at once (key lists can be long)
            if len(values) != 1 or type(values[0]) is not ndarray:
                if compressed and any(isinstance(v, RowSparseArray) for v in values):
                    raise CompressionError(
                        f"gradient compression encodes dense values, but the push of key {k!r} is row-sparse; "
                        "push row-sparse gradients to a store without compression"
                    )
                values = [self._dense_value(k, v) for v in values]
                for v in values:
                    self._check_value(k, meta, v)
            elif values[0].shape != meta.shape or values[0].dtype != meta.dtype:
                self._check_value(k, meta, values[0])
            groups.append((k, values))
            if compressed and meta.dtype != np.float32:
                raise DTypeMismatchError(
                    f"gradient compression is only supported for float32 values, but key {k!r} holds "
                    f"{meta.dtype}; push float32 gradients or create a store without compression"
                )
        return self._push_groups(groups, priority, copy)

    def pull(
        self, key: Any, out: Any = None, priority: int = 0, ignore_sparse: bool = True, wait: bool = True
    ) -> Handle:
        """Pull the stored value of each key into ``out`` (one array, or a list: every one gets it).

        Values are written into ``out`` in place. With ``wait=True`` (the default) pull returns once
        ``out`` holds the value; with ``wait=False`` it may return at once, and ``out`` must stay
        alive and untouched until the returned ``Handle`` is done.

        Raises:
            UninitializedKeyError; OutShapeError / DTypeMismatchError when an ``out`` does not match,
            ReadOnlyOutError when one cannot be written.
        """
        if out is None:
            raise ValueCountError(f"pull of key {key!r} needs out=: the array(s) to write the value into")
        groups = group(key, out, "out", self._kinds)
        metas, ndarray = self._meta, np.ndarray
        for k, outs in groups:
            meta = metas.get(k) or self._require(k, "pull")
            for o in outs:
                if type(o) is not ndarray or o.shape != meta.shape or o.dtype != meta.dtype or not o.flags.writeable:
                    self._check_out(k, meta, o)
        handle = self._pull_groups(groups, priority)
        if wait:
            handle.wait()
        return handle

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0, wait: bool = True) -> Handle:
        """Push ``value`` then pull into ``out`` (``value`` itself when ``out`` is None)."""
        self.push(key, value, priority)
        return self.pull(key, value if out is None else out, priority, wait=wait)

    def row_sparse_pull(self, key: Any, out: Any = None, priority: int = 0, row_ids: Any = None) -> Any:
        """Pull only the rows ``row_ids`` of each key.

        A dense ``out`` of the key's full shape gets the stored rows at ``row_ids`` and zeros in
        every other row; a ``RowSparseArray`` out gets the sorted unique rows and their indices.
        ``row_ids`` is one array for all outs, or a list with one per out.
        """
        if out is None or row_ids is None:
            raise ValueCountError(f"row_sparse_pull of key {key!r} needs both out= and row_ids=")
        groups = group(key, out, "out", self._kinds)
        id_lists = self._group_row_ids(key, row_ids, groups)
        requests = []
        for (k, outs), ids_for_key in zip(groups, id_lists):
            meta = self._require(k, "row_sparse_pull")
            if len(ids_for_key) == 1 and len(outs) > 1:
                ids_for_key = ids_for_key * len(outs)
            if len(ids_for_key) != len(outs):
                raise ValueCountError(
                    f"key {k!r}: {len(outs)} outs were given with {len(ids_for_key)} row_ids arrays"
                )
            for o, ids in zip(outs, ids_for_key):
                self._check_out(k, meta, o)
                rows = np.unique(arrays.asnumpy(ids).astype(np.int64).ravel())
                if rows.size and (rows[0] < 0 or rows[-1] >= meta.shape[0]):
                    raise IndexError(
                        f"key {k!r} has {meta.shape[0]} rows, but row_ids holds {rows[0] if rows[0] < 0 else rows[-1]}"
                    )
                requests.append((k, o, rows))
        unique_rows = [(k, rows) for k, _, rows in requests]
        fetched = self._pull_rows(unique_rows, priority)
        for (k, o, rows), data in zip(requests, fetched):
            _write_rows(o, rows, data)

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress every pushed value from now on, as MXNet's ``set_gradient_compression`` does.

        ``compression_params`` is a dict: ``{'type': '2bit', 'threshold': 0.5}``, ``{'type': 'fp16'}``,
        ``{'type': 'topk', 'ratio': 0.01}``, ... (see ``kvcore.compression``). Only the ``device``,
        ``dist_*`` and ``allreduce`` stores compress; only dense float32 values can then be pushed.
        Calling it again changes the parameters and keeps the residuals. ``init`` is not compressed;
        pulls are, at half width, on a distributed store when the parameters say so (``'pull'``).

        Raises:
            CompressionError: a store that cannot compress, or parameters MXNet would refuse (the
                message says which and names the value).
        """
        check_store_type(self._type)
        params = parse_params(compression_params)
        if self._compression is None:
            self._compression = GradientCompression(params, stream=self.rank)
        else:
            self._compression.set_params(params)

    def set_updater(self, updater: UpdaterFn) -> None:
        """Install ``updater(key, merged, stored)``, which must update ``stored`` in place."""
        if not callable(updater):
            raise OptimizerError(f"the updater must be callable, got {type(updater).__name__}")
        self._updater = updater

    def _set_updater(self, updater: UpdaterFn) -> None:
        """MXNet's private name for ``set_updater``, which MXNet scripts call: the same."""
        self.set_updater(updater)

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Run ``optimizer`` on every merged push (inside the store)."""
        self.set_updater(Updater(optimizer))

    def barrier(self) -> None:
        """Wait until every worker reaches this barrier (a no-op for a local store)."""

    def _barrier(self) -> None:
        """MXNet's private name for ``barrier``, which MXNet scripts call: the same."""
        self.barrier()

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Write the optimizer's per-key states to ``fname``."""
        with open(fname, "wb") as fh:
            fh.write(self._updater_with_states("save").get_states(dump_optimizer))

    def load_optimizer_states(self, fname: str) -> None:
        """Restore optimizer states written by ``save_optimizer_states``."""
        updater = self._updater_with_states("load")
        with open(fname, "rb") as fh:
            updater.set_states(fh.read(), self._state_device())

    # ---- hooks for the stores -------------------------------------------------------------
    @abc.abstractmethod
    def _init_keys(self, pairs: list[tuple[Hashable, Any]]) -> None:
        """Store the initial value of each new key."""

    @abc.abstractmethod
    def _push_groups(self, groups: list[tuple[Hashable, list[Any]]], priority: int, copy: bool = True) -> Handle:
        """Merge and apply each key's pushed values; return a handle for the whole push."""

    @abc.abstractmethod
    def _pull_groups(self, groups: list[tuple[Hashable, list[Any]]], priority: int) -> Handle:
        """Write each key's stored value into every one of its outs; return a handle for it."""

    @abc.abstractmethod
    def _pull_rows(self, requests: list[tuple[Hashable, np.ndarray]], priority: int) -> list[Any]:
        """Return, per request, the stored rows at the given sorted unique row ids."""

    def _state_device(self) -> arrays.Device:
        """Where restored optimizer states are placed."""
        return arrays.cpu()

    # ---- shared checks ----------------------------------------------------------------------
    def _require(self, key: Hashable, op: str) -> KeyMeta:
        meta = self._meta.get(key)
        if meta is None:
            known = ", ".join(repr(k) for k in list(self._meta)[:10]) or "none"
            raise UninitializedKeyError(
                f"{op} of key {key!r}, which was never initialised; call init({key!r}, value) first "
                f"(initialised keys: {known})"
            )
        return meta

    @staticmethod
    def _check_value(key: Hashable, meta: KeyMeta, value: Any) -> None:
        if tuple(value.shape) != meta.shape:
            raise ShapeMismatchError(
                f"key {key!r} was initialised with shape {meta.shape}, but a value of shape "
                f"{tuple(value.shape)} was pushed"
            )
        if np.dtype(value.dtype) != meta.dtype:
            raise DTypeMismatchError(
                f"key {key!r} was initialised with dtype {meta.dtype}, but a value of dtype "
                f"{np.dtype(value.dtype)} was pushed"
            )

    @staticmethod
    def _check_out(key: Hashable, meta: KeyMeta, out: Any) -> None:
        if tuple(out.shape) != meta.shape:
            raise OutShapeError(
                f"key {key!r} has shape {meta.shape}, but pull was given an out of shape {tuple(out.shape)}"
            )
        if np.dtype(out.dtype) != meta.dtype:
            raise DTypeMismatchError(
                f"key {key!r} has dtype {meta.dtype}, but pull was given an out of dtype {np.dtype(out.dtype)}"
            )
        if not getattr(getattr(out, "flags", None), "writeable", True):  # (a CuPy array has no such flag)
            raise ReadOnlyOutError(f"pull of key {key!r} was given a read-only out (shape {tuple(out.shape)}, dtype "
                                   f"{np.dtype(out.dtype)}): give an array it may write the value into")

    def _dense_value(self, key: Hashable, value: Any) -> Any:
        return value.todense() if isinstance(value, RowSparseArray) else value

    def _group_row_ids(self, key: Any, row_ids: Any, groups: list) -> list[list[Any]]:
        if is_key_list(key):
            if not isinstance(row_ids, (list, tuple)) or len(row_ids) != len(groups):
                raise ValueCountError(
                    f"row_sparse_pull of {len(groups)} keys needs a list of {len(groups)} row_ids"
                )
            return [list(r) if isinstance(r, (list, tuple)) and r and _is_id_array(r[0]) else [r] for r in row_ids]
        if isinstance(row_ids, (list, tuple)) and row_ids and _is_id_array(row_ids[0]):
            return [list(row_ids)]
        return [[row_ids]]

    def _updater_with_states(self, op: str) -> Updater:
        if not isinstance(self._updater, Updater):
            raise OptimizerError(
                f"cannot {op} optimizer states: no optimizer was set on this store (call set_optimizer first)"
            )
        return self._updater


def _is_id_array(value: Any) -> bool:
    return arrays.is_array(value) or isinstance(value, (list, tuple))


def _write_rows(out: Any, rows: np.ndarray, data: Any) -> None:
    if isinstance(out, RowSparseArray):
        out.indices = rows.copy()
        out.data = arrays.to_device(data, arrays.device_of(out.data) if out.data is not None else arrays.cpu())
        return
    home = arrays.device_of(out)
    # the index, the fill and the scatter all run on out's device, whichever is current
    with arrays.device_context(home):
        out[...] = 0
        if rows.size:
            index = arrays.to_device(rows, home)
            if arrays.device_of(data) != home:
                data = arrays.to_device(data, home)
            out[index] = data


def _first_argument(args: tuple) -> Any:
    """The key (or keys) of a traced API call: its first argument."""
    return args[0] if args else None
