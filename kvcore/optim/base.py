"""The optimizer interface, the registry of optimizers by name, and the per-key ``Updater``.

An optimizer is written once against the array API that numpy and CuPy share: every operation is
an in-place arithmetic update on the weight and state arrays, so the same code runs where the arrays
live (host or GPU). Optimizers are plain picklable objects; the distributed store ships them to the
servers that way.
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any, Callable, Hashable

import numpy as np

from .. import arrays
from ..errors import OptimizerError

__all__ = ["Optimizer", "Updater", "register", "create", "registered_names", "get_updater"]

_REGISTRY: dict[str, type["Optimizer"]] = {}


def register(cls: type["Optimizer"]) -> type["Optimizer"]:
    """Class decorator: make ``cls`` available to ``create`` under its lower-cased class name."""
    _REGISTRY[cls.__name__.lower()] = cls
    return cls


def registered_names() -> list[str]:
    """The names ``create`` accepts, sorted."""
    return sorted(_REGISTRY)


def create(name: str, **kwargs: Any) -> "Optimizer":
    """Create an optimizer by name (case-insensitive), e.g. ``create('sgd', learning_rate=0.1)``.

    Raises:
        OptimizerError: no optimizer is registered under ``name``; the message lists the known ones.
    """
    cls = _REGISTRY.get(str(name).lower())
    if cls is None:
        raise OptimizerError(
            f"unknown optimizer {name!r}; known optimizers: {', '.join(registered_names())}"
        )
    return cls(**kwargs)


class Optimizer:
    """Base of every optimizer.

    Args:
        learning_rate: step size.
        wd: weight decay (L2), added to the gradient as ``wd * weight``.
        rescale_grad: factor every incoming gradient is multiplied by first (typically 1/batch).
        clip_gradient: when set, the rescaled gradient is clipped to [-clip, clip].
        lr_scheduler: optional callable ``num_update -> learning_rate``.

    Subclasses implement ``create_state`` and ``update``; both receive arrays that live on the same
    device and must update ``weight`` (and the state) in place.
    """

    def __init__(
        self,
        learning_rate: float = 0.01,
        wd: float = 0.0,
        rescale_grad: float = 1.0,
        clip_gradient: float | None = None,
        lr_scheduler: Callable[[int], float] | None = None,
    ) -> None:
        self.learning_rate = float(learning_rate)
        self.wd = float(wd)
        self.rescale_grad = float(rescale_grad)
        self.clip_gradient = None if clip_gradient is None else float(clip_gradient)
        self.lr_scheduler = lr_scheduler
        self.num_update = 0
        self._key_updates: dict[Hashable, int] = {}

    def create_state(self, key: Hashable, weight: Any) -> Any:
        """Return the per-key state for ``weight`` (None when the optimizer keeps none)."""
        return None

    def update(self, key: Hashable, weight: Any, grad: Any, state: Any) -> None:
        """Apply one step to ``weight`` in place from ``grad`` (which it may overwrite)."""
        raise NotImplementedError

    def _count_update(self, key: Hashable) -> int:
        """Count one more update of ``key``; return how many ``key`` has had (1 on the first)."""
        count = self._key_updates.get(key, 0) + 1
        self._key_updates[key] = count
        self.num_update = max(self.num_update, count)
        return count

    def _current_lr(self) -> float:
        if self.lr_scheduler is not None:
            return float(self.lr_scheduler(self.num_update))
        return self.learning_rate

    def _prepare_grad(self, weight: Any, grad: Any) -> Any:
        """Rescale, clip and add weight decay, in place on ``grad``; returns ``grad``."""
        xp = arrays.array_module(grad)
        if self.rescale_grad != 1.0:
            grad *= grad.dtype.type(self.rescale_grad)
        if self.clip_gradient is not None:
            xp.clip(grad, -self.clip_gradient, self.clip_gradient, out=grad)
        if self.wd:
            grad += weight * weight.dtype.type(self.wd)
        return grad

    def _scaled_grad(self, weight: Any, grad: Any, factor: float) -> Any:
        """``factor`` times the prepared gradient (``_prepare_grad``), in place on ``grad``; returns ``grad``.

        In place because a temporary the size of the gradient costs more than the arithmetic (an
        allocation that faults in fresh pages: SGD's ``weight -= lr * grad`` took twice the time of
        two in-place passes). When nothing lies between the two products (no clipping, no weight
        decay) and ``rescale_grad`` is a power of two (``1 / num_workers`` for 2 or 4 workers),
        rescaling and ``factor`` are one pass with the same bits: a power of two rounds nothing.
        """
        scalar = grad.dtype.type
        rescale = self.rescale_grad
        if self.clip_gradient is None and not self.wd and math.frexp(rescale)[0] == 0.5:
            grad *= scalar(rescale * factor)
            return grad
        grad = self._prepare_grad(weight, grad)
        grad *= scalar(factor)
        return grad

    def __repr__(self) -> str:
        return f"{type(self).__name__}(learning_rate={self.learning_rate}, wd={self.wd}, rescale_grad={self.rescale_grad})"


class Updater:
    """Applies an optimizer per key, keeping each key's state: ``updater(key, grad, weight)``.

    This is the callable a store installs with ``set_updater`` when ``set_optimizer`` is used.
    ``get_states``/``set_states`` serialise the states (moved to the host) so that they survive a
    save and load, also between a GPU and a CPU process.

    Not thread-safe: one store calls it from one thread at a time.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise OptimizerError(
                f"an Optimizer instance is required, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.states: dict[Hashable, Any] = {}

    def __call__(self, key: Hashable, grad: Any, weight: Any) -> None:
        if key not in self.states:
            self.states[key] = self.optimizer.create_state(key, weight)
        self.optimizer.update(key, weight, grad, self.states[key])

    def get_states(self, dump_optimizer: bool = False) -> bytes:
        """Serialise the per-key states (and the optimizer itself when ``dump_optimizer``)."""
        host_states = {key: _map_arrays(state, arrays.asnumpy) for key, state in self.states.items()}
        payload = {"states": host_states, "key_updates": dict(self.optimizer._key_updates)}
        if dump_optimizer:
            payload["optimizer"] = self.optimizer
        buffer = io.BytesIO()
        pickle.dump(payload, buffer, protocol=pickle.HIGHEST_PROTOCOL)
        return buffer.getvalue()

    def set_states(self, blob: bytes, device: "arrays.Device | None" = None) -> None:
        """Restore states written by ``get_states``, placing arrays on ``device`` (host by default)."""
        payload = pickle.loads(blob)
        if "optimizer" in payload:
            self.optimizer = payload["optimizer"]
        target = device or arrays.cpu()
        self.states = {
            key: _map_arrays(state, lambda a: arrays.to_device(a, target))
            for key, state in payload["states"].items()
        }
        self.optimizer._key_updates = dict(payload.get("key_updates", {}))
        self.optimizer.num_update = max(self.optimizer._key_updates.values(), default=0)


    # ---- the servers' checkpoint protocol (psnode.server.checkpoints) ------------------------------
    def state_dict(self) -> dict:
        """Every key's state for a checkpoint: ``{"scalars": {...}, "keys": {key: {"scalars": {...},
        "arrays": [array, ...]}}}``. A key's arrays are its state's arrays in order (element-wise, shaped
        like its weight); its scalars say how they nest and how many updates the key had.

        Raises:
            TypeError: a state holds something other than arrays, numbers, tuples and lists.
        """
        counts = self.optimizer._key_updates
        keys: dict[Hashable, dict] = {}
        for key in list(self.states) + [k for k in counts if k not in self.states]:
            arrays: list[Any] = []
            form = _form_of(self.states.get(key), arrays, key) if key in self.states else "absent"
            keys[key] = {"scalars": {"form": form, "updates": counts.get(key, 0)}, "arrays": arrays}
        return {"scalars": {"num_update": self.optimizer.num_update}, "keys": keys}

    def load_state_dict(self, state: dict) -> None:
        """Take back what ``state_dict`` gave (its arrays already where the weights live)."""
        for key, item in state.get("keys", {}).items():
            scalars = item.get("scalars") or {}
            arrays = list(item.get("arrays", []))
            form = scalars.get("form", "absent")
            if form != "absent":
                self.states[key] = _from_form(form, arrays)
            if scalars.get("updates"):
                self.optimizer._key_updates[key] = int(scalars["updates"])
        self.optimizer.num_update = max(self.optimizer._key_updates.values(), default=0)


def _form_of(state: Any, arrays: list, key: Hashable) -> Any:
    """How ``state`` nests, as JSON; its arrays are appended to ``arrays`` in order."""
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        return ["tuple" if isinstance(state, tuple) else "list", [_form_of(s, arrays, key) for s in state]]
    if _is_array(state):
        arrays.append(state)
        return "array"
    if isinstance(state, (bool, int, float, str)):
        return ["value", state]
    raise TypeError(f"the optimizer state of key {key!r} holds a {type(state).__name__}, which a checkpoint cannot "
                    "hold (arrays, numbers, tuples and lists can be)")


def _from_form(form: Any, arrays: list) -> Any:
    """The state ``_form_of`` described, taking its arrays from the front of ``arrays``."""
    if form is None:
        return None
    if form == "array":
        return arrays.pop(0)
    kind, inner = form
    if kind == "value":
        return inner
    items = [_from_form(f, arrays) for f in inner]
    return tuple(items) if kind == "tuple" else items


def _is_array(value: Any) -> bool:
    """True for a numpy or CuPy array."""
    return isinstance(value, np.ndarray) or arrays.is_array(value)


def get_updater(optimizer: Optimizer) -> Updater:
    """Return an ``Updater`` for ``optimizer`` (MXNet's ``mx.optimizer.get_updater``)."""
    return Updater(optimizer)


def _map_arrays(state: Any, fn: Callable[[Any], Any]) -> Any:
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        return type(state)(_map_arrays(item, fn) for item in state)
    if isinstance(state, dict):
        return {k: _map_arrays(v, fn) for k, v in state.items()}
    if arrays.is_array(state) or isinstance(state, np.ndarray):
        return fn(state)
    return state
