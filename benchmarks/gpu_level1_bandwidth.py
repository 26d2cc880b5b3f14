"""Level-1 aggregation bandwidth of the shared model against the card's own copy bandwidth.

    python benchmarks/gpu_level1_bandwidth.py                    # every GPU, sizes 1..256 MiB
    python benchmarks/gpu_level1_bandwidth.py --devices 0 --sizes-mib 4 64
    python benchmarks/gpu_level1_bandwidth.py --device cpu       # the same on CPU slots (numpy)

For each array size it measures:

* ``copy``: one device-to-device copy of the array on the first device (``cudaMemcpy``), the
  ceiling for anything that moves the bytes on one card; with two or more GPUs also ``peer``, a
  copy from the second GPU to the first (the ceiling of the sum at the first GPU; NCCL's bus
  bandwidth is the other).
* ``level1``: one shared-model round: every device pushes its gradient, Level 1 sums them and
  every device pulls the sum into a separate array (``push`` + ``pull_req`` + ``pull_wait``, one
  thread per device). Its bandwidth is the bytes of one device's array over the round's time
  ("algorithm bandwidth" as nccl-tests count it). With one device there is nothing to sum: the
  round is a copy in and a copy out, so half the copy bandwidth is its ceiling.

Every round's inputs are the same (device ``i`` pushes ``i + 1``), so after the timed rounds every
device's result must be exactly the sum: the benchmark checks it and fails (exit status 1, naming
the size, the device and both values) when it is not. ``aggregation`` says how Level 1 summed:
``nccl`` (and NCCL really ran: the model counts its all-reduces), ``peer copies to gpu(0)``, ``host
rows`` (CPU slots) or ``none (one device)``. ``target_met`` is ``level1/copy >= 0.6`` at 64 MiB.

Prints a table and writes the figures as JSON (``--json``; default
``benchmarks/results/gpu_level1_bandwidth.json``). Without a GPU and without ``--device cpu`` it
says why and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

import kvcore
from kvcore import arrays

MIB = 1 << 20


def _timed(fn, repeat: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_seconds(device: arrays.Device, nbytes: int, repeat: int, source: arrays.Device | None = None) -> float:
    """Median time of one copy of ``nbytes`` into ``device`` (from ``source``, default the same)."""
    count = nbytes // 4
    src = arrays.zeros((count,), np.float32, source or device)
    dst = arrays.empty((count,), np.float32, device)

    def once():
        with arrays.device_context(device):
            if device.is_gpu:
                arrays.peer_copy(dst, src)
                arrays.synchronize_stream(device)
            else:
                np.copyto(dst, src)

    return _timed(once, repeat)


class WrongSum(Exception):
    """A Level-1 round produced something other than the exact sum."""


def level1_round(devids: list[int], use: str, nbytes: int, repeat: int) -> dict:
    """Time one Level-1 round (push, sum, pull on every device) of ``nbytes`` per device.

    Returns ``{"seconds": median, "aggregation": how}``.

    Raises:
        WrongSum: a device's pulled result is not the exact sum of the pushes.
    """
    count = nbytes // 4
    with kvcore.create_shared_model("local", device=use, timeout=120) as model:
        model.init(devids)
        grads, outs = {}, {}
        for devid in devids:
            dev = model.device(devid)
            with arrays.device_context(dev):
                model.init_key((count,), "g", devid)
                grads[devid] = arrays.zeros((count,), np.float32, dev) + (devid + 1)
                outs[devid] = arrays.zeros((count,), np.float32, dev)
                arrays.synchronize_stream(dev)
        go = [threading.Barrier(len(devids) + 1) for _ in range(2)]
        stop = threading.Event()
        errors: list[BaseException] = []

        def device(devid):
            dev = model.device(devid)
            try:
                with arrays.device_context(dev):
                    while True:
                        go[0].wait()
                        if stop.is_set():
                            return
                        model.push(grads[devid], "g", devid)
                        model.pull_req(outs[devid], "g", devid)
                        model.pull_wait("g", devid)
                        go[1].wait()
            except BaseException as exc:  # surfaced by the main thread
                errors.append(exc)
                for b in go:
                    b.abort()

        threads = [threading.Thread(target=device, args=(d,), daemon=True) for d in devids]
        for t in threads:
            t.start()

        def round_once():
            go[0].wait()
            go[1].wait()

        try:
            seconds = _timed(round_once, repeat)
        finally:
            stop.set()
            try:
                go[0].wait(10)
            except threading.BrokenBarrierError:
                pass
            for t in threads:
                t.join(10)
        if errors:
            raise errors[0]
        expected = float(sum(d + 1 for d in devids))
        for devid in devids:
            with arrays.device_context(model.device(devid)):
                low, high = float(outs[devid].min()), float(outs[devid].max())
            if low != expected or high != expected:
                raise WrongSum(
                    f"{nbytes / MIB:g} MiB on device {devid}: pulled values from {low} to {high}, expected {expected}"
                )
        return {"seconds": seconds, "aggregation": _aggregation(model, devids, use)}


def _aggregation(model, devids: list[int], use: str) -> str:
    if len(devids) == 1:
        return "none (one device)"
    if use == "cpu":
        return "host rows"
    if model.nccl_allreduces > 0:
        return "nccl"
    return f"peer copies to gpu({devids[0]})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", help="device ids (default: every GPU, or 0 1 on CPU)")
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "gpu_level1_bandwidth.json"))
    args = parser.parse_args(argv)
    if args.device == "gpu" and not arrays.gpu_available():
        print(f"no usable GPU: {arrays.gpu_status()}; use --device cpu for the CPU path", file=sys.stderr)
        return 2
    if args.devices:
        devids = args.devices
    else:
        devids = list(range(arrays.num_gpus())) if args.device == "gpu" else [0, 1]
    first = arrays.gpu(devids[0]) if args.device == "gpu" else arrays.cpu()
    second = arrays.gpu(devids[1]) if args.device == "gpu" and len(devids) > 1 else None
    rows = []
    header = (f"{'MiB':>8} {'copy GB/s':>10} {'peer GB/s':>10} {'level1 GB/s':>12} {'level1/copy':>12} "
              f"{'round ms':>9}  aggregation")
    print(f"Level-1 aggregation on {args.device} devices {devids} (median of {args.repeat}); {arrays.gpu_status()}")
    print(header)
    failure = None
    for mib in args.sizes_mib:
        nbytes = int(mib * MIB) // 4 * 4
        copy_s = copy_seconds(first, nbytes, args.repeat)
        peer_s = copy_seconds(first, nbytes, args.repeat, source=second) if second is not None else None
        try:
            level1 = level1_round(devids, args.device, nbytes, args.repeat)
        except WrongSum as exc:
            failure = f"error: Level 1 summed wrong: {exc}"
            print(failure, file=sys.stderr, flush=True)
            break
        round_s = level1["seconds"]
        row = {
            "mib": mib,
            "bytes": nbytes,
            "copy_gbps": nbytes / copy_s / 1e9,
            "peer_gbps": nbytes / peer_s / 1e9 if peer_s else None,
            "level1_gbps": nbytes / round_s / 1e9,
            "round_seconds": round_s,
            "aggregation": level1["aggregation"],
            "verified": True,
        }
        row["level1_over_copy"] = row["level1_gbps"] / row["copy_gbps"]
        rows.append(row)
        peer = f"{row['peer_gbps']:10.1f}" if row["peer_gbps"] else f"{'-':>10}"
        print(
            f"{mib:8.1f} {row['copy_gbps']:10.1f} {peer} {row['level1_gbps']:12.2f} "
            f"{row['level1_over_copy']:12.2f} {round_s * 1000:9.2f}  {row['aggregation']}",
            flush=True,
        )
    at_64 = [r for r in rows if r["mib"] == 64]
    report = {
        "benchmark": "gpu_level1_bandwidth",
        "device_kind": args.device,
        "devices": devids,
        "gpu_names": _gpu_names(devids) if args.device == "gpu" else [],
        "gpu_status": arrays.gpu_status(),
        "nccl_available": arrays.nccl_available(),
        "nccl_used": any(r["aggregation"] == "nccl" for r in rows),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "repeat": args.repeat,
        "rows": rows,
        "target": "level1/copy >= 0.6 at 64 MiB",
        "target_met": (at_64[0]["level1_over_copy"] >= 0.6) if at_64 else None,
        "error": failure,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 1 if failure else 0


def _gpu_names(devids: list[int]) -> list[str]:
    cp = arrays.cupy_module()
    names = []
    for devid in devids:
        props = cp.cuda.runtime.getDeviceProperties(devid)
        name = props.get("name", b"?")
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
