"""The ``Test`` optimizer (MXNet's name for it): ``weight += rescale_grad * grad``, the additive rule whose
sums distributed tests check exactly."""

from __future__ import annotations

from typing import Any, Hashable

from .base import Optimizer, register

__all__ = ["Test"]


@register
class Test(Optimizer):
    """``weight += rescale_grad * grad``: every push is added exactly, so results are predictable.

    Named after MXNet's ``mx.optimizer.Test``, which distributed KVStore tests use the same way.
    """

    __test__ = False  # not a pytest test class

    def update(self, key: Hashable, weight: Any, grad: Any, state: Any) -> None:
        self._count_update(key)
        weight += grad * weight.dtype.type(self.rescale_grad)
