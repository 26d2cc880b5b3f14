"""Placement by bytes in real jobs: a million keys in one init call, and one key per call.

    python -m benchmarks.placement_jobs [--keys 1000000] [--servers 2,4,8,16] [--json out.json]

* **Many keys.** ``pslaunch -n 2 -s 2`` of a dist_sync job whose workers init ``--keys`` one-element
  float32 keys in one call, push ``rank + 1`` to every key in one call and pull them back in one
  (checked exactly): the seconds of each call as the workers measure them, the job's wall time, and
  the peak RSS of the scheduler, each server and each worker (``/proc``, ``benchmarks.job_watch``).
  Worker 0 copies the values it inits, places the keys, sends them and writes its decisions into the
  scheduler's ledger (``kvcore.stores.placement_book``); worker 1 reads them.
* **One key per call.** For ResNet-50 and 100 keys of random sizes (``testkit.model_shapes``) at
  each server count: ``pslaunch -n 2 -s S``, every worker inits one key per call, worker 0 in the
  model's order and worker 1 in reverse, then one push and pull of every key (checked exactly); the
  busiest server's ``held_bytes`` over the mean, from ``--summary-json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

import click

from benchmarks.job_watch import psnode_role, watch_job

REPO = Path(__file__).resolve().parent.parent

MANY = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import kvcore
    n = int(sys.argv[1])
    kv = kvcore.create("dist_sync")
    keys = list(range(n))
    start = time.perf_counter()
    kv.init(keys, [np.zeros(1, np.float32) for _ in keys])
    kv.barrier()  # every worker holds every key's place
    inited = time.perf_counter()
    kv.push(keys, [np.full(1, kv.rank + 1, np.float32) for _ in keys])
    pushed = time.perf_counter()
    outs = [np.empty(1, np.float32) for _ in keys]
    kv.pull(keys, out=outs)
    pulled = time.perf_counter()
    total = kv.num_workers * (kv.num_workers + 1) // 2
    assert all(o[0] == total for o in outs), "a sum is wrong"
    print("RESULT " + json.dumps({"rank": kv.rank, "pid": os.getpid(), "init_s": inited - start,
                                  "push_s": pushed - inited, "pull_s": pulled - pushed}), flush=True)
""")

PER_CALL = textwrap.dedent("""
    import sys
    import numpy as np
    import kvcore
    from testkit.model_shapes import MODELS
    shapes = MODELS[sys.argv[1]]()
    kv = kvcore.create("dist_sync")
    keys = list(range(len(shapes)))
    for k in (keys if kv.rank == 0 else keys[::-1]):  # one key per call, the two workers in opposite orders
        kv.init(k, np.zeros(shapes[k], np.float32))
    kv.push(keys, [np.full(shapes[k], kv.rank + 1, np.float32) for k in keys])
    outs = [np.empty(shapes[k], np.float32) for k in keys]
    kv.pull(keys, out=outs)
    assert all((o == 3).all() for o in outs), "a sum is wrong"
""")


def many_keys(keys: int) -> dict:
    """The job of ``--keys`` one-element keys (see the module docstring)."""
    tag = f"many-keys-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / f"{tag}.py"
        script.write_text(MANY)
        argv = [sys.executable, "-m", "launcher.cli", "-n", "2", "-s", "2", "--job-id", tag, "--timeout", "900",
                "--no-dashboard", sys.executable, str(script), str(keys)]
        watch = watch_job(argv, {**os.environ, "PYTHONPATH": str(REPO)}, tag, psnode_role(str(script)))
    if watch.returncode != 0:
        raise RuntimeError(f"the job of {keys} keys failed ({watch.returncode}):\n{watch.stderr[-3000:]}")
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in watch.stdout.splitlines() if "RESULT " in line]
    by_rank = {r["rank"]: r for r in results}
    peaks = {pid: kib / 1024 for pid, (_, kib) in watch.peaks_kib.items()}
    roles = {role: [peaks[pid] for pid, (r, _) in watch.peaks_kib.items() if r == role]
             for role in ("scheduler", "server", "worker")}
    return {"keys": keys, "wall_s": watch.wall_s,
            "calls_s": {rank: {k: r[k] for k in ("init_s", "push_s", "pull_s")} for rank, r in sorted(by_rank.items())},
            "rss_mib": {"scheduler": max(roles["scheduler"], default=0.0), "servers": roles["server"],
                        "worker 0": peaks.get(by_rank.get(0, {}).get("pid"), 0.0),
                        "worker 1": peaks.get(by_rank.get(1, {}).get("pid"), 0.0)}}


def per_call_table(server_counts: list[int]) -> list[dict]:
    """The one-key-per-call balance (see the module docstring), a row per model and server count."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "per_call.py"
        script.write_text(PER_CALL)
        for model in ("ResNet-50", "100 random keys"):
            for servers in server_counts:
                tag = f"per-call-{os.getpid()}-{servers}"
                summary = Path(tmp) / f"{tag}.json"
                argv = [sys.executable, "-m", "launcher.cli", "-n", "2", "-s", str(servers), "--job-id", tag,
                        "--summary-json", str(summary), "--timeout", "900", "--no-dashboard", sys.executable,
                        str(script), model]
                watch = watch_job(argv, {**os.environ, "PYTHONPATH": str(REPO)}, tag, psnode_role(str(script)))
                if watch.returncode != 0:
                    raise RuntimeError(f"{model} on {servers} servers failed:\n{watch.stderr[-3000:]}")
                held = [p["held_bytes"] for p in json.loads(summary.read_text())["processes"] if p["role"] == "server"]
                rows.append({"model": model, "servers": servers, "held_bytes": held,
                             "balance": max(held) * servers / sum(held), "wall_s": watch.wall_s})
    return rows


def print_many_keys(result: dict) -> None:
    print(f"{result['keys']:,} one-element keys in one init call, 2 workers x 2 servers: {result['wall_s']:.1f} s")
    for rank, calls in result["calls_s"].items():
        print(f"  worker {rank}: init {calls['init_s']:.1f} s, push {calls['push_s']:.1f} s, pull {calls['pull_s']:.1f} s")
    rss = result["rss_mib"]
    print(f"  peak RSS: scheduler {rss['scheduler']:.0f} MiB, worker 0 {rss['worker 0']:.0f} MiB, "
          f"worker 1 {rss['worker 1']:.0f} MiB, servers {', '.join(f'{m:.0f}' for m in rss['servers'])} MiB")


def print_per_call(rows: list[dict]) -> None:
    counts = sorted({r["servers"] for r in rows})
    print("one key per call, the workers in opposite orders: busiest server's held bytes / mean")
    print(f"{'model':18s} " + "  ".join(f"S={s:<6d}" for s in counts))
    for model in dict.fromkeys(r["model"] for r in rows):
        print(f"{model:18s} " + "  ".join(f"{r['balance']:<8.3f}" for r in rows if r["model"] == model))


@click.command()
@click.option("--keys", default=1_000_000, show_default=True, help="Keys of the one init call (0 leaves it out).")
@click.option("--servers", default="2,4,8,16", show_default=True,
              help="Server counts of the one-key-per-call table ('' leaves it out).")
@click.option("--json", "json_path", default=None)
def main(keys: int, servers: str, json_path: str | None) -> None:
    report: dict = {}
    if keys:
        report["many_keys"] = many_keys(keys)
        print_many_keys(report["many_keys"])
    if servers:
        report["per_call"] = per_call_table([int(s) for s in servers.split(",")])
        print_per_call(report["per_call"])
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
