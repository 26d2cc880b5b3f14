"""Server-side updates: the ``ModelUpdater`` users subclass, and the adapters that run it.

With ``update_on_server=1`` devices push gradients and pull weights. The weights live where the
updater runs: in the process for a 'local' model (on the first device), on the parameter servers
for a 'dist' model. Either way the updater sees the same two calls:

* ``init_model(key, data)``, once per key, with ``data`` the array that holds the key's weights
  there (zeros at first). Change it in place to choose other starting weights; keep any per-key
  state you need.
* ``update(key, grad)``, once per merged push, with the gradient summed over every device (and,
  for 'dist', over whichever workers' pushes the server merged). Change ``self.weight(key)`` in
  place.

A 'dist' model pickles its updater and ships it to every server, so a subclass must be a
module-level class with picklable attributes. A class defined in the training script itself
(``__main__``) works too: the servers load that script file as a module (its ``if __name__ ==
"__main__":`` part does not run) to find the class, so the script must exist at the same path on the
servers' hosts. When the runtime splits a big key across servers, each server sees its shard:
``data``, ``grad`` and ``self.weight(key)`` are then flat 1-D arrays.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from typing import Any, Hashable

from .. import arrays
from ..errors import OptimizerError

__all__ = ["ModelUpdater", "ServerUpdater", "SumUpdater"]


class ModelUpdater:
    """Base class of updaters that apply merged gradients to the model where the weights live.

    Subclass it and implement ``update``; override ``init_model`` to choose the starting weights.
    Not thread-safe by itself: the model calls it from one thread at a time.
    """

    def init_model(self, key: Hashable, data: Any) -> None:
        """Called once per key with ``data``, the key's weights (zeros); may change them in place."""

    def update(self, key: Hashable, grad: Any) -> None:
        """Apply ``grad`` to ``self.weight(key)`` in place."""
        raise NotImplementedError(f"{type(self).__name__} must implement update(key, grad)")

    def weight(self, key: Hashable) -> Any:
        """The array that holds ``key``'s weights where this updater runs.

        Raises:
            KeyError: ``key`` was never initialised here.
        """
        weights = self.__dict__.get("_weights", {})
        if key not in weights:
            raise KeyError(f"no weights for key {key!r} here; init_model({key!r}, ...) has not run")
        return weights[key]

    def _bind(self, key: Hashable, weight: Any) -> None:
        # Kept in the instance dict under a private name so subclasses need not call __init__.
        self.__dict__.setdefault("_weights", {})[key] = weight

    def _bound(self, key: Hashable) -> Any:
        return self.__dict__.get("_weights", {}).get(key)


class SumUpdater(ModelUpdater):
    """Adds every merged push to the weights: after n rounds a key holds the sum of all pushes."""

    def update(self, key: Hashable, grad: Any) -> None:
        """``weight += grad``, in place (no temporary array)."""
        weight = self.weight(key)
        weight += grad


class ServerUpdater:
    """Runs a ``ModelUpdater`` inside a distributed KVStore's servers.

    It speaks the store's updater protocol: the server keeps each key's ``stored`` array, calls
    ``init_key(key, value)`` when the key is created and ``updater(key, merged, stored)`` on every
    merged push. This adapter binds ``stored`` as the updater's weights and forwards to
    ``init_model`` / ``update``.

    Picklable whenever the wrapped ``ModelUpdater`` is.
    """

    def __init__(self, model_updater: ModelUpdater) -> None:
        self.model_updater = model_updater
        self._fresh: set[Hashable] = set()

    def __reduce__(self) -> tuple:
        cls = type(self.model_updater)
        if cls.__module__ != "__main__":
            return (ServerUpdater, (self.model_updater,))
        # A server's __main__ is not the training script, so pickle's by-name lookup would fail
        # there: ship the script's path and the class name, and the attributes by value.
        script = getattr(sys.modules["__main__"], "__file__", None)
        if not script:
            raise OptimizerError(
                f"the updater class {cls.__qualname__} is defined in an interactive session, so the servers "
                "cannot load it; define it in a module or a script file"
            )
        state = {k: v for k, v in self.model_updater.__dict__.items() if k != "_weights"}
        return (_from_script, (os.path.abspath(script), cls.__qualname__, state))

    def init_key(self, key: Hashable, value: Any) -> None:
        """The server created ``key`` holding ``value``: let the updater set the starting weights."""
        self.model_updater._bind(key, value)
        with arrays.device_context(arrays.device_of(value)):
            self.model_updater.init_model(key, value)
        self._fresh.add(key)

    def restore_key(self, key: Hashable, value: Any) -> None:
        """The server restored ``key`` from a checkpoint: bind ``value`` as its weights, which
        ``init_model`` must not change."""
        self.model_updater._bind(key, value)
        self._fresh.discard(key)

    def state_dict(self) -> dict:
        """The model updater's ``state_dict()`` when it has one (the servers' checkpoint protocol),
        else nothing: the weights themselves are checkpointed by the servers."""
        dump = getattr(self.model_updater, "state_dict", None)
        return dump() if dump is not None else {"scalars": None, "keys": {}}

    def load_state_dict(self, state: dict) -> None:
        """Hand a checkpoint's state to the model updater's ``load_state_dict``, when it has one."""
        load = getattr(self.model_updater, "load_state_dict", None)
        if load is not None:
            load(state)

    def __call__(self, key: Hashable, merged: Any, stored: Any) -> None:
        updater = self.model_updater
        bound = updater._bound(key)
        if bound is None:
            # A server that never called init_key: the first update initialises the key.
            updater._bind(key, stored)
            updater.init_model(key, stored)
        elif bound is not stored:
            if key in self._fresh and bound.shape == stored.shape:
                # init_key was handed a copy: carry init_model's starting weights over once.
                arrays.copy_into(stored, bound)
            updater._bind(key, stored)
        self._fresh.discard(key)
        with arrays.device_context(arrays.device_of(stored)):
            updater.update(key, merged)


_script_lock = threading.Lock()


def _from_script(path: str, qualname: str, state: dict) -> ServerUpdater:
    """Rebuild a ``ServerUpdater`` around a ``ModelUpdater`` class defined in the script ``path``."""
    name = "_pslaunch_script_" + "".join(c if c.isalnum() else "_" for c in path)
    with _script_lock:
        module = sys.modules.get(name)
        if module is None:
            if not os.path.isfile(path):
                raise OptimizerError(
                    f"the updater class {qualname} comes from the script {path}, which does not exist on this "
                    "host; put the script at the same path on every host, or define the class in an installed module"
                )
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
    cls: Any = module
    for part in qualname.split("."):
        cls = getattr(cls, part)
    updater = cls.__new__(cls)
    updater.__dict__.update(state)
    return ServerUpdater(updater)
