"""Stochastic gradient descent with optional momentum (MXNet's ``SGD`` rule)."""

from __future__ import annotations

from typing import Any, Hashable

from .. import arrays
from .base import Optimizer, register

__all__ = ["SGD"]


@register
class SGD(Optimizer):
    """SGD: ``mom = momentum*mom - lr*grad; weight += mom`` (plain ``weight -= lr*grad`` without momentum).

    The gradient is first rescaled, clipped and given weight decay (see ``Optimizer``).
    """

    def __init__(self, momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = float(momentum)

    def create_state(self, key: Hashable, weight: Any) -> Any:
        if self.momentum == 0.0:
            return None
        return arrays.zeros(weight.shape, weight.dtype, arrays.device_of(weight))

    def update(self, key: Hashable, weight: Any, grad: Any, state: Any) -> None:
        self._count_update(key)
        step = self._scaled_grad(weight, grad, self._current_lr())  # lr * grad, in place on grad
        if state is None:
            weight -= step
            return
        state *= weight.dtype.type(self.momentum)
        state -= step
        weight += state
