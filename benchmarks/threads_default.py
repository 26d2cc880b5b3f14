"""Threads per process: the training examples under pslaunch with and without its threads default.

    python -m benchmarks.threads_default [--reps 3] [--json FILE]

Each job is ``pslaunch -n 2 -s 2`` on this machine (a scheduler, 2 servers, 2 workers: 5 processes),
run three ways, in turn (A B C A B C ...) so that all see the same machine load:

* ``all cores each``: ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS`` set to the
  usable cores in every process: what each process did before pslaunch set anything (numpy's BLAS
  and torch size their pools to the machine);
* ``pslaunch default``: none set: pslaunch gives each process cores / processes (at least 1);
* ``default + --cpu-bind cores``: the same, each process pinned to its block of cores.

The examples: the digits MLP (``examples/train_mlp.py``, numpy, 20 epochs) and ResNet-20
(``examples/train_resnet.py --threads 0``: torch's own default, which follows ``OMP_NUM_THREADS``;
1 epoch of 1000 images). The figure is worker 0's training time (the ``wall_time`` of its last line:
every epoch with its test, from its first step), and the ratio each way's over ``all cores each``,
the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
EXAMPLES = {
    "digits MLP": ["examples/train_mlp.py", "--epochs", "20"],
    "ResNet-20": ["examples/train_resnet.py", "--threads", "0", "--epochs", "1", "--train-size", "1000",
                  "--test-size", "200"],
}


def _ways() -> dict[str, tuple[dict[str, str], list[str]]]:
    cores = str(len(os.sched_getaffinity(0)))
    return {"all cores each": ({name: cores for name in THREAD_VARIABLES}, []),
            "pslaunch default": ({}, []),
            "default + --cpu-bind cores": ({}, ["--cpu-bind", "cores"])}


def run_once(example: list[str], extra_env: dict[str, str], flags: list[str], timeout: float = 900) -> float:
    """One job; worker 0's training seconds. Raises RuntimeError when it fails."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env.update(extra_env, PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "launcher.cli", "-n", "2", "-s", "2", "--no-dashboard", *flags,
            "--timeout", str(int(timeout)), sys.executable, *example]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout + 60)
    wall = re.findall(r"\] worker 0 final test_accuracy \S+ wall_time (\d+\.\d+)", proc.stdout)
    if proc.returncode != 0 or not wall:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return float(wall[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    ways = _ways()
    started = time.perf_counter()
    report = {"cores": len(os.sched_getaffinity(0)), "reps": args.reps, "examples": {}}
    lines = [f"threads per process, pslaunch -n 2 -s 2 (5 processes) on {report['cores']} cores, "
             f"{args.reps} rounds; worker 0's training time", "",
             "| example | way | training s (median; min-max) | / all cores each |", "|---|---|---|---|"]
    for name, example in EXAMPLES.items():
        figures: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.reps):
            for way, (extra_env, flags) in ways.items():
                figures[way].append(run_once(example, extra_env, flags))
        base = figures["all cores each"]
        for way, values in figures.items():
            ratio = statistics.median(v / b for v, b in zip(values, base))
            lines.append(f"| {name} | {way} | {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}) "
                         f"| {ratio:.2f}x |")
        report["examples"][name] = figures
    load = os.getloadavg()[0]
    lines += ["", f"{time.perf_counter() - started:.0f} s in all; load average at the end {load:.1f}"]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
