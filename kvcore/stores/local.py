"""The single-process stores: ``local`` (merge on the host) and ``device`` (merge where the values live)."""

from __future__ import annotations

import threading
from typing import Any, Hashable

import numpy as np

from .. import arrays
from ..handles import Handle, completed
from .base import KVStoreBase

__all__ = ["LocalKVStore"]


class LocalKVStore(KVStoreBase):
    """A KVStore inside one process.

    ``local``: the stored value and the merge buffer live on the host (numpy); values pushed from
    GPUs are copied to the host and summed there, as MXNet's ``local`` store does.

    ``device``: the stored value and the merge buffer live on a GPU when the values do (the device of
    the initial value, or of the first pushed value), so merging runs on the GPU through CuPy;
    without a GPU this is the same as ``local``.

    ``set_gradient_compression`` works on ``device`` only (as in MXNet): every pushed value, even a
    single one, is quantized with a residual kept per (key, list position) on the value's device,
    and the dequantized values are summed left to right.

    Every call completes before it returns (the handles it returns are already done);
    ``priority`` is accepted and has no effect here.
    """

    def __init__(self, store_type: str = "local") -> None:
        super().__init__(store_type)
        self._merge_on_device = store_type == "device"
        self._stored: dict[Hashable, Any] = {}
        self._merge_buffers: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def _home(self, value: Any) -> arrays.Device:
        """Where a key whose values look like ``value`` is stored and merged."""
        if self._merge_on_device:
            return arrays.device_of(value)
        return arrays.cpu()

    def _init_keys(self, pairs: list[tuple[Hashable, Any]]) -> None:
        with self._lock:
            for key, value in pairs:
                self._stored[key] = arrays.to_device(value, self._home(value), copy=True)

    def _merge_buffer(self, key: Hashable, first: Any) -> Any:
        """The key's merge buffer, where the stored value lives (made or moved as needed)."""
        stored = self._stored[key]
        home = arrays.device_of(stored)
        if self._merge_on_device and home != arrays.device_of(first) and not home.is_gpu:
            # A `device` store initialised from host data moves to the GPU its values come from.
            home = arrays.device_of(first)
            self._stored[key] = stored = arrays.to_device(stored, home)
            self._merge_buffers.pop(key, None)
        buffer = self._merge_buffers.get(key)
        if buffer is None or arrays.device_of(buffer) != home:
            buffer = arrays.empty(stored.shape, stored.dtype, home)
            self._merge_buffers[key] = buffer
        return buffer

    def _merge(self, key: Hashable, values: list[Any]) -> Any:
        """Sum ``values`` into the key's merge buffer, which lives where the stored value lives."""
        if self._compression is not None:
            return self._merge_compressed(key, values)
        buffer = self._merge_buffer(key, values[0])
        home = arrays.device_of(buffer)
        arrays.copy_into(buffer, values[0])
        if len(values) > 1:
            with arrays.device_context(home):
                for value in values[1:]:
                    if arrays.device_of(value) != home:
                        value = arrays.to_device(value, home)
                    buffer += value
        return buffer

    def _merge_compressed(self, key: Hashable, values: list[Any]) -> Any:
        """MXNet's compressed reduce: every value (even a single one) is quantized where it lives with
        the residual of its list position, then dequantized where the key lives and summed left to right."""
        buffer = self._merge_buffer(key, values[0])
        home = arrays.device_of(buffer)
        for position, value in enumerate(values):
            packed = self._compression.quantize((key, position), value)
            if arrays.device_of(packed) != home:
                packed = arrays.to_device(packed, home)
            self._compression.dequantize(packed, buffer, accumulate=position > 0)
        return buffer

    def _push_groups(self, groups: list[tuple[Hashable, list[Any]]], priority: int, copy: bool = True) -> Handle:
        with self._lock:
            for key, values in groups:
                merged = self._merge(key, values)
                stored = self._stored[key]
                with arrays.device_context(arrays.device_of(stored)):
                    if self._updater is None:
                        arrays.copy_into(stored, merged)
                    else:
                        self._updater(key, merged, stored)
        return completed(description="push")

    def _pull_groups(self, groups: list[tuple[Hashable, list[Any]]], priority: int) -> Handle:
        with self._lock:
            for key, outs in groups:
                stored = self._stored[key]
                for out in outs:
                    arrays.copy_into(out, stored)
        return completed(description="pull")

    def _pull_rows(self, requests: list[tuple[Hashable, np.ndarray]], priority: int) -> list[Any]:
        with self._lock:
            result = []
            for key, rows in requests:
                stored = self._stored[key]
                xp = arrays.array_module(stored)
                result.append(stored[xp.asarray(rows)].copy())
            return result

    def _state_device(self) -> arrays.Device:
        for value in self._stored.values():
            return arrays.device_of(value)
        return arrays.cpu()
