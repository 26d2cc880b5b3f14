"""Parameter servers against a ring on capped links: communication time per step for a fixed model, as
the workers and the server hosts grow.

    python -m benchmarks.ps_vs_ring [--workers 2,4,8] [--servers 1,2,W] [--rate 100mbit] [--mib 8]
        [--tensors 16] [--rounds 3] [--reps 1] [--quick] [--json out.json] [--plot docs/images/ps_vs_ring.png]

A simulated cluster (``testkit.netns``): every worker on a host of its own, every server on a host of
its own (the scheduler beside server 0, or beside worker 0 for the ring), every host's link shaped
with ``tc tbf`` at ``--rate`` each way. Each job pushes and pulls a ``--mib`` MiB float32 model of
``--tensors`` tensors (``benchmarks/ps_vs_ring_worker.py``: from a barrier until every pulled value
is in, checked), through ``dist_sync`` with S servers (``-s S``; placement by bytes spreads the
tensors evenly) or through the ``allreduce`` store (``-s 0``: a ring over the workers' hosts). A
job's figure is the median round of the slowest worker.

The model beside each figure is the link time alone, ``M`` the model's bytes and ``B`` the rate:

- ring: each worker sends and receives ``2 (W - 1) / W x M``: ``2 (W - 1) / W x M / B``;
- parameter servers: each worker sends ``M`` and receives ``M`` (its worker link: ``M / B``), and
  each server host sends and receives ``W x M / S`` (its link: ``W M / (S B)``); the slower link sets
  the time: ``max(1, W / S) x M / B``. With ``S = W`` server hosts, ``M / B``: less than the ring's
  ``2 (W - 1) / W x M / B`` from W = 3 on, for twice the hosts.

Exit status: 0 when every job ran, 1 when one failed (the JSON says which), 2 for bad options or
no namespaces here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from testkit import JobFailed, LocalJob
from testkit.netns import NetnsCluster, NetnsError, usable

from . import plots
from .capped_link import rate_bytes
from .jobs import read_result

HERE = Path(__file__).resolve().parent
WORKER = HERE / "ps_vs_ring_worker.py"


def model_seconds(design: str, workers: int, servers: int, model_bytes: float, rate: float) -> float:
    """The link time of one step (see the module docstring)."""
    if design == "ring":
        return 2 * (workers - 1) / workers * model_bytes / rate
    return max(1.0, workers / servers) * model_bytes / rate


def run_job(cluster: NetnsCluster, workers: int, servers: int, args: argparse.Namespace, log_dir: Path) -> float:
    """One job: the median round of its slowest worker, in seconds. ``servers == 0``: the ring.

    Raises:
        JobFailed: a process failed or printed no result.
    """
    worker_hosts = cluster.hosts[:workers]
    server_hosts = cluster.hosts[workers:workers + servers]
    scheduler_host = server_hosts[0] if servers else worker_hosts[0]
    root = cluster.address(scheduler_host)
    store = "dist_sync" if servers else "allreduce"
    argv = [sys.executable, str(WORKER), store, str(args.mib), str(args.tensors), "1", str(args.rounds)]
    with LocalJob(workers, servers, start_scheduler=False, start_servers=0, root_uri=root, log_dir=log_dir,
                  test_settings=False, env={"OMP_NUM_THREADS": "1"}) as job:
        job.start("scheduler", 0, cluster.run_in(scheduler_host, [sys.executable, "-m", "psnode", "scheduler"]),
                  node_host=root)
        for i, host in enumerate(server_hosts):
            job.start("server", i, cluster.run_in(host, [sys.executable, "-m", "psnode", "server"]),
                      node_host=cluster.address(host))
        for i, host in enumerate(worker_hosts):
            job.start("worker", i, cluster.run_in(host, argv), node_host=cluster.address(host))
        job.wait_ok(["worker"], args.job_timeout)
        medians = [statistics.median(read_result(job, "worker", i)["seconds"]) for i in range(workers)]
        job.wait_ok(["scheduler", "server"], 60)
    return max(medians)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4,8", help="worker counts, comma-separated")
    parser.add_argument("--servers", default="1,2,W", help="server host counts (W: as many as workers)")
    parser.add_argument("--rate", default="100mbit", help="every host link's rate (tc), each way")
    parser.add_argument("--mib", type=float, default=8.0, help="the model's size")
    parser.add_argument("--tensors", type=int, default=16, help="the model's tensors (equal sizes)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per job (after one warm-up)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="W = 2, 1 MiB, 1 round: a smoke test")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="write the step times as a PNG (needs matplotlib)")
    parser.add_argument("--job-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    try:
        worker_counts = [int(w) for w in args.workers.split(",")]
        server_specs = [s.strip() for s in args.servers.split(",") if s.strip()]
        for spec in server_specs:
            if spec != "W":
                int(spec)
    except ValueError:
        parser.error(f"--workers takes integers and --servers integers or W, got {args.workers!r} and {args.servers!r}")
    if args.quick:
        worker_counts, args.mib, args.rounds = [2], 1.0, 1
    if min(worker_counts) < 2 or args.mib <= 0 or args.tensors < 1 or args.rounds < 1:
        parser.error("at least 2 workers, a positive --mib, at least 1 tensor and 1 round")
    why = usable()
    if why is not None:
        print(f"ps_vs_ring needs network namespaces: {why}", file=sys.stderr)
        return 2
    rate = rate_bytes(args.rate)
    model_bytes = int(args.mib * (1 << 20)) // 4 // args.tensors * 4 * args.tensors
    rows: list[dict] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="pslaunch-ps-vs-ring-") as tmp:
        for workers in worker_counts:
            counts = sorted({workers if s == "W" else int(s) for s in server_specs})
            designs = [("ring", 0)] + [("ps", s) for s in counts]
            with NetnsCluster(nics=("eth0",) * (workers + max(counts))) as cluster:
                cluster.shape(args.rate)
                for rep in range(args.reps):
                    for design, servers in designs[rep % len(designs):] + designs[:rep % len(designs)]:
                        row = {"workers": workers, "design": design, "servers": servers, "rep": rep,
                               "model_s": model_seconds(design, workers, servers, model_bytes, rate)}
                        try:
                            row["seconds"] = run_job(cluster, workers, servers, args,
                                                     Path(tmp) / f"{workers}-{design}-{servers}-{rep}")
                        except (JobFailed, OSError, NetnsError) as exc:
                            row["error"] = str(exc)[-2000:]
                            failed = True
                        rows.append(row)
                        label = "ring (-s 0)" if design == "ring" else f"{servers} server host(s)"
                        print(f"W={workers} {label:18} rep {rep}: "
                              + (f"{row['seconds']:.3f} s (link model {row['model_s']:.3f} s)" if "seconds" in row
                                 else f"FAILED {row['error'][-300:]}"), file=sys.stderr, flush=True)
    summary = summarise(rows)
    print(render(summary, args, model_bytes))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary, "rate": args.rate,
                                         "model_bytes": model_bytes,
                                         "tensors": args.tensors,
                                         "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
    if args.plot is not None:
        plots.ps_vs_ring({"summary": summary, "rate": args.rate, "model_bytes": model_bytes}, args.plot)
    return 1 if failed else 0


def summarise(rows: list[dict]) -> list[dict]:
    """Medians over repetitions per (workers, design, servers)."""
    keys = list(dict.fromkeys((r["workers"], r["design"], r["servers"]) for r in rows))
    summary = []
    for workers, design, servers in keys:
        done = [r for r in rows if (r["workers"], r["design"], r["servers"]) == (workers, design, servers)]
        entry = {"workers": workers, "design": design, "servers": servers, "model_s": done[0]["model_s"]}
        times = [r["seconds"] for r in done if "seconds" in r]
        if times:
            entry["seconds"] = statistics.median(times)
        summary.append(entry)
    for entry in summary:
        ring = next((e for e in summary if e["workers"] == entry["workers"] and e["design"] == "ring"), None)
        if ring and "seconds" in ring and "seconds" in entry:
            entry["vs_ring"] = entry["seconds"] / ring["seconds"]
    return summary


def render(summary: list[dict], args: argparse.Namespace, model_bytes: int) -> str:
    lines = [f"a {model_bytes / (1 << 20):g} MiB model in {args.tensors} tensors, every host link {args.rate} "
             "each way; "
             "push+pull per step (median round of the slowest worker)",
             "| workers | design | hosts | step | link model | measured / model | vs the ring |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for e in summary:
        design = "ring (`-s 0`)" if e["design"] == "ring" else f"{e['servers']} server host(s)"
        hosts = e["workers"] + e["servers"]
        if "seconds" not in e:
            lines.append(f"| {e['workers']} | {design} | {hosts} | failed | {e['model_s']:.2f} s | - | - |")
            continue
        ratio = f"{e['vs_ring']:.2f}x" if "vs_ring" in e else "-"
        lines.append(f"| {e['workers']} | {design} | {hosts} | {e['seconds']:.2f} s | {e['model_s']:.2f} s | "
                     f"{e['seconds'] / e['model_s']:.2f} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
