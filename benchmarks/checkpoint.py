"""How long a checkpoint commit takes, against ``numpy.save`` of the same bytes on the same disk, and
how long a job takes from a worker's failure to training resumed after the restart.

    python -m benchmarks.checkpoint [--sizes-mib 100,1024] [--reps 3] [--servers 1] [--dir DIR]
        [--skip-restart] [--json out.json]

Commit: a job of 1 worker and ``--servers`` servers (``testkit.LocalJob``) holds one float32
key of each size, split in parts across the servers. The worker (``checkpoint_worker.py``) times,
``--reps`` times in a rotating order, ``kvcore.elastic.State.commit()`` (until it returns: every
server wrote its file; the sync to disk and the manifest follow in the background, waited for
before the next measure), ``commit(wait=True)`` (until the checkpoint is complete and on disk),
and ``numpy.save`` of the same array into the same directory, without and with an fsync. A figure
is the median over the repetitions; a ratio is the median of the per-repetition ratios: commit over
numpy.save (the target: at most 1.5), and the waited commit over numpy.save with an fsync (the same
durability).

Restart-to-resume: ``pslaunch -n 2 -s 2 --max-restarts 1 --checkpoint-dir`` runs a short training
(commits every 5 steps) whose worker 1 raises at step 17 on the first start; the figure is the time
from its failure to worker 0 of the restarted job having restored the checkpoint (pslaunch stops
the job, starts it again, the nodes register, the servers load checkpoint 3).

Everything written (checkpoints, baselines) is removed at the end. Exit status: 0 when every job
succeeded, 1 otherwise, 2 for bad options.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit import JobFailed, LocalJob

HERE = Path(__file__).resolve().parent
WORKER = HERE / "checkpoint_worker.py"
ROOT = HERE.parent


def measure_commit(nbytes: int, reps: int, servers: int, directory: Path, timeout_s: float) -> dict:
    """One job; ``{"seconds": {measure: [per repetition]}}``.

    Raises:
        JobFailed: a process failed, printed no result, or ran past ``timeout_s``.
    """
    ckpt = directory / "ckpt"
    env = {"PSLAUNCH_CHECKPOINT_DIR": str(ckpt)}
    try:
        with LocalJob(1, servers, worker=[str(WORKER), "commit", str(nbytes), str(reps), str(directory)], env=env,
                      test_settings=False) as job:
            job.wait_ok(["worker"], timeout_s)
            output = job.output_of("worker", 0)
            job.wait_ok(["scheduler", "server"], 60)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    for line in output.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise JobFailed(f"the worker printed no result:\n{output[-2000:]}")


def _ratio(slow: list[float], fast: list[float]) -> float:
    """The median of the per-repetition ratios (each repetition ran both back to back)."""
    return statistics.median(a / b for a, b in zip(slow, fast))


def measure_restart(directory: Path, timeout_s: float) -> dict:
    """Run the failing training under pslaunch; ``{"seconds": failure to resumed, "pslaunch_s": ...}``."""
    out = directory / "restart"
    out.mkdir()
    from launcher import launch  # pslaunch from Python: its result, not its output, says what happened

    start = time.monotonic()
    result = launch([sys.executable, str(WORKER), "train", str(out)], num_workers=2, num_servers=2, max_restarts=1,
                    checkpoint_dir=str(directory / "restart-ckpt"), timeout=timeout_s)
    took = time.monotonic() - start
    shutil.rmtree(directory / "restart-ckpt", ignore_errors=True)
    if not result.ok:
        cause = result.root_cause
        raise JobFailed(f"pslaunch ended with exit code {result.exit_code}: {cause.reason} ({cause.process}); "
                        f"its last lines:\n" + "\n".join(cause.last_lines))
    if len(result.attempts) != 2 or not result.attempts[0].action.startswith("restarted the job"):
        raise JobFailed(f"the job did not fail once and resume: {result.attempts}")  # what the figure assumes
    fault = float((out / "fault.time").read_text())
    resumed = float((out / "resumed.time").read_text())
    return {"seconds": resumed - fault, "pslaunch_s": took}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", default="100,1024", help="server state per job, MiB (comma-separated)")
    parser.add_argument("--reps", type=int, default=3, help="commits (and saves) per size")
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--skip-restart", action="store_true", help="no restart-to-resume measure")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--job-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds: jobs reaped, files removed
    try:
        sizes = [float(s) for s in args.sizes_mib.split(",")]
    except ValueError:
        parser.error(f"--sizes-mib {args.sizes_mib!r} is not a list of numbers")
    if any(s <= 0 for s in sizes) or args.reps < 1 or args.servers < 1:
        parser.error("sizes must be positive, --reps and --servers at least 1")
    report: dict = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                    "python": platform.python_version(), "servers": args.servers, "reps": args.reps, "rows": []}
    failed = False
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pslaunch-ckpt-bench-", dir=args.dir) as tmp:
        report["dir"] = tmp
        print(f"writing in {tmp}; {args.servers} server(s), median of {args.reps}", flush=True)
        print(f"{'MiB':>7} {'commit s':>9} {'np.save s':>10} {'commit/save':>12} {'+wait s':>8} {'+fsync s':>9} "
              f"{'commit+wait/save+fsync':>23}")
        for size in sizes:
            nbytes = int(size * (1 << 20)) // 4 * 4
            row: dict = {"mib": size, "nbytes": nbytes}
            try:
                seconds = measure_commit(nbytes, args.reps, args.servers, Path(tmp), args.job_timeout)["seconds"]
                medians = {name: statistics.median(values) for name, values in seconds.items()}
                row.update(seconds=seconds, median=medians,
                           commit_over_save=_ratio(seconds["commit"], seconds["numpy.save"]),
                           waited_over_save_fsync=_ratio(seconds["commit+wait"], seconds["numpy.save+fsync"]))
                print(f"{size:7g} {medians['commit']:9.3f} {medians['numpy.save']:10.3f} {row['commit_over_save']:11.2f}x "
                      f"{medians['commit+wait']:8.3f} {medians['numpy.save+fsync']:9.3f} "
                      f"{row['waited_over_save_fsync']:22.2f}x", flush=True)
            except (JobFailed, OSError) as exc:
                row["error"] = str(exc)
                failed = True
                print(f"{size:7g} FAILED {str(exc)[:500]}", flush=True)
            report["rows"].append(row)
        if not args.skip_restart:
            try:
                report["restart"] = measure_restart(Path(tmp), 300.0)
                print(f"restart-to-resume of the test job (worker 1 fails at step 17, 2 workers, 2 servers): "
                      f"{report['restart']['seconds']:.2f} s (the whole pslaunch run: "
                      f"{report['restart']['pslaunch_s']:.2f} s)", flush=True)
            except (JobFailed, OSError, subprocess.TimeoutExpired) as exc:
                report["restart"] = {"error": str(exc)}
                failed = True
                print(f"restart-to-resume FAILED {str(exc)[:500]}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
