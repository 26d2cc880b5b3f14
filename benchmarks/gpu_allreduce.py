"""NCCL allreduce between worker processes, one GPU each, against the card's own copy bandwidth.

    python -m benchmarks.gpu_allreduce                       # 4, 64 and 256 MiB
    python -m benchmarks.gpu_allreduce --sizes-mib 64 --rounds 20 --json out.json

A job without servers (``testkit.LocalJob``) of one worker per GPU; each worker sums a
float32 CuPy array on GPU ``local_rank`` with ``kvcore.collectives.allreduce`` (NCCL, the unique id
through the scheduler), checks the sum, and reports the median time per call. The figure is the
bus bandwidth ``bytes / t * 2 (n - 1) / n`` next to the card's device-to-device copy bandwidth
(bytes copied per second by ``cupy`` on GPU 0), and their ratio. NCCL runs one process per GPU, so
with one GPU only the copy bandwidth is measured (the bus bandwidth needs two). Without a usable
GPU it says why and exits with status 2. Writes JSON (``--json``; default
``benchmarks/results/gpu_allreduce.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

MIB = 1 << 20
HERE = Path(__file__).resolve()


def worker(sizes_mib: list[float], rounds: int) -> None:
    """One worker of the job: time NCCL allreduces per size, check every sum, print one RESULT line."""
    import kvcore
    from kvcore import arrays

    kv = kvcore.create("allreduce")
    n = kv.num_workers
    device = kvcore.gpu(kv.local_rank)
    cp = arrays.cupy_module()
    result = {}
    with arrays.device_context(device):
        for mib in sizes_mib:
            value = cp.ones(int(mib * MIB) // 4, dtype=cp.float32)
            samples = []
            for r in range(rounds + 2):  # two warm-up rounds
                value.fill(1)
                cp.cuda.get_current_stream().synchronize()
                start = time.perf_counter()
                kvcore.collectives.allreduce(value)
                samples.append(time.perf_counter() - start)
            if not bool((value == n).all()):
                raise SystemExit(f"allreduce of {mib:g} MiB gave {value[:4]}, expected {n}")
            result[str(mib)] = statistics.median(samples[2:])
    print("RESULT " + json.dumps({"rank": kv.rank, "seconds": result}), flush=True)


def copy_bandwidth(mib: float, rounds: int) -> float:
    """Bytes per second one device-to-device copy of ``mib`` MiB moves on GPU 0."""
    from kvcore import arrays

    cp = arrays.cupy_module()
    with arrays.device_context(arrays.gpu(0)):
        src = cp.ones(int(mib * MIB) // 4, dtype=cp.float32)
        dst = cp.empty_like(src)
        samples = []
        for _ in range(rounds + 2):
            cp.cuda.get_current_stream().synchronize()
            start = time.perf_counter()
            dst[...] = src
            cp.cuda.get_current_stream().synchronize()
            samples.append(time.perf_counter() - start)
    return src.nbytes / statistics.median(samples[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 64, 256])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", type=Path, default=HERE.parent / "results" / "gpu_allreduce.json")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.sizes_mib, args.rounds)
        return 0
    from kvcore import arrays

    if not arrays.gpu_available():
        print(f"gpu_allreduce: no usable GPU: {arrays.gpu_status()}", file=sys.stderr)
        return 2
    gpus = arrays.num_gpus()
    report = {"gpus": gpus, "nccl": arrays.nccl_available(), "rows": []}
    copies = {mib: copy_bandwidth(mib, args.rounds) for mib in args.sizes_mib}
    seconds: dict[str, float] = {}
    if gpus >= 2 and report["nccl"]:
        from testkit import LocalJob

        argv = [str(HERE), "--worker", "--rounds", str(args.rounds), "--sizes-mib", *map(str, args.sizes_mib)]
        with LocalJob(gpus, 0, worker=argv, test_settings=False) as job:
            job.wait_ok(["worker"], args.timeout)
            lines = [line for i in range(gpus) for line in job.output_of("worker", i).splitlines()
                     if line.startswith("RESULT ")]
        results = [json.loads(line[len("RESULT "):]) for line in lines]
        seconds = {k: statistics.mean(r["seconds"][k] for r in results) for k in results[0]["seconds"]}
    else:
        report["note"] = ("the bus bandwidth needs 2 GPUs with NCCL (one process per GPU); "
                          f"this machine has {gpus}, NCCL {'usable' if report['nccl'] else 'not usable'}")
    for mib in args.sizes_mib:
        row = {"mib": mib, "copy_bytes_per_s": copies[mib]}
        t = seconds.get(str(mib))
        if t:
            row["busbw_bytes_per_s"] = mib * MIB / t * 2 * (gpus - 1) / gpus
            row["busbw_over_copy"] = row["busbw_bytes_per_s"] / copies[mib]
        report["rows"].append(row)
        bus = f"{row['busbw_bytes_per_s'] / 1e9:.1f} GB/s ({row['busbw_over_copy']:.2f}x copy)" if t else "n/a"
        print(f"{mib:g} MiB: copy {copies[mib] / 1e9:.1f} GB/s, NCCL bus bandwidth {bus}")
    if "note" in report:
        print(report["note"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
