"""What the allreduce benchmark's worker scripts share: timing a call after warm-up rounds.

Imported by ``allreduce_worker.py`` and ``gloo_worker.py``, which run as scripts (this folder is on
their ``sys.path``); standard library only, so the gloo worker needs nothing of pslaunch.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Callable

__all__ = ["timed", "bandwidth_measures"]


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


def bandwidth_measures(nbytes: int, workers: int, times: list[float], cpu: float) -> dict[str, dict]:
    """The two measures of one size: ``busbw_<nbytes>`` (the median call and the bus bandwidth,
    ``bytes / t * 2 (n - 1) / n``, NCCL's and gloo's convention) and ``cpu_<nbytes>`` (ms per call)."""
    median = statistics.median(times)
    return {f"busbw_{nbytes}": {"median_s": median, "busbw": nbytes / median * 2 * (workers - 1) / workers,
                                "rounds": len(times)},
            f"cpu_{nbytes}": {"median_ms": cpu * 1e3, "rounds": len(times)}}
