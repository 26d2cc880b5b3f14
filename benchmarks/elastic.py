"""What a worker leaving or joining an elastic job costs the others: from the event to the first round
with the new membership.

    python -m benchmarks.elastic [--reps 5] [--step-sleep 0.02] [--json FILE]

Each repetition runs ``pslaunch -n 2:3 -s 1`` (``benchmarks/elastic_worker.py``: a 4 KiB key pushed and
pulled every step, ``--step-sleep`` seconds of "compute" after each) and, once the job runs, sends worker
2 SIGTERM from outside (a preempted pod). The worker finishes its step and leaves at its next push
(``kvcore.leaving``). From worker 0's log (``time.time()`` after each pull, one clock: one machine):

* **leave**: from the SIGTERM to the end of the first round that sums workers 0 and 1 only (its value
  3): the rest of the leaver's step, its leave (a round trip to the scheduler, which tells every
  node) and the others' round closing without it;
* **step**: worker 0's median step before the SIGTERM, for scale;
* **the step of the leave**: worker 0's step that ended with that first round, against a usual one.

Each repetition then runs the job by hand with ``PSLAUNCH_START_WORKERS=2`` of ``DMLC_NUM_WORKER=3`` and
starts a third worker once it runs (capacity that appeared). It joins (``psnode.scheduler.elastic``):

* **join, from its start**: from starting its process to the end of the first round that sums workers
  0, 1 and 2 (its value 6): the interpreter and imports, its registration, the servers' freeze and the
  agreed start round (two rounds ahead);
* **join, from its registration**: the same from the moment its imports were done (``kvcore.create``);
* **the step of the join**: worker 0's step that ended with that first round, against a usual one.

No process is started or stopped but the leaver or the joiner; under torchrun the same event
restarts every worker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit import free_port, reap
from testkit.launcher import job_worker

REPO = Path(__file__).resolve().parent.parent


def one_run(step_sleep: float, work: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix="elastic-", dir=work))
    env = {**os.environ, "PYTHONPATH": str(REPO), "STEPS": "100000", "STEP_SLEEP": str(step_sleep)}
    argv = [sys.executable, "-m", "launcher.cli", "-n", "2:3", "-s", "1", "--no-dashboard", "--timeout", "120",
            sys.executable, str(REPO / "benchmarks" / "elastic_worker.py"), str(out)]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        log0 = out / "steps.0.txt"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not log0.exists() or log0.read_text().count("\n") < 50):
            time.sleep(0.05)
        pid = job_worker(str(out), 2)
        if pid is None:
            raise RuntimeError("worker 2 is not running")
        sent = time.time()
        os.kill(pid, signal.SIGTERM)
        while time.monotonic() < deadline:
            rows = [line.split() for line in log0.read_text().splitlines()]
            if any(float(r[3]) == 3.0 and float(r[2]) > sent for r in rows if len(r) == 4):
                break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    rows = [(int(r[1]), float(r[2]), float(r[3])) for r in (line.split() for line in log0.read_text().splitlines())
            if len(r) == 4]
    first = next(i for i, (_, t, v) in enumerate(rows) if v == 3.0 and t > sent)
    before = [b - a for (_, a, _), (_, b, _) in zip(rows, rows[1:]) if b < sent]
    return {"leave_s": rows[first][1] - sent, "step_s": statistics.median(before),
            "leave_step_s": rows[first][1] - rows[first - 1][1]}


def one_join(step_sleep: float, work: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix="join-", dir=work))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLAUNCH_"))}
    base.update(PYTHONPATH=str(REPO), DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()),
                DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="3", PSLAUNCH_MIN_WORKERS="2", PSLAUNCH_START_WORKERS="2",
                STEPS="100000", STEP_SLEEP=str(step_sleep))
    script = str(REPO / "benchmarks" / "elastic_worker.py")
    procs = []

    def start(role: str, **extra: str) -> None:
        procs.append(subprocess.Popen([sys.executable, script, str(out)], env={**base, "DMLC_ROLE": role, **extra},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))

    log0 = out / "steps.0.txt"
    try:
        for role in ("scheduler", "server", "worker", "worker"):
            start(role)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not log0.exists() or log0.read_text().count("\n") < 50):
            time.sleep(0.05)
        started = time.time()
        start("worker", JOINER="1")
        while time.monotonic() < deadline and not any(
                float(r[3]) == 6.0 for r in (line.split() for line in log0.read_text().splitlines()) if len(r) == 4):
            time.sleep(0.05)
    finally:
        reap(procs)
    rows = [(int(r[1]), float(r[2]), float(r[3])) for r in (line.split() for line in log0.read_text().splitlines())
            if len(r) == 4]
    first = next(i for i, (_, _, v) in enumerate(rows) if v == 6.0)
    registered = float((out / "joiner.txt").read_text())
    before = [b - a for (_, a, _), (_, b, _) in zip(rows, rows[1:]) if b < started]
    return {"join_s": rows[first][1] - started, "join_registered_s": rows[first][1] - registered,
            "join_step_s": rows[first][1] - rows[first - 1][1], "join_usual_step_s": statistics.median(before)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [{**one_run(args.step_sleep, Path(tmp)), **one_join(args.step_sleep, Path(tmp))}
                for _ in range(args.reps)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"a worker leaving pslaunch -n 2:3 -s 1, and one joining the same job by hand, {args.reps} runs, "
          f"--step-sleep {args.step_sleep:g} (median; min-max), {len(os.sched_getaffinity(0))} cores")
    for key, what in (("leave_s", "SIGTERM to the first round without it"), ("step_s", "a usual step of worker 0"),
                      ("leave_step_s", "worker 0's step that ended with that round"),
                      ("join_s", "joiner's start to the first round with it"),
                      ("join_registered_s", "joiner's registration to that round"),
                      ("join_step_s", "worker 0's step that ended with it"),
                      ("join_usual_step_s", "a usual step of worker 0 there")):
        values = [r[key] for r in runs]
        print(f"  {what:45s} {med[key] * 1000:8.1f} ms ({min(values) * 1000:.1f}-{max(values) * 1000:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "median": med}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
