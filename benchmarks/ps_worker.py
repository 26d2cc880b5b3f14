"""Benchmark worker for pslaunch's ``dist_sync`` KVStore.

Run by ``benchmarks/run.py`` under the DMLC_* variables of docs/env.md; argv[1] is the
``kv_suite.Plan`` as JSON. Prints one ``RESULT`` line. With ``PSLAUNCH_BENCH_PROFILE=<path>`` set,
the whole suite runs under a profiler and the stats are written to ``<path>.rank<r>``.
"""

from __future__ import annotations

import os
import sys

import kv_suite
import numpy as np

import kvcore


class PslaunchAdapter:
    """``kv_suite.KVAdapter`` over ``kvcore.create('dist_sync')`` with numpy arrays."""

    def __init__(self) -> None:
        self._kv = kvcore.create("dist_sync")
        # PSLAUNCH_BENCH_PUSH_COPY=0 (system pslaunch_tcp_nocopy): pushes send the array itself; the
        # suite changes no value before the pull after its push, which waited for the push
        self._copy = os.environ.get("PSLAUNCH_BENCH_PUSH_COPY", "1") != "0"
        self.rank = self._kv.rank
        self.num_workers = self._kv.num_workers

    def ones(self, n):
        return np.ones((n,), dtype=np.float32)

    def zeros(self, n):
        return np.zeros((n,), dtype=np.float32)

    def init(self, key, value):
        self._kv.init(key, value)

    def push(self, key, value):
        self._kv.push(key, value, copy=self._copy)

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


def _profiled(plan: kv_suite.Plan, path: str) -> dict:
    """Run the suite under yappi (CPU time of every thread, the network thread included) when it
    is installed, else under cProfile (the calling thread only); write ``<path>.rank<r>`` (pstats)."""
    try:
        import yappi
    except ImportError:
        yappi = None
    if yappi is not None:
        yappi.set_clock_type("cpu")
        yappi.start()  # before the store starts its network thread, so that thread is profiled too
        adapter = PslaunchAdapter()
        result = kv_suite.run_suite(adapter, plan)
        yappi.stop()
        yappi.get_func_stats().save(f"{path}.rank{adapter.rank}", type="pstat")
        with open(f"{path}.rank{adapter.rank}.threads", "w") as fh:
            yappi.get_thread_stats().print_all(out=fh)
        return result | {"_adapter": adapter}
    import cProfile

    adapter = PslaunchAdapter()
    profiler = cProfile.Profile()
    result = profiler.runcall(kv_suite.run_suite, adapter, plan)
    profiler.dump_stats(f"{path}.rank{adapter.rank}")
    return result | {"_adapter": adapter}


def main() -> None:
    plan = kv_suite.Plan.from_json(sys.argv[1])
    profile_path = os.environ.get("PSLAUNCH_BENCH_PROFILE")
    if profile_path:
        result = _profiled(plan, profile_path)
        adapter = result.pop("_adapter")
    else:
        adapter = PslaunchAdapter()
        result = kv_suite.run_suite(adapter, plan)
    result["system"] = "pslaunch"
    adapter.close()
    kv_suite.emit_result(result)


if __name__ == "__main__":
    main()
