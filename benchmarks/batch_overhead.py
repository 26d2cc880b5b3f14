"""What a batch scheduler costs a pslaunch job: each test cluster's cold start, and a job's wall
time on it next to the same job run locally, in one run.

    python -m benchmarks.batch_overhead [--repeats 5] [--json out.json]

Starts the one-machine Slurm and SGE clusters of the launcher tests
(testkit/launcher/clusters.py: needs what scripts/test.sh installs, and root) in
temporary directories, several times for the cold start, then runs two jobs with ``pslaunch -n 2
-s 1`` under ``--launcher local``, ``slurm`` and ``sge`` in turn, ``--repeats`` rounds interleaved
so that a busy machine slows every launcher alike:

* ``empty``: every role runs ``true`` (``--command-for-all-roles``): pure start-up and tear-down;
* ``train``: ``examples/train_mlp.py --epochs 4`` with the bundled scheduler and server.

Prints medians and the ratio of each launcher's median to ``local``'s in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from testkit.launcher import start_sge, start_slurm  # the clusters the tests start

JOBS = {
    "empty": ["--command-for-all-roles", "true"],
    "train": [sys.executable, str(REPO / "examples" / "train_mlp.py"), "--epochs", "4"],
}


def cold_starts(start, count: int) -> list[float]:
    """Seconds from the first daemon's start to a cluster that takes jobs, ``count`` times."""
    seconds = []
    for _ in range(count):
        with tempfile.TemporaryDirectory(prefix="pslaunch-bench-") as tmp:
            cluster = start(Path(tmp))
            seconds.append(next(cluster).start_seconds)
            for _ in cluster:  # the generator's cleanup: stop the daemons
                pass
    return seconds


def run_job(launcher: str, job: str, env: dict[str, str], cwd: str) -> float:
    """Wall seconds of one ``pslaunch`` run; raises when it fails."""
    argv = [sys.executable, "-m", "launcher.cli", "-n", "2", "-s", "1", "--launcher", launcher, "-q",
            "--timeout", "300", *JOBS[job]]
    start = time.perf_counter()
    res = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=400)
    seconds = time.perf_counter() - start
    if res.returncode != 0:
        raise RuntimeError(f"{launcher} {job} failed with exit code {res.returncode}:\n{res.stderr[-2000:]}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every job under every launcher")
    parser.add_argument("--starts", type=int, default=3, help="cold starts of each cluster")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    report: dict = {"cold_start_s": {}, "jobs": {}, "repeats": args.repeats, "cpus": os.cpu_count()}
    for kind, start in (("slurm", start_slurm), ("sge", start_sge)):
        report["cold_start_s"][kind] = statistics.median(cold_starts(start, args.starts))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="pslaunch-bench-") as tmp:
        for kind in ("slurm", "sge", "work"):
            (Path(tmp) / kind).mkdir()
        slurm_gen, sge_gen = start_slurm(Path(tmp) / "slurm"), start_sge(Path(tmp) / "sge")
        try:
            clusters = {"local": None, "slurm": next(slurm_gen), "sge": next(sge_gen)}
            workdir = Path(tmp) / "work"
            times = {(launcher, job): [] for launcher in clusters for job in JOBS}
            for _ in range(args.repeats):
                for job in JOBS:
                    for launcher, cluster in clusters.items():
                        job_env = env if cluster is None else cluster.client_env(env)
                        times[(launcher, job)].append(run_job(launcher, job, job_env, str(workdir)))
        finally:
            for gen in (slurm_gen, sge_gen):
                for _ in gen:
                    pass
    for job in JOBS:
        base = statistics.median(times[("local", job)])
        report["jobs"][job] = {launcher: {"median_s": statistics.median(times[(launcher, job)]),
                                          "ratio_to_local": statistics.median(times[(launcher, job)]) / base,
                                          "runs_s": times[(launcher, job)]}
                               for launcher in clusters}

    print(f"cold start (median of {args.starts}): " + ", ".join(
        f"{kind} {seconds:.2f} s" for kind, seconds in report["cold_start_s"].items()))
    print(f"{'job':8} {'launcher':8} {'median s':>9} {'x local':>8} {'+ s':>7}  runs (min-max s)")
    for job, rows in report["jobs"].items():
        for launcher, row in rows.items():
            extra = row["median_s"] - rows["local"]["median_s"]
            print(f"{job:8} {launcher:8} {row['median_s']:9.2f} {row['ratio_to_local']:8.2f} {extra:7.2f}  "
                  f"{min(row['runs_s']):.2f}-{max(row['runs_s']):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
