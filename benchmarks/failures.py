"""What failures cost a training job: each run's wall time against an uninterrupted run's, in one run.

    python -m benchmarks.failures [--models mlp,resnet20] [--kills 5] [--quick] [--json out.json]
        [--log-dir DIR]

For each model (the digits MLP, ``examples/train_mlp.py``, and ResNet-20, ``examples/train_resnet.py``;
2 workers, 2 servers, ``dist_sync``, each example resumable through ``kvcore.elastic.State``):

- **uninterrupted**: the job as it is; its wall time is the reference;
- **ready to replace, no kill**: the same under ``--restart-scope worker``: what being ready costs (the
  marks, and the earlier values the servers keep, given against the model's bytes they hold);
- **worker, replaced in place**: ``--restart-scope worker --max-restarts K`` with no checkpoint
  directory; ``--kills`` times a worker (rank 1, 0, 1, ...) is killed with SIGKILL from outside, at
  evenly spaced moments of the reference's wall time, each once that worker has run ``--min-age``
  seconds (a worker still starting is not hit); the replacements redo their steps from their marks
  while the others go on;
- **job, from a checkpoint**: the same kills under ``--restart-scope job --checkpoint-dir`` (the
  example commits at the end of each epoch): every kill stops the job and starts it again from the
  last checkpoint (torchrun's and Ray Train's model).
- **replicas kept, no kill**: ``--server-replicas 1`` alone: what keeping replicas costs a job that
  loses nothing (a copy of every push for the replicas, no shared memory on one host);
- **server, its replica takes over**: ``--server-replicas 1`` and no restart: one server (not a
  replica) is killed with SIGKILL from outside halfway through the reference's wall time; its
  replica serves its keys from then on and no process is started again;
- **server, job from a checkpoint**: the same kill under ``--restart-scope job --checkpoint-dir``
  (today's way without replicas): the job starts again from the last checkpoint.
- **elastic, no change** (MLP only: its example trains in an elastic job): ``-n 2:3``, three workers
  throughout; the reference of the next two rows;
- **elastic, a worker leaves**: worker 2 gets SIGTERM (a preempted pod) halfway; it finishes its step
  and leaves, the two others go on (no process started again);
- **elastic, a worker is lost**: worker 2 gets SIGKILL halfway; the job drops it and goes on.

Each row gives the wall time, its ratio to the uninterrupted run's, the kills that landed and the
seconds each cost (the wall time over the uninterrupted run's, per kill), how long the others
waited for each replacement (pslaunch's ``RunResult.replacements``), the earlier values the servers
keep for replacements against the model's bytes (``--summary-json``'s ``kept_bytes`` and
``held_bytes``, as last reported) and whether the final weights
equal the uninterrupted run's bit for bit (worker 0 saves them, ``--save-weights``). A kill that
would land after the job ended is not made; the row counts those that did.

Exit status: 0 when every job succeeded, 1 otherwise, 2 for bad options.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from testkit.launcher import job_server, job_worker

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLES = ROOT / "examples"

#: Each model's example and its arguments (full, and ``--quick``).
MODELS = {
    "mlp": ("train_mlp.py", ["--epochs", "120", "--hidden", "2048"], ["--epochs", "20", "--hidden", "512"]),
    "resnet20": ("train_resnet.py", ["--epochs", "3", "--train-size", "2000", "--test-size", "500"],
                 ["--epochs", "1", "--train-size", "600", "--test-size", "100"]),
}


class Killer(threading.Thread):
    """Kills a worker of the job whose command line holds ``tag`` at each of ``moments`` (seconds
    after ``start``), ranks 1, 0, 1, ... in turn; waits for that worker to have run ``min_age``
    seconds first (a replacement, or a restarted job, training again: not one still starting).
    ``whole_job``: each kill restarts the job, so the next one waits for a worker of the next
    attempt (``PSLAUNCH_RESTART_COUNT``), not one of the attempt being stopped."""

    def __init__(self, tag: str, moments: list[float], start: float, min_age: float, whole_job: bool,
                 role: str = "worker", rank: int | None = None, how: int = signal.SIGKILL) -> None:
        super().__init__(daemon=True)
        self.tag, self.moments, self.start_at, self.min_age = tag, moments, start, min_age
        self.whole_job, self.role, self.rank, self.how = whole_job, role, rank, how
        self.killed: list[tuple[float, int, int]] = []  # (seconds after start, rank, pid)
        self.stopped = threading.Event()

    def run(self) -> None:
        for i, moment in enumerate(self.moments):
            rank = (i + 1) % 2 if self.rank is None else self.rank
            while not self.stopped.is_set() and time.monotonic() - self.start_at < moment:
                time.sleep(0.01)
            while not self.stopped.is_set():
                attempt = len(self.killed) if self.whole_job else None
                pid = (job_server(self.tag, self.min_age) if self.role == "server"
                       else job_worker(self.tag, rank, self.min_age, attempt))
                if pid is not None:
                    try:
                        os.kill(pid, self.how)
                    except ProcessLookupError:
                        continue
                    self.killed.append((round(time.monotonic() - self.start_at, 2), rank, pid))
                    break
                time.sleep(0.02)
            if self.stopped.is_set():
                return


def run_case(model: str, case: str, args: argparse.Namespace, work: Path, reference_s: float | None) -> dict:
    """One job of ``model`` under ``case`` (``uninterrupted``, ``ready``, ``worker``, ``job``); its row."""
    from launcher import launch

    script, full, quick = MODELS[model]
    out = work / f"{model}-{case}"
    out.mkdir()
    weights = out / "weights.npz"
    summary = out / "summary.json"
    options: dict = {"summary_json": str(summary)}
    if case == "ready":  # no kill: what being ready for replacements costs (marks, the values servers keep)
        options.update(max_restarts=1, restart_scope="worker")
    elif case == "worker":
        options.update(max_restarts=args.kills, restart_scope="worker")
    elif case == "job":
        options.update(max_restarts=args.kills, restart_scope="job", checkpoint_dir=str(out / "ckpt"))
    elif case in ("server", "replicas"):  # a replica of each server's keys, and no restart at all
        options.update(server_replicas=1)
    elif case == "server-job":
        options.update(max_restarts=1, restart_scope="job", checkpoint_dir=str(out / "ckpt"))
    workers: int | str = "2:3" if case.startswith("elastic") else 2
    if args.log_dir is not None:
        options["log_dir"] = str(args.log_dir / f"{model}-{case}")
    argv = [sys.executable, str(EXAMPLES / script), *(quick if args.quick else full), "--save-weights", str(weights)]
    killer = None
    start = time.monotonic()
    if case in ("worker", "job"):
        assert reference_s is not None
        moments = [reference_s * (i + 1) / (args.kills + 1) for i in range(args.kills)]
        killer = Killer(str(weights), moments, start, args.min_age, whole_job=case == "job")
        killer.start()
    elif case in ("server", "server-job"):  # one server, mid-run
        assert reference_s is not None
        killer = Killer(str(weights), [reference_s / 2], start, args.min_age, whole_job=case == "server-job",
                        role="server")
        killer.start()
    elif case in ("elastic-leave", "elastic-lost"):  # worker 2 of three, mid-run: it leaves, or it is lost
        assert reference_s is not None
        killer = Killer(str(weights), [reference_s / 2], start, args.min_age, whole_job=False, rank=2,
                        how=signal.SIGTERM if case == "elastic-leave" else signal.SIGKILL)
        killer.start()
    try:
        # every process carries the tag: the killer finds the job's servers by it
        result = launch(argv, num_workers=workers, num_servers=2, timeout=args.job_timeout,
                        env={"OMP_NUM_THREADS": "1", "PSLAUNCH_BENCH_TAG": str(weights)}, **options)
    finally:
        wall = time.monotonic() - start
        if killer is not None:
            killer.stopped.set()
            killer.join(5)
    if result.exit_code in (128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGHUP):
        raise SystemExit(result.exit_code)  # pslaunch stopped the job for a signal meant for this run: stop here
    row: dict = {"model": model, "case": case, "wall_s": round(wall, 2), "ok": result.ok,
                 "kills": [] if killer is None else killer.killed, "weights": str(weights)}
    if not result.ok:
        cause = result.root_cause
        said = f" ({cause.error_line or ' / '.join(cause.last_lines[-3:])})" if cause and cause.last_lines else ""
        row["error"] = f"exit code {result.exit_code}: {cause.reason if cause else 'no root cause'}{said}"
    if reference_s:
        row["vs_uninterrupted"] = round(wall / reference_s, 3)
        if row["kills"]:
            row["seconds_per_kill"] = round((wall - reference_s) / len(row["kills"]), 2)
    row["replacements"] = [{"process": r.process, "waited_s": r.waited_s, "resumed_from": r.resumed_from}
                           for r in result.replacements]
    # a kill that landed after the worker's finish (a quick run's end): nothing to replace or restart
    row["ended_after_their_part"] = [p.name for p in result.processes if p.note == "ended after its part was done"]
    row["restarts_of_the_job"] = sum(1 for a in result.attempts if a.action.startswith("restarted the job"))
    if summary.exists():
        servers = [p for p in json.loads(summary.read_text())["processes"] if p["role"] in ("server", "replica")]
        row["held_bytes"] = sum(p.get("held_bytes") or 0 for p in servers)
        row["kept_bytes"] = sum(p.get("kept_bytes") or 0 for p in servers)
    return row


def same_weights(a: Path, b: Path) -> bool | None:
    """Whether two saved weight files hold equal arrays, bit for bit (None when one is missing)."""
    if not (a.exists() and b.exists()):
        return None
    with np.load(a) as x, np.load(b) as y:
        return x.files == y.files and all(np.array_equal(x[k], y[k]) for k in x.files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,resnet20", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--kills", type=int, default=5, help="worker kills per run")
    parser.add_argument("--quick", action="store_true", help="small runs (a smoke test)")
    parser.add_argument("--min-age", type=float, default=3.0,
                        help="seconds a worker runs before it may be killed (its start: imports, registering)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None, help="keep every process's output here")
    parser.add_argument("--job-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        parser.error(f"--models {args.models!r}: unknown {', '.join(unknown) or '(none given)'}; "
                     f"the models are {', '.join(MODELS)}")
    if args.kills < 1:
        parser.error(f"--kills {args.kills}: at least 1")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds: jobs reaped, files removed
    report: dict = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                    "python": platform.python_version(), "cpus": os.cpu_count(), "kills": args.kills,
                    "quick": args.quick, "rows": []}
    failed = False
    print("| model | case | wall | vs uninterrupted | kills | s per kill | job restarts | the others waited (each) "
          "| servers keep (x the model) | weights equal |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="pslaunch-failures-") as tmp:
        work = Path(tmp)
        for model in models:
            reference = run_case(model, "uninterrupted", args, work, None)
            rows = [reference]
            if reference["ok"]:
                for case in ("ready", "worker", "job", "replicas", "server", "server-job"):
                    rows.append(run_case(model, case, args, work, reference["wall_s"]))
            for row in rows:
                row["weights_equal"] = same_weights(Path(row["weights"]), Path(reference["weights"])) \
                    if row is not reference else None
                failed = failed or not row["ok"]
                report["rows"].append(row)
                print(_line(row), flush=True)
            if model == "mlp" and reference["ok"]:  # the example that trains in an elastic job
                elastic = run_case(model, "elastic", args, work, None)
                rows = [elastic]
                if elastic["ok"]:
                    rows += [run_case(model, case, args, work, elastic["wall_s"])
                             for case in ("elastic-leave", "elastic-lost")]
                for row in rows:  # a run of three workers, then two: not the uninterrupted run's weights
                    row["weights_equal"] = None
                    failed = failed or not row["ok"]
                    report["rows"].append(row)
                    print(_line(row), flush=True)
            for case in ("job", "server-job"):
                shutil.rmtree(work / f"{model}-{case}" / "ckpt", ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


_CASES = {"uninterrupted": "uninterrupted", "ready": "ready to replace, no kill", "worker": "worker, replaced in place",
          "job": "job, from a checkpoint", "replicas": "replicas kept, no kill", "server": "server, its replica takes over",
          "server-job": "server, job from a checkpoint", "elastic": "elastic (-n 2:3), no change",
          "elastic-leave": "elastic, a worker leaves (SIGTERM)", "elastic-lost": "elastic, a worker is lost (SIGKILL)"}


def _line(row: dict) -> str:
    if not row["ok"]:
        return f"| {row['model']} | {_CASES[row['case']]} | FAILED: {row['error'][:900]} | | | | | | | |"
    waits = ", ".join(f"{r['waited_s']:.2f}" for r in row["replacements"] if r["waited_s"] is not None) or "-"
    equal = {None: "-", True: "yes", False: "no"}[row["weights_equal"]]
    ratio = f"{row['vs_uninterrupted']:.2f}x" if "vs_uninterrupted" in row else "1x"
    per_kill = f"{row['seconds_per_kill']:.2f}" if "seconds_per_kill" in row else "-"
    # the servers' memory for replacements: the earlier values they keep beside the model
    kept = f"{row['kept_bytes'] / row['held_bytes']:.1f}x" if row.get("held_bytes") else "-"
    return (f"| {row['model']} | {_CASES[row['case']]} | {row['wall_s']:.1f} s | {ratio} | {len(row['kills'])} | "
            f"{per_kill} | {row['restarts_of_the_job']} | {waits} | {kept} | {equal} |")


if __name__ == "__main__":
    sys.exit(main())
