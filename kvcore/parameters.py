"""Parameters for the Trainer and the collectives: the replicas of each, where its gradients are,
and every form a caller may pass them in (dicts, lists, PyTorch modules and tensors).

``Parameter`` holds one parameter's replicas (one array per device) and its gradient source;
``normalise_params`` turns the accepted forms into a list of them with unique names (PyTorch
through ``kvcore.torch_adapter``, imported only then); ``from_framework`` views a PyTorch CPU tensor
as a numpy array.
"""

from __future__ import annotations

from typing import Any, Mapping

from . import arrays

__all__ = ["Parameter", "GradSource", "normalise_params", "from_framework", "as_list"]

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
        self.source: Any = None
        """The framework tensor this parameter views (PyTorch), whose gradient hooks the Trainer uses."""
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
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _is_torch(value: Any) -> bool:
    return type(value).__module__.split(".", 1)[0] == "torch"


def from_framework(value: Any, name: str) -> Any:
    """A framework tensor as an array (PyTorch CPU tensors become numpy views); arrays unchanged."""
    if _is_torch(value):
        from .torch_adapter import tensor_as_array

        return tensor_as_array(value, f"the gradient of {name!r}")
    return value


def _torch_parameters(params: Any) -> list[Parameter]:
    """PyTorch parameters as Parameters whose data and gradient are numpy views of the tensors
    (``kvcore.torch_adapter``, imported only now: torch is optional)."""
    from .torch_adapter import torch_views

    result = []
    for name, data, grad, tensor in torch_views(params):
        param = Parameter(name, data, grad=grad)
        param.source = tensor
        result.append(param)
    return result


def normalise_params(params: Any) -> list[Parameter]:
    """Accepted parameter forms -> a list of Parameters with unique names."""
    if hasattr(params, "named_parameters") or _is_torch(params):
        result = _torch_parameters(params)
    elif isinstance(params, Mapping):
        result = [_as_parameter(name, value) for name, value in params.items()]
    else:
        items = list(params)
        if items and (_is_torch(items[0]) or (isinstance(items[0], tuple) and len(items[0]) == 2
                                              and isinstance(items[0][0], str) and _is_torch(items[0][1]))):
            result = _torch_parameters(items)
        else:
            result = [v if isinstance(v, Parameter) else _as_parameter(str(i), v) for i, v in enumerate(items)]
    if not result:
        raise ValueError("the Trainer was given no parameters")
    seen: set[str] = set()
    for p in result:
        if p.name in seen:
            raise ValueError(f"two parameters are named {p.name!r}; names are the store's keys and must be unique")
        seen.add(p.name)
    return result


def _as_parameter(name: str, value: Any) -> Parameter:
    if isinstance(value, Parameter):
        if value.name != str(name):
            raise ValueError(f"parameter {value.name!r} was given under the name {name!r}")
        return value
    for replica in as_list(value):
        if not arrays.is_array(replica):
            raise TypeError(
                f"parameter {name!r} must be a numpy or CuPy array (or a list of them), got {type(replica).__name__}"
            )
    return Parameter(name, value)
