"""Stores by name: ``create('local')``. Distributed stores (``dist_*``, ``allreduce``) are named here and
imported from their own module on first use."""

from __future__ import annotations

import importlib
from typing import Callable

from ..errors import UnknownStoreError
from .base import KVStoreBase

__all__ = ["create", "register_store", "store_names"]

StoreFactory = Callable[[str], KVStoreBase]

_FACTORIES: dict[str, StoreFactory | str] = {}


def register_store(name: str, factory: StoreFactory | str) -> None:
    """Register ``factory(name) -> store`` under ``name``.

    ``factory`` may be a ``"module:function"`` string, imported on first use, so that naming a store
    costs nothing until it is created.
    """
    _FACTORIES[name] = factory


def store_names() -> list[str]:
    """Every name ``create`` accepts, sorted."""
    return sorted(_FACTORIES)


def create(name: str = "local") -> KVStoreBase:
    """Create a KVStore by name (MXNet's ``mx.kv.create``).

    Raises:
        UnknownStoreError: no store is registered under ``name``; the message lists the known names.
    """
    if not isinstance(name, str):
        raise UnknownStoreError(f"a store name must be a str, got {type(name).__name__}")
    factory = _FACTORIES.get(name)
    if factory is None:
        raise UnknownStoreError(f"unknown KVStore type {name!r}; known types: {', '.join(store_names())}")
    if isinstance(factory, str):
        module_name, _, func_name = factory.partition(":")
        factory = getattr(importlib.import_module(module_name), func_name)
        _FACTORIES[name] = factory
    return factory(name)


def _local_factory(name: str) -> KVStoreBase:
    from .local import LocalKVStore

    return LocalKVStore(name)


register_store("local", _local_factory)
register_store("device", _local_factory)
for _name in ("dist_sync", "dist_async", "dist_device_sync"):
    register_store(_name, "kvcore.stores.distributed:create")
register_store("allreduce", "kvcore.stores.allreduce:create")
