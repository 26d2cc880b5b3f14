"""Benchmark worker: pslaunch's collectives (``kvcore.collectives``) and the ``allreduce`` store.

Run by ``python -m benchmarks.allreduce`` in a job without servers; argv[1] is the plan (JSON:
sizes in bytes, rounds). Measures, after warm-up rounds and a barrier:

- ``busbw_<bytes>``: in-place allreduce of a float32 array of that size, median seconds per call,
  and the bus bandwidth ``bytes / t * 2 (n - 1) / n`` (NCCL's and gloo's convention);
- ``shared_busbw_<bytes>`` (with ``"shared": true`` in the plan): the same for an array made by
  ``collectives.shared_empty``, which the same-host path sums where it lies;
- ``latency_4``: the same for a 4-element array, in microseconds;
- ``keys1000_fused`` / ``keys1000_unfused``: the allreduce store's ``push(keys, values)`` then
  ``pull(keys, out=outs)`` of 1000 one-float keys, with small keys fused (the default) and with
  ``fusion_bytes = 0`` (one collective per key), in milliseconds.

Every result is checked (the sum of every worker's values); a wrong one exits 1. Prints one
``RESULT <json>`` line.
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np

import kvcore
from kvcore import collectives
from timing import bandwidth_measures, timed  # beside this script


def main() -> int:
    plan = json.loads(sys.argv[1])
    n = collectives.num_workers()
    rank = collectives.rank()
    measures = {}
    kinds = [("", np.ones)] + ([("shared_", collectives.shared_empty)] if plan.get("shared") else [])
    for nbytes, rounds in zip(plan["sizes"], plan["rounds"]):
        for prefix, make in kinds:
            value = make(nbytes // 4, np.float32)

            def one() -> None:
                value[:] = 1.0
                collectives.allreduce(value, key="bw")

            times, cpu = timed(one, rounds, plan["warmup"], collectives.barrier)
            if not np.all(value == n):
                print(f"worker {rank}: allreduce of {nbytes} bytes gave {value[:4]}, expected {n}", file=sys.stderr)
                return 1
            measures.update({prefix + k: v for k, v in bandwidth_measures(nbytes, n, times, cpu).items()})
    small = np.ones(4, np.float32)

    def tiny() -> None:
        small[:] = 1.0
        collectives.allreduce(small, key="lat")

    times, _ = timed(tiny, plan["latency_rounds"], plan["warmup"] * 5, collectives.barrier)
    if not np.all(small == n):
        print(f"worker {rank}: 4-element allreduce gave {small}", file=sys.stderr)
        return 1
    measures["latency_4"] = {"median_us": statistics.median(times) * 1e6, "rounds": plan["latency_rounds"]}
    kv = kvcore.create("allreduce")
    keys = [f"k{i}" for i in range(1000)]
    kv.init(keys, [np.zeros(1, np.float32)] * len(keys))
    values = [np.ones(1, np.float32) for _ in keys]
    outs = [np.zeros(1, np.float32) for _ in keys]
    for name, fusion in (("keys1000_fused", kv.fusion_bytes), ("keys1000_unfused", 0)):
        kv.fusion_bytes = fusion

        def round_trip() -> None:
            kv.push(keys, values)
            kv.pull(keys, out=outs)

        times, _ = timed(round_trip, plan["keys_rounds"], 2, collectives.barrier)
        if not all(o[0] == n for o in outs):
            print(f"worker {rank}: {name} pulled {outs[0]}, expected {n}", file=sys.stderr)
            return 1
        measures[name] = {"median_ms": statistics.median(times) * 1e3, "rounds": plan["keys_rounds"]}
    print("RESULT " + json.dumps({"rank": rank, "workers": n, "measures": measures}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
