"""What the allreduce benchmark's worker scripts share: timing a call after warm-up rounds.

Imported by ``allreduce_worker.py`` and ``gloo_worker.py``, which run as scripts (this folder is on
their ``sys.path``); standard library only, so the gloo worker needs nothing of pslaunch.
"""

from __future__ import annotations

import resource
import time
from typing import Callable

__all__ = ["timed"]


def timed(call: Callable[[], None], rounds: int, warmup: int, barrier: Callable[[], None]) -> tuple[list[float], float]:
    """Run ``call`` ``warmup`` times, pass ``barrier``, then time ``rounds`` calls.

    Returns the seconds of each call and the CPU seconds per call this process spent over them
    (user and system, every thread: ZeroMQ's and gloo's I/O threads included). On a shared
    machine the CPU a collective costs moves far less than its wall time.
    """
    for _ in range(warmup):
        call()
    barrier()
    times = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return times, cpu / max(1, rounds)
