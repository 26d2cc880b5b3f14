"""Gradient compression kernels per core: kvcore's numpy 2bit quantizer against MXNet 1.9.1's C++ one.

    python benchmarks/compression_kernels.py [--mxnet-python PATH] [--size N] [--rounds K] [--json FILE]

Both sides run in child processes pinned to the same single CPU, MXNet with one OpenMP thread, and
the children alternate (numpy, MXNet, numpy, MXNet, ...) so that the load of a shared machine hits
both alike. Each child quantizes the same gradients (a fixed seed) into a residual that carries
over, ``--reps`` times, and reports its times; a figure is the median over rounds of each round's
best. What is timed:

* ``quantize``: one 2bit quantize of ``--size`` float32 values (residual += g, codes, packing).
  MXNet's is the ``QuantizeCPU`` operator as MXNet's own profiler times it inside a device-store
  push; ours is ``psnode.compression.quantize`` on numpy arrays.
* ``dequantize``: the reverse (MXNet's ``DequantizeCPU``; ours ``dequantize`` into an array).
* ``push+pull``: a whole ``device``-store push of one value with 2bit compression and a pull
  (quantize, dequantize, store, copy out): ``kvcore.create('device')`` against
  ``mx.kv.create('device')``.

A ratio is MXNet's time over ours: above 1 means kvcore is faster. Without MXNet (no
``--mxnet-python`` and no ``/tmp/mxvenv/bin/python``) only kvcore's figures are printed.
This script imports nothing from ``benchmarks/`` and nothing of pslaunch in the parent process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MXNET_PYTHON = "/tmp/mxvenv/bin/python"
MEASURES = ("quantize", "dequantize", "push+pull")


# ---- the children ----------------------------------------------------------------------------------


def _gradients(np, size: int, reps: int):
    rng = np.random.default_rng(12345)
    return [(rng.standard_normal(size) * 0.5).astype(np.float32) for _ in range(min(reps, 4))]


def _child_numpy(size: int, reps: int) -> dict:
    sys.path.insert(0, str(REPO))
    import numpy as np

    import kvcore
    from psnode.compression import compressed_nbytes, dequantize, quantize

    grads = _gradients(np, size, reps)
    residual = np.zeros(size, np.float32)
    packed = np.empty(compressed_nbytes(size, "2bit"), np.uint8)
    values = np.empty(size, np.float32)
    times = {m: [] for m in MEASURES}
    kv = kvcore.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init(0, np.zeros(size, np.float32))
    out = np.empty(size, np.float32)
    for i in range(reps + 1):  # the first repetition warms caches and allocators, and is dropped
        g = grads[i % len(grads)]
        start = time.perf_counter()
        quantize("2bit", g, residual, 0.5, out=packed)
        middle = time.perf_counter()
        dequantize("2bit", packed, 0.5, out=values)
        end = time.perf_counter()
        if i:
            times["quantize"].append(middle - start)
            times["dequantize"].append(end - middle)
    for i in range(reps + 1):
        g = grads[i % len(grads)]
        start = time.perf_counter()
        kv.push(0, g)
        kv.pull(0, out=out)
        if i:
            times["push+pull"].append(time.perf_counter() - start)
    return {"system": "kvcore numpy", "times": times, "numpy": np.__version__}


def _child_mxnet(size: int, reps: int) -> dict:
    import mxnet as mx
    import numpy as np

    grads = [mx.nd.array(g) for g in _gradients(np, size, reps)]
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init(0, mx.nd.zeros((size,)))
    out = mx.nd.zeros((size,))
    kv.push(0, grads[0])
    kv.pull(0, out=out)
    out.wait_to_read()
    times = {m: [] for m in MEASURES}
    mx.profiler.set_config(profile_all=True, aggregate_stats=True, filename=os.devnull)
    for i in range(reps):  # the kernels, as MXNet's profiler times its operators
        mx.profiler.set_state("run")
        kv.push(0, grads[i % len(grads)])
        kv.pull(0, out=out)
        out.wait_to_read()
        mx.profiler.set_state("stop")
        operators = json.loads(mx.profiler.dumps(format="json", reset=True))["Time"]["operator"]
        times["quantize"].append(operators["QuantizeCPU"]["Total"] / 1e3)
        times["dequantize"].append(operators["DequantizeCPU"]["Total"] / 1e3)
    for i in range(reps):  # whole push+pull rounds, without the profiler
        g = grads[i % len(grads)]
        start = time.perf_counter()
        kv.push(0, g)
        kv.pull(0, out=out)
        out.wait_to_read()
        times["push+pull"].append(time.perf_counter() - start)
    return {"system": "MXNet " + mx.__version__, "times": times, "numpy": np.__version__}


def _child_main(kind: str, size: int, reps: int, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    result = _child_numpy(size, reps) if kind == "numpy" else _child_mxnet(size, reps)
    print("RESULT " + json.dumps(result), flush=True)


# ---- the parent ------------------------------------------------------------------------------------


def _run_child(python: str, kind: str, size: int, reps: int, cpu: int, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MXNET_OMP_MAX_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    argv = [python, str(Path(__file__).resolve()), "--child", kind, "--size", str(size), "--reps", str(reps),
            "--cpu", str(cpu)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as exc:  # run() kills and reaps the child before raising
        raise SystemExit(f"the {kind} child did not finish within {timeout:.0f} s") from exc
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"the {kind} child ({python}) exited {proc.returncode} without a result:\n{proc.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mxnet-python", default=None,
                        help=f"a Python with mxnet 1.9.1 [default: {DEFAULT_MXNET_PYTHON} if it exists]")
    parser.add_argument("--skip-mxnet", action="store_true", help="measure kvcore only")
    parser.add_argument("--size", type=int, default=1 << 22, help="float32 values per gradient [4 Mi = 16 MiB]")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per child [10]")
    parser.add_argument("--rounds", type=int, default=3, help="child runs per system, alternating [3]")
    parser.add_argument("--cpu", type=int, default=None, help="the CPU both children are pinned to [the last allowed]")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a child may run [300]")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--child", choices=("numpy", "mxnet"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    if args.child:
        _child_main(args.child, args.size, args.reps, cpu)
        return 0

    mxnet_python = args.mxnet_python
    if mxnet_python is None and Path(DEFAULT_MXNET_PYTHON).exists():
        mxnet_python = DEFAULT_MXNET_PYTHON
    if args.skip_mxnet:
        mxnet_python = None
    elif mxnet_python is not None and not Path(mxnet_python).exists():
        parser.error(f"--mxnet-python {mxnet_python} does not exist")

    systems = [("numpy", sys.executable)] + ([("mxnet", mxnet_python)] if mxnet_python else [])
    load_start = os.getloadavg()
    runs: dict[str, list[dict]] = {kind: [] for kind, _ in systems}
    for _ in range(args.rounds):
        for kind, python in systems:
            runs[kind].append(_run_child(python, kind, args.size, args.reps, cpu, args.timeout))
    report = {
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "size": args.size,
        "reps": args.reps,
        "rounds": args.rounds,
        "cpu": cpu,
        "cpu_model": _cpu_model(),
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "systems": {},
        "ratios": {},
    }
    for kind, _ in systems:
        rounds = runs[kind]
        figures = {m: statistics.median(min(r["times"][m]) for r in rounds) for m in MEASURES}
        report["systems"][kind] = {"name": rounds[0]["system"], "numpy": rounds[0]["numpy"], "seconds": figures,
                                   "per_round_best": {m: [min(r["times"][m]) for r in rounds] for m in MEASURES}}
    if "mxnet" in report["systems"]:
        ours, theirs = report["systems"]["numpy"], report["systems"]["mxnet"]
        for m in MEASURES:
            # per round: MXNet's best over ours, then the median of those
            pairs = zip(theirs["per_round_best"][m], ours["per_round_best"][m])
            report["ratios"][m] = statistics.median(t / o for t, o in pairs)
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _print(report: dict) -> None:
    n = report["size"]
    print(f"2bit compression of {n} float32 values ({n * 4 / 2**20:.0f} MiB), one core (CPU {report['cpu']}, "
          f"{report['cpu_model']}), {report['rounds']} rounds x {report['reps']} reps, "
          f"load {report['load_start'][0]:.1f} -> {report['load_end'][0]:.1f}")
    header = f"{'measure':<12}" + "".join(f"{s['name']:>24}" for s in report["systems"].values())
    if report["ratios"]:
        header += f"{'MXNet / kvcore time':>22}"
    print(header)
    for m in MEASURES:
        row = f"{m:<12}"
        for system in report["systems"].values():
            seconds = system["seconds"][m]
            row += f"{seconds * 1e3:>10.2f} ms {seconds / n * 1e9:>6.2f} ns/v"
        if report["ratios"]:
            row += f"{report['ratios'][m]:>21.2f}x"
        print(row)


if __name__ == "__main__":
    sys.exit(main())
