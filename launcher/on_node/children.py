"""Starting a process of the job on a node: the environment it inherits, and the pipe it writes to.

Used where pslaunch starts children itself (``launcher.backends.local``, the batch backends) and
where an actor does it for pslaunch on a Ray node (``ray_actor``). Standard library only.
"""

from __future__ import annotations

import fcntl
import os

import pscontract as ec

__all__ = ["child_environ", "widen_pipe", "READ_SIZE"]

# Inherited values of these would contradict the plan (a stale DMLC_WORKER_ID, say); a key file
# pslaunch's own environment names would make the runtime refuse the key pslaunch hands over.
_CONTRACT_NAMES = set(ec.WRITTEN) | {ec.DMLC_WORKER_ID, ec.PSLAUNCH_JOB_KEY_FILE}

#: Bytes a reader takes from a child's pipe at once.
READ_SIZE = 1 << 20
_F_SETPIPE_SZ = 1031  # Linux fcntl


def widen_pipe(fd: int, size: int = READ_SIZE) -> None:
    """Give a child's output pipe ``size`` bytes of buffer (Linux; 64 KiB otherwise): a chatty
    process then writes while the reader is busy, and each read takes more at once."""
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, size)
    except OSError:
        pass  # over /proc/sys/fs/pipe-max-size for this user: the default still works


def child_environ(env: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment (or ``base``) without stale contract variables, updated with ``env``."""
    out = {k: v for k, v in (os.environ if base is None else base).items() if k not in _CONTRACT_NAMES}
    out.update(env)
    return out
