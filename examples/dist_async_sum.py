"""Sum across devices and worker processes through the parameter servers (mshadow-ps's dist sum).

    pslaunch --launcher local -s 1 -n 3 examples/dist_async_sum.py 1 2

Every worker process runs one thread per device id given (GPUs when CuPy sees enough of them, else
CPU slots). Each round, each device pushes row 0 = 1 (key 0) and row 1 = its device id (key 1);
Level 1 sums the rows of the process's devices, and only that sum goes to the servers, whose
updater starts from zeros and adds every push it receives (``dist_async``: pushes apply as they
arrive). After ``--rounds`` rounds and a barrier every worker reads the servers' totals:

    key 0 = rounds * workers * devices        key 1 = rounds * workers * sum(device ids)
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import kvcore
from kvcore import arrays

# The examples directory is not a package; the servers load this file too (for Accumulate),
# so the path goes in here rather than relying on the script's directory being first on sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_threads import run_device_threads  # noqa: E402


class Accumulate(kvcore.ModelUpdater):
    """Runs on the servers: starts every key at zero and adds each merged push to it."""

    def init_model(self, key, data):
        data[...] = 0

    def update(self, key, grad):
        self.weight(key)[...] += grad


def run_device(model, devid, rounds, seen):
    device = model.device(devid)
    with arrays.device_context(device):
        data = arrays.zeros((2, 3), np.float32, device)
        model.init_key((3,), 0, devid)
        model.init_key((3,), 1, devid)
        totals = []
        for _ in range(rounds):
            data[0] = 1
            data[1] = devid
            model.push(data[0], 0, devid)
            model.pull_req(data[0], 0, devid)
            model.push(data[1], 1, devid)
            model.pull_req(data[1], 1, devid, priority=1)
            model.pull_wait(0, devid)
            model.pull_wait(1, devid)
            totals.append(float(arrays.asnumpy(data[0])[0]))
        seen[devid] = totals


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("devices", type=int, nargs="+", help="device ids of this worker, e.g. 1 2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args(argv)
    device = "auto"
    if arrays.gpu_available() and max(args.devices) >= arrays.num_gpus():
        device = "cpu"  # ids past the GPUs present: run on CPU slots rather than fail
    model = kvcore.create_shared_model("dist", updater=Accumulate(), device=device, timeout=args.timeout)
    seen: dict[int, list[float]] = {}
    with model:
        model.init(args.devices)
        rank, workers = model.rank, model.num_workers
        errors = run_device_threads(lambda devid: run_device(model, devid, args.rounds, seen), args.devices)
        if errors:
            print(f"worker {rank}: error: {errors[0]}", file=sys.stderr, flush=True)
            return 1
        model.barrier()  # every worker's rounds are on the servers now
        totals = {key: model.get_weight(key, args.devices[0]) for key in (0, 1)}
        code = report(rank, workers, args, totals, seen)
        model.barrier()  # nobody leaves (and ends its part of the job) before everyone has read
    return code


def report(rank, workers, args, totals, seen) -> int:
    """Print this worker's totals; 0 when they are the expected sums."""
    ndev = len(args.devices)
    expected = {0: args.rounds * workers * ndev, 1: args.rounds * workers * sum(args.devices)}
    # asynchronous: each pull saw at least this process's own pushes so far
    monotone = all(t[i] >= (i + 1) * ndev for t in seen.values() for i in range(len(t)))
    print(f"worker {rank}: key 0 = {totals[0].tolist()}, key 1 = {totals[1].tolist()}", flush=True)
    if not all(np.all(totals[k] == expected[k]) for k in (0, 1)) or not monotone:
        print(f"worker {rank}: error: expected key 0 = {expected[0]} and key 1 = {expected[1]}", file=sys.stderr, flush=True)
        return 1
    print(f"worker {rank}: ok: {workers} workers x {ndev} devices x {args.rounds} rounds summed on the servers", flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
