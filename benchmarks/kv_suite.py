"""The KVStore measurement suite every benchmark worker runs, whatever store it drives.

The same rounds, shapes and timers run against pslaunch's ``dist_sync`` store and MXNet's, so their
figures compare like for like. The store is reached through a small adapter (``KVAdapter``); this
module imports nothing but the standard library, because it also runs inside MXNet's own virtual
environment (old numpy, no pslaunch).

Every worker of a job runs the same plan with the same round counts: in ``dist_sync`` a round only
completes once every worker has pushed, so unequal counts would leave a worker waiting forever.
Warm-up rounds run first and are not timed; a barrier separates warm-up from the timed rounds so the
workers start timing together.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

__all__ = ["KVAdapter", "Plan", "run_suite", "emit_result", "RESULT_PREFIX", "BIG_KEY_BASE", "SMALL_KEY", "MANY_KEY_BASE"]

RESULT_PREFIX = "RESULT "
"""A worker prints one line ``RESULT <json>`` on stdout; the driver reads it from the log."""

BIG_KEY_BASE = 100
SMALL_KEY = 7
MANY_KEY_BASE = 1000


@dataclass(frozen=True)
class Plan:
    """What one worker measures: sizes in bytes of float32 keys and the round counts.

    ``big_rounds`` has one timed-round count per entry of ``sizes``.
    """

    sizes: list[int]
    big_rounds: list[int]
    big_warmup: int = 3
    small_rounds: int = 300
    small_warmup: int = 20
    many_keys: int = 1000
    many_rounds: int = 15
    many_warmup: int = 3

    def to_json(self) -> str:
        """The plan as a JSON string, to pass on a worker's argv."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The inverse of ``to_json``."""
        return cls(**json.loads(text))


class KVAdapter(Protocol):
    """The handful of store operations the suite needs, in the store's own array type."""

    rank: int
    num_workers: int

    def ones(self, n: int) -> Any:
        """A float32 array of ``n`` ones."""

    def zeros(self, n: int) -> Any:
        """A float32 array of ``n`` zeros."""

    def init(self, key: Any, value: Any) -> None:
        """Initialise one key, or a list of keys with a list of values."""

    def push(self, key: Any, value: Any) -> None:
        """Push (may return before the data has left)."""

    def pull(self, key: Any, out: Any) -> None:
        """Pull into ``out``; returns once ``out`` holds the value."""

    def barrier(self) -> None:
        """Wait for every worker."""

    def first(self, arr: Any) -> float:
        """The first element of ``arr`` as a float (to check what was pulled)."""


@dataclass
class _Timings:
    rounds: list[float] = field(default_factory=list)
    push_calls: list[float] = field(default_factory=list)  # until push() returned: the caller's cost

    def summary(self, scale: float) -> dict[str, float]:
        s = sorted(self.rounds)
        return {
            "rounds": len(s),
            "median": statistics.median(s) * scale,
            "mean": statistics.mean(s) * scale,
            "min": s[0] * scale,
            "p90": s[min(len(s) - 1, int(0.9 * len(s)))] * scale,
            "push_call_median": statistics.median(self.push_calls) * scale,
        }


def _timed_rounds(kv: KVAdapter, warmup: int, rounds: int, key: Any, value: Any, out: Any) -> _Timings:
    """Warm-up rounds, a barrier, then ``rounds`` timed rounds of push(key, value) + pull(key, out)."""
    for _ in range(warmup):
        kv.push(key, value)
        kv.pull(key, out)
    kv.barrier()
    timings = _Timings()
    clock = time.perf_counter
    for _ in range(rounds):
        t = clock()
        kv.push(key, value)
        pushed = clock()
        kv.pull(key, out)
        end = clock()
        timings.rounds.append(end - t)
        timings.push_calls.append(pushed - t)
    return timings


def _bench_big(kv: KVAdapter, key: int, nbytes: int, warmup: int, rounds: int) -> dict[str, Any]:
    n = nbytes // 4
    value, out = kv.ones(n), kv.zeros(n)
    kv.init(key, value)
    summary = _timed_rounds(kv, warmup, rounds, key, value, out).summary(1e3)
    # push + pull moves the key's bytes twice per round through this worker
    summary["bytes_per_s"] = 2 * nbytes / (summary["median"] / 1e3)
    summary["pulled"] = kv.first(out)
    return {"unit": "ms", **summary}


def _bench_small(kv: KVAdapter, warmup: int, rounds: int) -> dict[str, Any]:
    value, out = kv.ones(4), kv.zeros(4)
    kv.init(SMALL_KEY, value)
    summary = _timed_rounds(kv, warmup, rounds, SMALL_KEY, value, out).summary(1e6)
    summary["pulled"] = kv.first(out)
    return {"unit": "us", **summary}


def _bench_many(kv: KVAdapter, count: int, warmup: int, rounds: int) -> dict[str, Any]:
    keys = list(range(MANY_KEY_BASE, MANY_KEY_BASE + count))
    values = [kv.ones(1) for _ in keys]
    outs = [kv.zeros(1) for _ in keys]
    kv.init(keys, values)
    summary = _timed_rounds(kv, warmup, rounds, keys, values, outs).summary(1e3)
    summary["pulled"] = kv.first(outs[-1])
    return {"unit": "ms", **summary}


def run_suite(kv: KVAdapter, plan: Plan) -> dict[str, Any]:
    """Run every measurement of ``plan``; returns ``{measure: summary}`` plus rank and worker count.

    Measures are named ``pushpull_<bytes>``, ``roundtrip_4elem`` and ``many_<count>x1float``; each
    summary holds the median / mean / min / p90 round time in its ``unit``, the median time until
    ``push`` returned (``push_call_median``: what the caller pays before the data is in flight) and
    what was pulled last.
    """
    result: dict[str, Any] = {"rank": kv.rank, "num_workers": kv.num_workers, "measures": {}}
    measures = result["measures"]
    # a measure with 0 timed rounds is left out (run.py --only, for profiling one path)
    for i, (nbytes, rounds) in enumerate(zip(plan.sizes, plan.big_rounds)):
        if rounds:
            measures[f"pushpull_{nbytes}"] = _bench_big(kv, BIG_KEY_BASE + i, nbytes, plan.big_warmup, rounds)
    if plan.small_rounds:
        measures["roundtrip_4elem"] = _bench_small(kv, plan.small_warmup, plan.small_rounds)
    if plan.many_rounds:
        measures[f"many_{plan.many_keys}x1float"] = _bench_many(kv, plan.many_keys, plan.many_warmup, plan.many_rounds)
    kv.barrier()
    return result


def emit_result(result: dict[str, Any]) -> None:
    """Print the one ``RESULT`` line the driver looks for."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
