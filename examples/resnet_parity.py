"""Accuracy parity of examples/train_resnet.py: one worker against two workers through kvcore and through torch DDP.

    nice -n 10 python examples/resnet_parity.py                      # seeds 0, 1, 2, 4 epochs: ~13 min on 2 cores
    python examples/resnet_parity.py --epochs 2 --train-size 2000    # a quicker, rougher table

For every seed, the same training (epochs, global batch, learning rate, data) runs four ways:

- ``1 worker``: ``python examples/train_resnet.py`` (the local store);
- ``2 workers, -s 2``: ``pslaunch -n 2 -s 2 --launcher local`` (dist_sync, SGD in the servers);
- ``2 workers, -s 0``: ``pslaunch -n 2 -s 0 --launcher local`` (the allreduce store, SGD on the workers);
- ``2 ranks, torch DDP``: the same under ``pslaunch -n 2 -s 0 --launcher local`` with ``--ddp``.

Two workers do not follow one worker's trajectory exactly: each normalises with the batch-norm
statistics of its half of the batch. What should hold is that they end within the seed-to-seed
spread. The table on stdout gives each run's final test accuracy (the mean over its workers, which
evaluate with their own running statistics), each configuration's mean and sample standard
deviation over the seeds, and whether that mean is within one standard deviation (the one-worker
runs') of the one-worker mean. Runs go one after another, each worker on one thread; progress goes to
stderr. docs/training.md shows a table it printed.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "train_resnet.py"
FINAL = re.compile(r"worker (\d+) final test_accuracy ([0-9.]+) wall_time ([0-9.]+)")


def _pslaunch(servers: int, timeout: float) -> list[str]:
    """Two workers and ``servers`` servers on this machine; pslaunch stops the job after ``timeout`` seconds."""
    return [sys.executable, "-m", "launcher.cli", "--launcher", "local", "-n", "2", "-s", str(servers),
            "--timeout", str(timeout), "--"]


# name -> (servers of the pslaunch job, None for one process alone; the script's own flags)
CONFIGS = {
    "1 worker (local)": (None, ["--kvstore", "local"]),
    "2 workers, -s 2 (dist_sync)": (2, []),
    "2 workers, -s 0 (allreduce)": (0, []),
    "2 ranks, torch DDP (gloo)": (0, ["--ddp"]),
}
REFERENCE = "1 worker (local)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    parser.add_argument("--epochs", type=int, default=4,
                        help="epochs of every run (the example trains 8; at 4 the accuracy is short of its ceiling, "
                             "where a difference would show)")
    parser.add_argument("--train-size", type=int, default=None, help="default: train_resnet.py's")
    parser.add_argument("--test-size", type=int, default=None, help="default: train_resnet.py's")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    return parser.parse_args(argv)


def run_once(config: str, seed: int, training_args: list[str], timeout: float) -> tuple[float, float]:
    """``(accuracy, wall seconds)`` of one run: the mean of its workers' final test accuracies.

    Raises:
        RuntimeError: the run failed or printed no final line (its output's tail in the message).
    """
    servers, flags = CONFIGS[config]
    launcher = [] if servers is None else _pslaunch(servers, timeout - 10)  # the job stops before we kill it
    workers = 1 if servers is None else 2
    argv = [*launcher, sys.executable, str(SCRIPT), "--seed", str(seed), *training_args, *flags]
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=HERE.parent, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - started
    accuracies = [float(m.group(2)) for m in FINAL.finditer(proc.stdout)]
    if proc.returncode != 0 or len(accuracies) != workers:
        raise RuntimeError(f"{config}, seed {seed}: exit code {proc.returncode}, {len(accuracies)} of {workers} "
                           f"final lines:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return statistics.fmean(accuracies), wall


def markdown_table(results: dict[str, list[float]], seeds: list[int], walls: dict[str, list[float]]) -> str:
    """The table: a row per configuration, a column per seed, then mean, std, parity and wall time."""
    reference = results[REFERENCE]
    ref_mean = statistics.fmean(reference)
    # The one-worker runs' spread over the seeds is the yardstick: a difference within it is noise.
    ref_std = statistics.stdev(reference) if len(reference) > 1 else 0.0
    header = ["configuration", *(f"seed {s}" for s in seeds), "mean", "std",
              "within 1 std of 1 worker", "wall s / run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for config, accuracies in results.items():
        mean = statistics.fmean(accuracies)
        std = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        if config == REFERENCE:
            verdict = "reference"
        else:
            verdict = "yes" if abs(mean - ref_mean) <= ref_std else f"no ({mean - ref_mean:+.4f})"
        cells = [config, *(f"{a:.4f}" for a in accuracies), f"{mean:.4f}", f"{std:.4f}", verdict,
                 f"{statistics.fmean(walls[config]):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    training_args = []
    for flag, value in (("--epochs", args.epochs), ("--train-size", args.train_size),
                        ("--test-size", args.test_size)):
        if value is not None:
            training_args += [flag, str(value)]
    results: dict[str, list[float]] = {config: [] for config in CONFIGS}
    walls: dict[str, list[float]] = {config: [] for config in CONFIGS}
    started = time.perf_counter()
    for seed in seeds:
        for config in CONFIGS:
            try:
                accuracy, wall = run_once(config, seed, training_args, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(exc, file=sys.stderr)
                return 1
            results[config].append(accuracy)
            walls[config].append(wall)
            print(f"{config}, seed {seed}: test accuracy {accuracy:.4f} in {wall:.0f} s", file=sys.stderr, flush=True)
    print(markdown_table(results, seeds, walls))
    print(f"\n{len(seeds) * len(CONFIGS)} runs in {time.perf_counter() - started:.0f} s "
          f"({' '.join(training_args)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
