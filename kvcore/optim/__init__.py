"""Optimizers that run inside a KVStore (locally, or on the servers of a distributed store).

``create(name, **kwargs)`` builds one by name: ``sgd``, ``adam``, ``test``. A user-defined optimizer
subclasses ``Optimizer`` and registers itself with ``@register``.
"""

from .adam import Adam
from .additive import Test
from .base import Optimizer, Updater, create, get_updater, register, registered_names
from .sgd import SGD

__all__ = [
    "Optimizer",
    "Updater",
    "SGD",
    "Adam",
    "Test",
    "create",
    "register",
    "registered_names",
    "get_updater",
]
