"""Errors raised by the launcher.

Every error the user can cause or meet carries the exit code pslaunch ends with; ``launcher.cli``
prints them in one place (one line, no traceback)::

    LaunchError                    exit_code 1 unless a subclass says otherwise
    ├── ConfigError                2  bad flags or values (names the flag and the value)
    │   ├── HostfileError          2  a hostfile line that is not ``[user@]host[:port] [slots=N]``
    │   ├── PlacementError         2  more workers than the hostfile has slots, ...
    │   └── UnknownBackendError    2  ``--launcher NAME`` that no backend is registered under
    ├── PreflightError             3  one or more hosts cannot be reached / logged into
    ├── SyncError                  4  rsync to a host failed (names host and rsync's message)
    ├── SpawnError                 5  a process could not be started (missing program, ...)
    └── JobFailed                  the job failed: exit code of the first failing process,
                                   128+signal for a signal, 124 on --timeout, 130/143 when
                                   pslaunch itself got SIGINT / SIGTERM

Messages never contain values passed with ``--env``: they may be secrets.
"""

from __future__ import annotations

__all__ = [
    "LaunchError",
    "ConfigError",
    "HostfileError",
    "PlacementError",
    "UnknownBackendError",
    "PreflightError",
    "SyncError",
    "SpawnError",
    "JobFailed",
]


class LaunchError(Exception):
    """Base of every error the launcher raises on purpose; ``exit_code`` is what pslaunch exits with."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(LaunchError):
    """A flag, its value or a combination of flags cannot be used."""

    exit_code = 2


class HostfileError(ConfigError):
    """A hostfile line does not parse; the message names file, line number, text and what was expected."""


class PlacementError(ConfigError):
    """The processes cannot be placed on the hosts given (for example too few slots)."""


class UnknownBackendError(ConfigError):
    """``--launcher`` named a backend that is not registered; the message lists the known ones."""


class PreflightError(LaunchError):
    """The pre-flight check failed for at least one host; the message has one line per failing host."""

    exit_code = 3


class SyncError(LaunchError):
    """rsync to a host failed; the message names the host, rsync's exit code and its message."""

    exit_code = 4


class SpawnError(LaunchError):
    """A process of the job could not be started at all."""

    exit_code = 5


class JobFailed(LaunchError):
    """The job ran and failed (``RunResult.check()`` raises it): its message is the root cause, and
    ``result`` the whole ``launcher.api.RunResult``."""
