"""A model parameter as the Trainer sees it: its replicas (one array per device) and its gradients."""

from __future__ import annotations

from typing import Any

from . import arrays

__all__ = ["Parameter", "GradSource", "as_list"]

GradSource = Any
"""An array, a list of arrays (one per replica), a callable returning either, or None."""


class Parameter:
    """One trainable parameter: its replicas (one array per device) and where its gradients are.

    Args:
        name: the parameter's name; the Trainer uses it as the parameter's key in the store.
        data: an array, or a list of arrays of one shape and dtype, one per device. The Trainer
            writes new weights into these arrays in place.
        grad: the gradients: an array, a list (one per replica), a callable returning either (read
            at every step, for frameworks that replace their gradient arrays), or None when the
            gradients are passed to ``Trainer.step`` instead.

    Raises:
        ValueError: no replicas, or replicas of different shapes or dtypes (naming them).
    """

    def __init__(self, name: str, data: Any, grad: GradSource = None) -> None:
        self.name = str(name)
        self._data = as_list(data)
        if not self._data:
            raise ValueError(f"parameter {self.name!r} has no data arrays")
        first = self._data[0]
        for i, replica in enumerate(self._data[1:], start=1):
            if tuple(replica.shape) != tuple(first.shape) or replica.dtype != first.dtype:
                raise ValueError(
                    f"parameter {self.name!r}: replica {i} has shape {tuple(replica.shape)} and dtype "
                    f"{replica.dtype}, but replica 0 has shape {tuple(first.shape)} and dtype {first.dtype}"
                )
        self._grad = grad

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's shape."""
        return tuple(self._data[0].shape)

    def list_data(self) -> list[Any]:
        """The replicas, one array per device."""
        return list(self._data)

    def list_grad(self) -> list[Any] | None:
        """The gradients, one array per replica, or None when this parameter carries none."""
        grad = self._grad() if callable(self._grad) else self._grad
        return None if grad is None else as_list(grad)

    def __repr__(self) -> str:
        devices = ", ".join(str(arrays.device_of(d)) for d in self._data)
        return f"Parameter({self.name!r}, shape={self.shape}, devices=[{devices}])"


def as_list(value: Any) -> list[Any]:
    """``value`` as a list: a list or tuple's items, or ``[value]``."""
    return list(value) if isinstance(value, (list, tuple)) else [value]
