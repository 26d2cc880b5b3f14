"""What the allreduce benchmark's worker scripts share: timing a call after warm-up rounds.

Imported by ``allreduce_worker.py`` and ``gloo_worker.py``, which run as scripts (this folder is on
their ``sys.path``); standard library only, so the gloo worker needs nothing of pslaunch.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["timed"]


def timed(call: Callable[[], None], rounds: int, warmup: int, barrier: Callable[[], None]) -> list[float]:
    """Run ``call`` ``warmup`` times, pass ``barrier``, then time ``rounds`` calls; the seconds of each."""
    for _ in range(warmup):
        call()
    barrier()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times
