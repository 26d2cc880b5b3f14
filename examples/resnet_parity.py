"""Accuracy parity of examples/train_resnet.py: one worker against two workers through kvcore and through torch DDP,
and (``--table compression``) each gradient compression against none and against torch DDP's hooks.

    nice -n 10 python examples/resnet_parity.py                      # seeds 0, 1, 2, 4 epochs: ~13 min on 2 cores
    python examples/resnet_parity.py --epochs 2 --train-size 2000    # a quicker, rougher table
    python examples/resnet_parity.py --table compression             # 11 configurations x 3 seeds: ~25 min

For every seed, the same training (epochs, global batch, learning rate, data) runs four ways:

- ``1 worker``: ``python examples/train_resnet.py`` (the local store);
- ``2 workers, -s 2``: ``pslaunch -n 2 -s 2 --launcher local`` (dist_sync, SGD in the servers);
- ``2 workers, -s 0``: ``pslaunch -n 2 -s 0 --launcher local`` (the allreduce store, SGD on the workers);
- ``2 ranks, torch DDP``: the same under ``pslaunch -n 2 -s 0 --launcher local`` with ``--ddp``.

The compression table runs two workers and two servers (``dist_sync``) uncompressed (its reference),
with ``fp16``, ``bf16``, ``1bit_scaled`` and ``topk`` at 1% (both with error feedback, then also with
momentum correction: ``--momentum-correction``), ``topk`` at 10% with momentum correction, and torch
DDP plain, with ``fp16_compress_hook`` and with PowerSGD (rank 2), on the same data, seeds and
schedule; a column gives each mean's difference from the reference's, in points of accuracy.

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
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "train_resnet.py"
FINAL = re.compile(r"worker (\d+) final test_accuracy ([0-9.]+) wall_time ([0-9.]+)")
EPOCH = re.compile(r"worker (\d+) epoch (\d+) test_accuracy ([0-9.]+)")


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
UNCOMPRESSED = "2 workers, -s 2, uncompressed"
COMPRESSION_CONFIGS = {
    UNCOMPRESSED: (2, []),
    "fp16": (2, ["--compression", "fp16"]),
    "bf16": (2, ["--compression", "bf16"]),
    "1bit_scaled (error feedback)": (2, ["--compression", "1bit_scaled"]),
    "1bit_scaled + momentum correction": (2, ["--compression", "1bit_scaled", "--momentum-correction"]),
    "topk 1% (error feedback)": (2, ["--compression", "topk", "--compression-ratio", "0.01"]),
    "topk 1% + momentum correction": (2, ["--compression", "topk", "--compression-ratio", "0.01",
                                          "--momentum-correction"]),
    "topk 10% + momentum correction": (2, ["--compression", "topk", "--compression-ratio", "0.1",
                                           "--momentum-correction"]),
    "torch DDP (gloo)": (0, ["--ddp"]),
    "torch DDP + fp16_compress_hook": (0, ["--ddp", "--ddp-hook", "fp16"]),
    "torch DDP + PowerSGD rank 2": (0, ["--ddp", "--ddp-hook", "powersgd", "--powersgd-rank", "2"]),
}
TABLES = {"parity": (CONFIGS, REFERENCE), "compression": (COMPRESSION_CONFIGS, UNCOMPRESSED)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", choices=sorted(TABLES), default="parity",
                        help="parity: one worker against two; compression: the codecs against none and DDP's hooks")
    parser.add_argument("--configs", default=None,
                        help="comma-separated row numbers of the table to run (the reference row is always run)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    parser.add_argument("--epochs", type=int, default=4,
                        help="epochs of every run (the example trains 8; at 4 the accuracy is short of its ceiling, "
                             "where a difference would show)")
    parser.add_argument("--train-size", type=int, default=None, help="default: train_resnet.py's")
    parser.add_argument("--test-size", type=int, default=None, help="default: train_resnet.py's")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    parser.add_argument("--json", type=Path, default=None,
                        help="write every run's accuracy per epoch there (python -m benchmarks.plots accuracy draws it)")
    return parser.parse_args(argv)


def run_once(config: str, seed: int, training_args: list[str], timeout: float,
             configs: dict = CONFIGS) -> tuple[float, float, list[float]]:
    """``(accuracy, wall seconds, curve)`` of one run: the mean of its workers' final test accuracies,
    and per epoch.

    Raises:
        RuntimeError: the run failed or printed no final line (its output's tail in the message).
    """
    servers, flags = configs[config]
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
    by_epoch: dict[int, list[float]] = {}
    for _, epoch, accuracy in EPOCH.findall(proc.stdout):
        by_epoch.setdefault(int(epoch), []).append(float(accuracy))
    curve = [statistics.fmean(by_epoch[e]) for e in sorted(by_epoch)]
    return statistics.fmean(accuracies), wall, curve


def markdown_table(results: dict[str, list[float]], seeds: list[int], walls: dict[str, list[float]],
                   reference_name: str = REFERENCE) -> str:
    """The table: a row per configuration, a column per seed, then mean, std, parity (within one
    standard deviation of the reference's mean), the difference in points, and wall time."""
    reference = results[reference_name]
    ref_mean = statistics.fmean(reference)
    # The one-worker runs' spread over the seeds is the yardstick: a difference within it is noise.
    ref_std = statistics.stdev(reference) if len(reference) > 1 else 0.0
    header = ["configuration", *(f"seed {s}" for s in seeds), "mean", "std",
              f"within 1 std of {reference_name}", "points from it", "wall s / run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for config, accuracies in results.items():
        mean = statistics.fmean(accuracies)
        std = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        if config == reference_name:
            verdict = "reference"
        else:
            verdict = "yes" if abs(mean - ref_mean) <= ref_std else "no"
        cells = [config, *(f"{a:.4f}" for a in accuracies), f"{mean:.4f}", f"{std:.4f}", verdict,
                 f"{100 * (mean - ref_mean):+.2f}", f"{statistics.fmean(walls[config]):.0f}"]
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
    configs, reference = TABLES[args.table]
    if args.configs:
        rows = list(configs)
        try:
            chosen = {rows[int(i)] for i in args.configs.split(",")} | {reference}
        except (ValueError, IndexError):
            print(f"--configs takes row numbers 0..{len(rows) - 1} of: {', '.join(rows)}", file=sys.stderr)
            return 2
        configs = {name: spec for name, spec in configs.items() if name in chosen}
    results: dict[str, list[float]] = {config: [] for config in configs}
    walls: dict[str, list[float]] = {config: [] for config in configs}
    curves: dict[str, list[list[float]]] = {config: [] for config in configs}
    started = time.perf_counter()
    for seed in seeds:
        for config in configs:
            try:
                accuracy, wall, curve = run_once(config, seed, training_args, args.timeout, configs)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(exc, file=sys.stderr)
                return 1
            results[config].append(accuracy)
            walls[config].append(wall)
            curves[config].append(curve)
            print(f"{config}, seed {seed}: test accuracy {accuracy:.4f} in {wall:.0f} s", file=sys.stderr, flush=True)
    print(markdown_table(results, seeds, walls, reference))
    print(f"\n{len(seeds) * len(configs)} runs in {time.perf_counter() - started:.0f} s "
          f"({' '.join(training_args)})")
    if args.json is not None:
        args.json.write_text(json.dumps({"table": args.table, "seeds": seeds, "training_args": training_args,
                                         "final": results, "wall_s": walls, "curves": curves}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
