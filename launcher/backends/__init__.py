"""Launcher backends, chosen by name: ``local``, ``ssh``, ``mpi``, ``slurm`` and ``sge``.

``get_backend(name)`` imports the backend's module only when it is used (paramiko is only loaded
for ``ssh``). ``register_backend`` adds one under a new name.
"""

from __future__ import annotations

import importlib

from ..errors import UnknownBackendError
from .base import Backend, ExitStatus, ProcessHandle

__all__ = ["Backend", "ExitStatus", "ProcessHandle", "register_backend", "get_backend", "known_backends"]

_REGISTRY: dict[str, str] = {
    "local": "launcher.backends.local:LocalBackend",
    "ssh": "launcher.backends.ssh:SshBackend",
    "mpi": "launcher.backends.mpi:MpiBackend",
    "slurm": "launcher.backends.slurm:SlurmBackend",
    "sge": "launcher.backends.sge.backend:SgeBackend",
}


def register_backend(name: str, target: str) -> None:
    """Register the backend class at ``"module:ClassName"`` under ``name`` (replacing any)."""
    _REGISTRY[name] = target


def known_backends() -> list[str]:
    """The registered backend names, sorted."""
    return sorted(_REGISTRY)


def get_backend(name: str) -> type[Backend]:
    """The backend class registered under ``name``. Raises ``UnknownBackendError`` listing the known ones."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise UnknownBackendError(
            f"unknown launcher backend {name!r}; known backends: {', '.join(known_backends())}"
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
