"""Launcher backends, chosen by name: ``local``, ``ssh``, ``mpi``, ``slurm``, ``sge``, ``ray`` (an
existing Ray cluster), and ``agents`` (``--nnodes``: one pslaunch per node, ``launcher.backends.agents``).

``get_backend(name)`` imports the backend's module only when it is used (paramiko is only loaded
for ``ssh``, Ray only for ``ray``). A new backend is its module (copy ``local``, the smallest: a
``Backend`` and its ``ProcessHandle`` from ``base``), its options (a group in ``launcher.config``,
rows in ``launcher.options``) and one more line in ``_BACKENDS``. ``batch`` and ``shim`` hold what
the mpi, slurm and sge backends share, ``checks`` what backends check on hosts before starting.
"""

from __future__ import annotations

import importlib

from ..errors import UnknownBackendError
from .base import Backend, ExitStatus, ProcessHandle

__all__ = ["Backend", "ExitStatus", "ProcessHandle", "get_backend", "known_backends", "default_backend"]

_BACKENDS: dict[str, str] = {
    "local": "launcher.backends.local:LocalBackend",
    "ssh": "launcher.backends.ssh.backend:SshBackend",
    "mpi": "launcher.backends.mpi:MpiBackend",
    "slurm": "launcher.backends.slurm:SlurmBackend",
    "sge": "launcher.backends.sge:SgeBackend",
    "ray": "launcher.backends.ray.backend:RayBackend",
    "agents": "launcher.backends.agents.backend:AgentsBackend",
}
#: Backends that ``--launcher`` does not choose: the per-node agents are what ``--nnodes`` selects.
_NOT_BY_FLAG = {"agents": "--nnodes N runs pslaunch as per-node agents"}


def default_backend(hosts: object) -> str:
    """The backend without ``--launcher``: ssh when a hostfile names hosts, local without."""
    return "ssh" if hosts else "local"


def known_backends() -> list[str]:
    """The names ``--launcher`` takes, sorted."""
    return sorted(name for name in _BACKENDS if name not in _NOT_BY_FLAG)


def get_backend(name: str) -> type[Backend]:
    """The backend class called ``name``. Raises ``UnknownBackendError`` listing the known ones."""
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(
            f"unknown launcher backend {name!r}; --launcher takes {', '.join(known_backends())} ("
            + "; ".join(_NOT_BY_FLAG.values()) + ")"
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
