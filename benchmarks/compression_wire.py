"""``dist_sync`` push+pull of a big key with 2bit gradient compression, pslaunch against MXNet 1.9.1,
over loopback TCP and through a rate-limited link between two network namespaces.

    python -m benchmarks.compression_wire [--size-mib 64] [--rounds 5] [--reps 2] [--rate 1gbit]
        [--mxnet-python PATH | --skip-mxnet] [--skip-capped] [--json out.json]

Each job is 1 scheduler, 1 server and 2 workers; every worker pushes one ``--size-mib`` float32 key
and pulls it back, ``--rounds`` timed rounds after a warm-up, each round starting at a barrier
(``compression_wire_worker.py``). A job's figure is the mean over workers of each worker's median
round. Every configuration runs with ``2bit`` (threshold 0.5) and without compression (``none``),
for pslaunch (``PSLAUNCH_SAME_HOST=tcp``) and MXNet (one engine thread, as ``benchmarks.run``
runs it), back to back in a rotating order within each repetition so load hits all alike; a ratio
is the median of the per-repetition ratios. The last pulled value's digest must be the same for
both systems (the same pushes give the same bits), or the run fails.

Networks:

* ``tcp``: every node on 127.0.0.1, over TCP.
* ``capped``: the scheduler and server in one network namespace, the workers in another, joined by
  a veth pair shaped to ``--rate`` each way by ``tc``'s token bucket (``testkit.netns_link``:
  198.18.0.0/15 addresses, unreachable from the root namespace; removed afterwards). Needs root.

Exit status: 0 when every job succeeded, 1 otherwise (the JSON says which), 2 for bad options.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from testkit import JobFailed, LocalJob

from . import kv_suite
from testkit.netns_link import LinkError, RateLimitedLink

HERE = Path(__file__).resolve().parent
WORKER = HERE / "compression_wire_worker.py"
DEFAULT_MXNET_PYTHON = "/tmp/mxvenv/bin/python"
NUM_WORKERS = 2
COMPRESSIONS = ("2bit", "none")


def _systems(mxnet_python: str | None) -> dict[str, dict[str, Any]]:
    py = sys.executable
    systems = {"pslaunch": {"python": py, "scheduler": [py, "-m", "psnode", "scheduler"],
                            "server": [py, "-m", "psnode", "server"], "env": {"PSLAUNCH_SAME_HOST": "tcp"}}}
    if mxnet_python:
        node = [mxnet_python, "-c", "import mxnet"]
        systems["mxnet"] = {"python": mxnet_python, "scheduler": node, "server": node,
                            "env": {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}}
    return systems


def _worker_argv(system: str, spec: dict, compression: str, nbytes: int, warmup: int, rounds: int) -> list[str]:
    return [spec["python"], str(WORKER), "mxnet" if system == "mxnet" else "kvcore", compression, str(nbytes),
            str(warmup), str(rounds)]


def _results(job: LocalJob) -> list[dict]:
    results = []
    for i in range(NUM_WORKERS):
        for line in job.output_of("worker", i).splitlines():
            if line.startswith(kv_suite.RESULT_PREFIX):
                results.append(json.loads(line[len(kv_suite.RESULT_PREFIX):]))
                break
        else:
            raise JobFailed(f"worker {i} printed no result line")
    return results


def run_job(system: str, spec: dict, compression: str, nbytes: int, warmup: int, rounds: int,
            link: RateLimitedLink | None, log_dir: Path, timeout_s: float) -> dict:
    """One job; returns ``{"ms": mean of worker medians, "digest", "workers"}``.

    Raises:
        JobFailed: a process failed, printed no result, or the job ran past ``timeout_s``.
    """
    argv = _worker_argv(system, spec, compression, nbytes, warmup, rounds)
    common = dict(env=spec["env"], log_dir=log_dir, test_settings=False)
    if link is None:
        job = LocalJob(NUM_WORKERS, 1, worker=argv[1:], python=argv[0], scheduler=spec["scheduler"],
                       server=spec["server"], **common)
    else:  # nothing starts by itself: every process is started in its namespace below
        job = LocalJob(NUM_WORKERS, 1, start_scheduler=False, start_servers=0, root_uri=link.address("a"), **common)
    with job:
        if link is not None:
            a, b = link.address("a"), link.address("b")
            job.start("scheduler", 0, link.run_in("a", spec["scheduler"]), node_host=a)
            job.start("server", 0, link.run_in("a", spec["server"]), node_host=a)
            for i in range(NUM_WORKERS):
                job.start("worker", i, link.run_in("b", argv), node_host=b)
        job.wait_ok(["worker"], timeout_s)
        results = _results(job)
        job.wait_ok(["scheduler", "server"], min(timeout_s, 60))
    digests = {r["digest"] for r in results}
    if len(digests) != 1:
        raise JobFailed(f"{system} {compression}: the workers pulled different values ({sorted(digests)})")
    ms = statistics.mean(statistics.median(r["times_ms"]) for r in results)
    return {"ms": ms, "digest": digests.pop(), "workers": results, "system_version": results[0]["system"]}


def _ratio(rows: list[dict], slow: tuple[str, str], fast: tuple[str, str]) -> float | None:
    """Median over repetitions of ``slow``'s time over ``fast``'s ((system, compression) pairs)."""
    ratios = []
    for rep in {r["rep"] for r in rows}:
        by = {(r["system"], r["compression"]): r for r in rows if r["rep"] == rep and "ms" in r}
        if slow in by and fast in by:
            ratios.append(by[slow]["ms"] / by[fast]["ms"])
    return statistics.median(ratios) if ratios else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=float, default=64.0, help="the key's size (default 64 MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="timed push+pull rounds per job")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2, help="repetitions of every job")
    parser.add_argument("--rate", default="1gbit", help="the capped link's rate each way, as tc writes it")
    parser.add_argument("--mxnet-python", default=None, help=f"MXNet 1.9.1's Python (default {DEFAULT_MXNET_PYTHON} if present)")
    parser.add_argument("--skip-mxnet", action="store_true")
    parser.add_argument("--skip-capped", action="store_true", help="loopback TCP only (no namespaces, no root needed)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--job-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    # TERM unwinds like an exception: the jobs are reaped and the namespaces deleted on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.size_mib <= 0 or args.rounds < 1 or args.reps < 1 or args.warmup < 0:
        parser.error("--size-mib must be positive, --rounds and --reps at least 1, --warmup at least 0")
    mxnet_python = None
    if not args.skip_mxnet:
        mxnet_python = args.mxnet_python or (DEFAULT_MXNET_PYTHON if os.path.exists(DEFAULT_MXNET_PYTHON) else None)
    systems = _systems(mxnet_python)
    nbytes = int(args.size_mib * (1 << 20)) // 64 * 64  # whole 2bit words
    networks = ["tcp"] if args.skip_capped else ["tcp", "capped"]
    configs = [(s, c) for s in systems for c in COMPRESSIONS]
    rows: list[dict] = []
    link_text = None
    failed = False
    with tempfile.TemporaryDirectory(prefix="pslaunch-bench-") as tmp:
        for network in networks:
            link = RateLimitedLink(args.rate) if network == "capped" else None
            try:
                if link is not None:
                    link.__enter__()
                    link_text = link.describe()
                for rep in range(args.reps):
                    order = configs[rep % len(configs):] + configs[:rep % len(configs)]
                    for system, compression in order:
                        row = {"network": network, "system": system, "compression": compression, "rep": rep}
                        log_dir = Path(tmp) / f"{network}-{system}-{compression}-{rep}"
                        try:
                            row.update(run_job(system, systems[system], compression, nbytes, args.warmup,
                                               args.rounds, link, log_dir, args.job_timeout))
                        except (JobFailed, OSError) as exc:
                            row["error"] = str(exc)
                            failed = True
                        rows.append(row)
                        print(f"{network:7} {system:9} {compression:5} rep {rep}: "
                              + (f"{row['ms']:9.1f} ms" if "ms" in row else f"FAILED {row['error'][:300]}"), flush=True)
            except LinkError as exc:
                print(f"capped network skipped: {exc}", flush=True)
                rows.append({"network": network, "error": str(exc)})
                failed = True
            finally:
                if link is not None:
                    link.close()
    for network in networks:
        done = [r for r in rows if r["network"] == network and "digest" in r]
        for compression in COMPRESSIONS:
            digests = {r["digest"] for r in done if r["compression"] == compression}
            if len(digests) > 1:
                print(f"{network} {compression}: the systems pulled different values: {sorted(digests)}")
                failed = True
    summary = []
    print(f"\n{nbytes / (1 << 20):g} MiB key, {NUM_WORKERS} workers, 1 server, median of {args.rounds} rounds; "
          "push+pull ms (mean over workers), median over repetitions")
    print(f"{'network':8} {'system':9} {'compression':11} {'ms':>9}")
    for network in networks:
        for system, compression in configs:
            times = [r["ms"] for r in rows if r.get("network") == network and r.get("system") == system
                     and r.get("compression") == compression and "ms" in r]
            if times:
                summary.append({"network": network, "system": system, "compression": compression,
                                "ms": statistics.median(times)})
                print(f"{network:8} {system:9} {compression:11} {statistics.median(times):9.1f}")
    ratios = {}
    for network in networks:
        rows_n = [r for r in rows if r.get("network") == network]
        pairs = {"mxnet_2bit/pslaunch_2bit": (("mxnet", "2bit"), ("pslaunch", "2bit")),
                 "mxnet_none/pslaunch_none": (("mxnet", "none"), ("pslaunch", "none")),
                 "pslaunch_none/pslaunch_2bit": (("pslaunch", "none"), ("pslaunch", "2bit")),
                 "mxnet_none/mxnet_2bit": (("mxnet", "none"), ("mxnet", "2bit"))}
        for name, (slow, fast) in pairs.items():
            value = _ratio(rows_n, slow, fast)
            if value is not None:
                ratios[f"{network}:{name}"] = value
                print(f"{network:8} {name:28} {value:6.2f}x  (time over time: above 1, the second is faster)")
    if link_text:
        print(f"capped link: {link_text}")
    if args.json is not None:
        report = {"when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "nbytes": nbytes,
                  "workers": NUM_WORKERS, "rounds": args.rounds, "reps": args.reps, "rate": args.rate,
                  "link": link_text, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                 "load": os.getloadavg()},
                  "rows": [{k: v for k, v in r.items() if k != "workers"} for r in rows], "summary": summary,
                  "ratios": ratios}
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
