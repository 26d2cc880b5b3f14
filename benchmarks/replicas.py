"""What servers that keep replicas cost and what they buy (``--server-replicas``), in one run.

    python -m benchmarks.replicas [--quick] [--reps 3] [--kills 3] [--json out.json]

With 2 workers and 2 servers on this machine (pslaunch ``--launcher local``), the worker
``benchmarks/replicas_worker.py`` pushes and pulls one 4 MiB float32 key (split over the two
servers) round after round:

- **throughput**: push+pull MB/s per worker (the key's bytes both ways, per second) with
  ``--server-replicas 0`` (on the default path, where a server on the same host reads pushes from
  shared memory, and over TCP alone) and ``1`` (which sends over the sockets: a replica reads its
  own copy), back to back in each repetition (the order alternates); the ratios are medians of the
  per-repetition ratios;
- **memory**: what the servers and replicas hold (``--summary-json``'s ``held_bytes`` and
  ``kept_bytes``, each process's resident memory) against the model's bytes;
- **a server killed**: with ``--server-replicas 1`` and a pause of 20 ms between rounds, a server is
  killed with SIGKILL from outside mid-run (2.5 s after the job started), ``--kills`` times (a job
  each). *Kill to next round* is the time from the kill to the end of the round it interrupted (the
  longest wait between two rounds of a worker after the kill); the usual round is the median round
  time of that run. Each job must end with exit 0 and the right values.

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
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from testkit.launcher import live_processes

HERE = Path(__file__).resolve().parent
WORKER = HERE / "replicas_worker.py"
KEY_BYTES = 4 << 20


def _job(work: Path, name: str, replicas: int, rounds: int, pause: float, kill_after: float | None = None,
         tcp: bool = False) -> dict:
    """One job; its row: throughput (MB/s per worker), memory, and the kill's figures when one was made."""
    from launcher import launch

    out = work / name
    out.mkdir()
    summary = out / "summary.json"
    killed: dict = {}
    stop = threading.Event()

    def killer() -> None:
        # a server of this job (not a replica), found by the variables every process of it has
        if stop.wait(kill_after or 0):
            return
        for proc in live_processes():
            environ = proc.environ()
            if (environ.get(b"PSLAUNCH_BENCH_TAG") == str(out).encode() and environ.get(b"DMLC_ROLE") == b"server"
                    and environ.get(b"PSLAUNCH_SERVER_REPLICA") != b"1"):
                killed["at"] = time.monotonic()
                os.kill(proc.pid, signal.SIGKILL)
                killed["pid"] = proc.pid
                return

    thread = None
    if kill_after is not None:
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
    start = time.monotonic()
    result = launch([sys.executable, str(WORKER), str(out), str(rounds), str(pause)], num_workers=2, num_servers=2,
                    server_replicas=replicas, summary_json=str(summary), timeout=240,
                    env={"OMP_NUM_THREADS": "1", "PSLAUNCH_BENCH_TAG": str(out),
                         **({"PSLAUNCH_SAME_HOST": "tcp"} if tcp else {})})
    wall = time.monotonic() - start
    stop.set()
    if thread is not None:
        thread.join(5)
    row: dict = {"name": name, "replicas": replicas, "tcp": tcp, "ok": result.ok, "wall_s": round(wall, 2)}
    if not result.ok:
        cause = result.root_cause
        row["error"] = f"exit code {result.exit_code}: {cause.reason if cause else 'no root cause'}"
        return row
    stamps = [[float(x) for x in (out / f"rounds.{rank}").read_text().split()] for rank in (0, 1)]
    times = [b - a for s in stamps for a, b in zip(s, s[1:])]
    round_s = statistics.median(times)
    row["round_ms"] = round(round_s * 1e3, 2)
    row["mb_per_s"] = round(2 * KEY_BYTES / max(round_s - pause, 1e-9) / 1e6, 1)
    if summary.exists():
        processes = json.loads(summary.read_text())["processes"]
        holders = [p for p in processes if p["role"] in ("server", "replica")]
        row["held_bytes"] = sum(p.get("held_bytes") or 0 for p in holders)
        row["kept_bytes"] = sum(p.get("kept_bytes") or 0 for p in holders)
        row["holders_rss_bytes"] = sum(p.get("rss_bytes") or 0 for p in holders)
    if kill_after is not None:
        if "at" not in killed:
            row["ok"], row["error"] = False, "no server was killed"
            return row
        # the round the kill interrupted: the longest wait between two rounds of a worker that ended after it
        gaps = [(b - a, b) for s in stamps for a, b in zip(s, s[1:]) if b > killed["at"]]
        if not gaps:
            row["ok"], row["error"] = False, "no round ended after the kill"
            return row
        longest, ended = max(gaps)
        row["kill_to_next_round_s"] = round(ended - killed["at"], 3)
        row["interrupted_round_ms"] = round(longest * 1e3, 1)
        row["rounds_after_kill"] = sum(1 for s in stamps for t in s if t > killed["at"])
        row["killed_pid"] = killed["pid"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replicas", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the throughput pair")
    parser.add_argument("--kills", type=int, default=3, help="jobs in which a server is killed")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.kills < 0:
        parser.error("--reps must be >= 1 and --kills >= 0")
    rounds = 15 if args.quick else 60
    work = Path(tempfile.mkdtemp(prefix="pslaunch-replicas-"))
    report: dict = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "rows": []}
    rows = report["rows"]
    try:
        systems = [("r0", 0, False), ("r0-tcp", 0, True), ("r1", 1, False)]
        for rep in range(args.reps):
            for label, replicas, tcp in (systems if rep % 2 == 0 else systems[::-1]):
                rows.append(_job(work, f"throughput-{label}-{rep}", replicas, rounds, 0.0, tcp=tcp))
        for kill in range(args.kills):
            rows.append(_job(work, f"kill-{kill}", 1, 200, 0.02, kill_after=2.5))  # about 6 s: the kill lands mid-run
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failed = [r for r in rows if not r["ok"]]
    ratios: dict[str, list[float]] = {"default": [], "tcp": []}
    for rep in range(args.reps):
        found = {r["name"].split("-", 1)[1].rsplit("-", 1)[0]: r for r in rows if r["name"].endswith(f"-{rep}")
                 and r["name"].startswith("throughput-")}
        replicated = found.get("r1")
        for base, label in (("r0", "default"), ("r0-tcp", "tcp")):
            if replicated and base in found and replicated["ok"] and found[base]["ok"]:
                ratios[label].append(replicated["mb_per_s"] / found[base]["mb_per_s"])
    report["throughput_ratio"] = {label: round(statistics.median(v), 3) if v else None for label, v in ratios.items()}
    print("| run | replicas | round | MB/s per worker | held by servers and replicas | kept | their RSS "
          "| kill to next round | the round it interrupted |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        if not row["ok"]:
            print(f"| {row['name']} | {row['replicas']} | FAILED: {row['error'][:200]} | | | | | | |")
            continue
        kill = f"{row['kill_to_next_round_s']:.3f} s" if row.get("kill_to_next_round_s") is not None else "-"
        interrupted = f"{row['interrupted_round_ms']:.0f} ms" if "interrupted_round_ms" in row else "-"
        print(f"| {row['name']} | {row['replicas']} | {row['round_ms']:.1f} ms | {row['mb_per_s']:.0f} | "
              f"{row.get('held_bytes', 0) / KEY_BYTES:.1f}x the key | {row.get('kept_bytes', 0) / KEY_BYTES:.1f}x | "
              f"{row.get('holders_rss_bytes', 0) / 2**20:.0f} MiB | {kill} | {interrupted} |")
    ratio = report["throughput_ratio"]
    print(f"throughput with --server-replicas 1 / 0: {ratio['default']}x against the default path (same host: shared "
          f"memory), {ratio['tcp']}x against TCP (PSLAUNCH_SAME_HOST=tcp); medians of {args.reps}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
