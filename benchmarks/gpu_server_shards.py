"""Push+pull through a server that keeps its shards on a GPU, against one that keeps them in host memory.

    python -m benchmarks.gpu_server_shards                      # 4 and 64 MiB keys
    python -m benchmarks.gpu_server_shards --sizes-mib 64 --rounds 20

Each job is 1 scheduler, 1 server and 1 worker on 127.0.0.1 (``testkit.LocalJob``), the
server started with ``PSLAUNCH_SERVER_DEVICE=cpu`` and then ``gpu``. The worker pushes a float32 key
of each size and pulls it back (``dist_sync``, the ``Test`` optimizer on the server: ``weight +=
grad``), so a round is an upload, an optimizer step and a download on the GPU server. The worker
checks every pulled value (after ``r`` rounds every element is ``r``) and fails the job otherwise.

Prints push+pull bytes/s per worker (2 x size / median round time) for both servers and their
ratio (gpu / cpu; above 1 the GPU server is faster), and writes JSON (``--json``; default
``benchmarks/results/gpu_server_shards.json``). Without a usable GPU it says why and exits with
status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

MIB = 1 << 20
HERE = Path(__file__).resolve()


def worker(sizes_mib: list[float], rounds: int) -> None:
    """The job's worker: time push+pull rounds per size, check every value, print one RESULT line."""
    import numpy as np

    import kvcore

    kv = kvcore.create("dist_sync")
    kv.set_optimizer(kvcore.optim.Test(rescale_grad=1))
    result = {}
    for key, mib in enumerate(sizes_mib):
        count = int(mib * MIB) // 4
        kv.init(key, np.zeros(count, np.float32))
        ones = np.ones(count, np.float32)
        out = np.empty(count, np.float32)
        samples = []
        for r in range(rounds + 2):  # two warm-up rounds
            start = time.perf_counter()
            kv.push(key, ones)
            kv.pull(key, out=out)
            samples.append(time.perf_counter() - start)
            if out[0] != r + 1 or out[-1] != r + 1 or (r == rounds + 1 and not np.all(out == r + 1)):
                raise SystemExit(f"key of {mib:g} MiB, round {r + 1}: pulled {out[0]} .. {out[-1]}, expected {r + 1}")
        result[str(mib)] = statistics.median(samples[2:])
    print("RESULT " + json.dumps(result), flush=True)


def run_job(server_device: str, sizes_mib: list[float], rounds: int, timeout: float) -> dict:
    """Median round seconds per size with the server's shards on ``server_device``."""
    from testkit import LocalJob

    argv = [str(HERE), "--worker", "--rounds", str(rounds), "--sizes-mib", *map(str, sizes_mib)]
    env = {"PSLAUNCH_SERVER_DEVICE": server_device, "PSLAUNCH_BIGARRAY_BOUND": str(1 << 40)}  # one shard per key
    with LocalJob(1, 1, worker=argv, env=env) as job:
        results = job.wait(timeout)
    failed = [r for r in results if r.returncode != 0]
    if failed:
        raise RuntimeError("the job failed:\n" + "\n".join(str(r) for r in failed))
    output = next(r.output for r in results if r.role == "worker")
    match = re.search(r"^RESULT (.*)$", output, re.M)
    if match is None:
        raise RuntimeError(f"the worker printed no RESULT line:\n{output[-2000:]}")
    server = next(r.output for r in results if r.role == "server")
    if server_device != "cpu" and "keeps its shards on the CPU" in server:
        raise RuntimeError(f"the server fell back to the CPU:\n{server[-2000:]}")
    return {float(k): v for k, v in json.loads(match.group(1)).items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 64])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=str(HERE.parent / "results" / "gpu_server_shards.json"))
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.sizes_mib, args.rounds)
        return 0
    from kvcore import arrays

    if not arrays.gpu_available():
        print(f"no usable GPU: {arrays.gpu_status()}", file=sys.stderr)
        return 2
    seconds = {device: run_job(device, args.sizes_mib, args.rounds, args.timeout) for device in ("cpu", "gpu")}
    rows = []
    print(f"push+pull through one server, 1 worker (median of {args.rounds}); {arrays.gpu_status()}")
    print(f"{'MiB':>8} {'host GB/s':>10} {'gpu GB/s':>10} {'gpu/host':>9}")
    for mib in args.sizes_mib:
        nbytes = int(mib * MIB) // 4 * 4
        host, gpu = (2 * nbytes / seconds[d][mib] / 1e9 for d in ("cpu", "gpu"))
        rows.append({"mib": mib, "bytes": nbytes, "host_gbps": host, "gpu_gbps": gpu, "gpu_over_host": gpu / host,
                     "verified": True})
        print(f"{mib:8.1f} {host:10.2f} {gpu:10.2f} {gpu / host:9.2f}", flush=True)
    report = {"benchmark": "gpu_server_shards", "gpu_status": arrays.gpu_status(), "host": platform.node(),
              "cpus": os.cpu_count(), "rounds": args.rounds, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
