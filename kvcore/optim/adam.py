"""Adam (Kingma & Ba), with MXNet's bias correction folded into the learning rate."""

from __future__ import annotations

import math
from typing import Any, Hashable

from .. import arrays
from .base import Optimizer, register

__all__ = ["Adam"]


@register
class Adam(Optimizer):
    """Adam: ``m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2; w -= lr_t * m / (sqrt(v) + eps)``.

    ``lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)`` where ``t`` counts this key's updates.
    """

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.epsilon = float(epsilon)

    def create_state(self, key: Hashable, weight: Any) -> Any:
        device = arrays.device_of(weight)
        return (
            arrays.zeros(weight.shape, weight.dtype, device),
            arrays.zeros(weight.shape, weight.dtype, device),
        )

    def update(self, key: Hashable, weight: Any, grad: Any, state: Any) -> None:
        t = self._count_update(key)
        xp = arrays.array_module(weight)
        scalar = weight.dtype.type
        lr_t = self._current_lr() * math.sqrt(1.0 - self.beta2**t) / (1.0 - self.beta1**t)
        grad = self._prepare_grad(weight, grad)
        mean, var = state
        mean *= scalar(self.beta1)
        mean += scalar(1.0 - self.beta1) * grad
        var *= scalar(self.beta2)
        var += scalar(1.0 - self.beta2) * grad * grad
        weight -= scalar(lr_t) * mean / (xp.sqrt(var) + scalar(self.epsilon))
