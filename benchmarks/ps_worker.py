"""Benchmark worker for pslaunch's ``dist_sync`` KVStore.

Run by ``benchmarks/run.py`` under the DMLC_* variables of docs/env.md; argv[1] is the
``kv_suite.Plan`` as JSON. Prints one ``RESULT`` line. With ``PSLAUNCH_BENCH_PROFILE=<path>`` set,
the whole suite runs under cProfile and the stats are written to ``<path>.rank<r>``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import kv_suite
import kvcore


class PslaunchAdapter:
    """``kv_suite.KVAdapter`` over ``kvcore.create('dist_sync')`` with numpy arrays."""

    def __init__(self) -> None:
        self._kv = kvcore.create("dist_sync")
        self.rank = self._kv.rank
        self.num_workers = self._kv.num_workers

    def ones(self, n):
        return np.ones((n,), dtype=np.float32)

    def zeros(self, n):
        return np.zeros((n,), dtype=np.float32)

    def init(self, key, value):
        self._kv.init(key, value)

    def push(self, key, value):
        self._kv.push(key, value)

    def pull(self, key, out):
        # pull(wait=True) returns once every out holds the value
        self._kv.pull(key, out=out)

    def barrier(self):
        self._kv.barrier()

    def first(self, arr):
        return float(arr.ravel()[0])

    def close(self):
        close = getattr(self._kv, "close", None)
        if close is not None:
            close()


def main() -> None:
    plan = kv_suite.Plan.from_json(sys.argv[1])
    adapter = PslaunchAdapter()
    profile_path = os.environ.get("PSLAUNCH_BENCH_PROFILE")
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        result = profiler.runcall(kv_suite.run_suite, adapter, plan)
        profiler.dump_stats(f"{profile_path}.rank{adapter.rank}")
    else:
        result = kv_suite.run_suite(adapter, plan)
    result["system"] = "pslaunch"
    adapter.close()
    kv_suite.emit_result(result)


if __name__ == "__main__":
    main()
