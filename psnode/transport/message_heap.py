"""Message memory that stays mapped: the data path without page faults (glibc's malloc only).

ZeroMQ receives each message (a pushed gradient, a ring segment) into memory it mallocs and frees
once the message was used. glibc's defaults give such memory back to the kernel: a block of 128 KiB
or more gets an mmap of its own until the first one is freed, and after that a heap is trimmed back
as soon as twice the last such block lies free at its top. With several segments in flight the top
is free again after every round, so the next round's messages fault every page in again and the
kernel zeroes each one: on the TCP ring that was about 8 % of a worker's CPU (``perf``:
``exc_page_fault``, ``clear_page_erms`` in ZeroMQ's I/O thread), and 10 to 15 % of the CPU of a
64 MiB allreduce came back with this module (docs/benchmarks.md).

A server or worker calls it (``psnode.node.connection.Connection``) where big messages may come through
ZeroMQ: a job over several hosts, or ``PSLAUNCH_SAME_HOST`` ``ipc`` / ``tcp``. Not in a job on one
host with the shared-memory path, where big values never travel as messages: there the tuning would
only change how the training script's own allocations behave (the training step measured with it
was within the run-to-run spread, perhaps a few per cent slower, docs/benchmarks.md).

``keep_message_memory()`` sets glibc's mmap threshold to its maximum (32 MiB on 64-bit: blocks
up to that size come from the heaps) and the trim threshold to ``TRIM_BYTES``: a process keeps up to
that much freed memory at the top of each heap for the next messages instead of returning it. It
does so once per process, and not at all where the user chose (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or ``MALLOC_ARENA_MAX`` in the environment), where
``PSLAUNCH_MALLOC_TUNING=off`` says so (``psnode.env``), or off glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

from psnode.log import logger

__all__ = ["keep_message_memory", "MMAP_BYTES", "TRIM_BYTES", "USER_SETTINGS"]

MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_BYTES = 32 << 20  # freed memory kept at the top of a heap
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_done: bool | None = None  # the outcome of the first call


def keep_message_memory() -> bool:
    """Tune glibc's malloc as the module docstring says (once per process); True when it is tuned."""
    global _done
    with _lock:
        if _done is None:
            _done = _tune()
        return _done


def _tune() -> bool:
    chosen = [name for name in USER_SETTINGS if name in os.environ]
    if chosen:
        logger.info("malloc left as the environment sets it (%s)", ", ".join(chosen))
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES) == 1
