"""Benchmark worker: torch.distributed's gloo allreduce, the baseline of ``python -m benchmarks.allreduce``.

Started with torch's ``env://`` variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE); argv[1] is
the same plan as ``allreduce_worker.py``'s, and it measures the same way: in-place
``dist.all_reduce`` of float32 tensors of the plan's sizes (median seconds, bus bandwidth) and of
4 elements (median microseconds), after warm-up rounds and a barrier, each result checked. Prints
one ``RESULT <json>`` line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from timing import bandwidth_measures, timed  # beside this script


def main() -> int:
    plan = json.loads(sys.argv[1])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    measures = {}
    for nbytes, rounds in zip(plan["sizes"], plan["rounds"]):
        value = torch.ones(nbytes // 4, dtype=torch.float32)

        def one() -> None:
            value.fill_(1.0)
            dist.all_reduce(value)

        times, cpu = timed(one, rounds, plan["warmup"], dist.barrier)
        if not bool((value == n).all()):
            print(f"rank {rank}: gloo allreduce of {nbytes} bytes gave {value[:4]}", file=sys.stderr)
            return 1
        measures.update(bandwidth_measures(nbytes, n, times, cpu))
    small = torch.ones(4, dtype=torch.float32)

    def tiny() -> None:
        small.fill_(1.0)
        dist.all_reduce(small)

    times, _ = timed(tiny, plan["latency_rounds"], plan["warmup"] * 5, dist.barrier)
    measures["latency_4"] = {"median_us": statistics.median(times) * 1e6, "rounds": plan["latency_rounds"]}
    print("RESULT " + json.dumps({"rank": rank, "workers": n, "measures": measures}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
