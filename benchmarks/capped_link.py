"""The capped-link row: pslaunch and MXNet pushing and pulling across a 1 Gbit link, as a fraction of
the line rate (where gradient compression shows its worth).

    python -m benchmarks.capped_link [--rate 1gbit] [--sizes 16,64] [--reps 3] [--quick]
                                     [--json out.json] [--skip-mxnet] [--mxnet-python PATH]

Two hosts of a simulated cluster (``testkit.netns``: network namespaces on a bridge, every host
link shaped with ``tc tbf`` at ``--rate`` each way): the scheduler and one server on h1, one worker
on h2, so that every byte of a push and of a pull crosses the capped link once. Each job is started
directly with the environment contract (as ``benchmarks.jobs`` starts its jobs), each process inside
its host's namespace. A worker's figure for a key is ``2 * key bytes / median push+pull round``; its
fraction of the line rate divides that by ``rate / 8`` (the shaper counts headers too, so 1.0 is out
of reach). The ceiling row is one raw TCP stream across the same link.

Systems run back to back within each repetition, in a rotating order; ratios (pslaunch / MXNet) are
medians of the per-repetition ratios. Needs root and iproute2. Exit status: 0 when every job ran,
1 when any failed (the JSON says which), 2 for bad options or no namespaces here.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from testkit import JobFailed, LocalJob

from . import jobs, kv_suite
from testkit.netns import NetnsCluster, usable

MiB = 1 << 20
DEFAULT_MXNET_PYTHON = "/tmp/mxvenv/bin/python"
SYSTEMS = ("pslaunch_tcp", "mxnet_tcp")
_STREAM = """
import socket, sys, time
if sys.argv[1] == "recv":
    srv = socket.create_server((sys.argv[2], 0)); print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept(); total = 0; start = None
    while chunk := conn.recv(1 << 20):
        start = start or time.perf_counter(); total += len(chunk)
    print(total / (time.perf_counter() - start), flush=True)
else:
    s = socket.create_connection((sys.argv[2], int(sys.argv[3])), 10); block = bytes(1 << 20)
    for _ in range(int(sys.argv[4])): s.sendall(block)
    s.close()
"""


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate (``1gbit``, ``500mbit``)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not match:
        raise click.BadParameter(f"{rate!r} is not a rate such as 1gbit or 500mbit")
    return float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]] / 8


def run_kv(cluster: NetnsCluster, system: jobs.KVSystem, plan: kv_suite.Plan, log_dir: Path, timeout_s: float) -> dict:
    """One job of ``system``: scheduler and server on h1, the worker on h2. Returns the worker's
    figures per measure. Raises ``JobFailed``."""
    where = {"scheduler": "h1", "server": "h1", "worker": "h2"}
    root = cluster.address("h1")
    with LocalJob(1, 1, start_scheduler=False, start_servers=0, env=system.env, log_dir=log_dir,
                  test_settings=False) as job:
        for role, argv in (("scheduler", system.scheduler), ("server", system.server),
                           ("worker", [system.python, *system.worker, plan.to_json()])):
            host = where[role]
            job.start(role, 0, cluster.run_in(host, argv),
                      {"DMLC_PS_ROOT_URI": root, "DMLC_NODE_HOST": cluster.address(host)})
        job.wait_ok(["worker"], timeout_s)
        for line in job.output_of("worker").splitlines():
            if line.startswith(kv_suite.RESULT_PREFIX):
                result = json.loads(line[len(kv_suite.RESULT_PREFIX):])
                break
        else:
            raise JobFailed(f"{system.name}: the worker printed no RESULT line")
        job.wait_ok(["scheduler", "server"], 30)
    return result["measures"]


def run_stream(cluster: NetnsCluster, mib: int, timeout_s: float) -> float:
    """Bytes per second of one raw TCP stream of ``mib`` MiB from h2 to h1."""
    receiver = subprocess.Popen(cluster.run_in("h1", [sys.executable, "-c", _STREAM, "recv", cluster.address("h1")]),
                                stdout=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()  # type: ignore[union-attr]
        subprocess.run(cluster.run_in("h2", [sys.executable, "-c", _STREAM, "send", cluster.address("h1"), port, str(mib)]),
                       check=True, timeout=timeout_s)
        out, _ = receiver.communicate(timeout=timeout_s)
        return float(out.strip())
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rate", default="1gbit", show_default=True, help="The link's rate (tc), each way.")
@click.option("--sizes", default="16,64", show_default=True, help="Key sizes in MiB, comma-separated.")
@click.option("--reps", type=int, default=3, show_default=True, help="Repetitions (every system in each).")
@click.option("--quick", is_flag=True, help="One repetition, fewer rounds: checks that it runs, not a figure.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--skip-mxnet", is_flag=True, help="Only pslaunch (and the ceiling).")
@click.option("--mxnet-python", default=DEFAULT_MXNET_PYTHON, show_default=True,
              help="Python of a virtual environment with mxnet 1.9.1.")
@click.option("--job-timeout", type=float, default=180.0, show_default=True, help="Seconds per job.")
def main(rate: str, sizes: str, reps: int, quick: bool, json_path: Path | None, skip_mxnet: bool,
         mxnet_python: str, job_timeout: float) -> None:
    """Run the capped-link row and print it; write JSON with --json."""
    line_rate = rate_bytes(rate)
    why = usable()
    if why is not None:
        raise click.ClickException(f"the capped link needs network namespaces: {why}")
    sizes_b = [int(float(m) * MiB) // 4 * 4 for m in sizes.split(",")]
    rounds = [2 if quick else max(3, int(64 * MiB / n * 4)) for n in sizes_b]
    plan = kv_suite.Plan(sizes=sizes_b, big_rounds=rounds, big_warmup=1 if quick else 2, small_rounds=0,
                         many_rounds=0)
    reps = 1 if quick else reps
    mx = None if skip_mxnet or not Path(mxnet_python).exists() else mxnet_python
    systems = jobs.kv_systems(mx)
    active = [s for s in SYSTEMS if s in systems]
    per_rep: list[dict] = []
    failures: list[str] = []
    with NetnsCluster(nics=("eth0", "eth0")) as cluster, tempfile.TemporaryDirectory(prefix="pslaunch-capped-") as tmp:
        cluster.shape(rate)
        click.echo(f"capped link: {cluster.describe()}; tc tbf {rate} each way", err=True)
        for rep in range(reps):
            order = active[rep % len(active):] + active[: rep % len(active)]
            figures: dict[str, dict] = {}
            for name in order:
                click.echo(f"[rep {rep + 1}/{reps}] {name} ...", err=True)
                try:
                    figures[name] = run_kv(cluster, systems[name], plan, Path(tmp) / f"{rep}-{name}", job_timeout)
                except (JobFailed, OSError, ValueError) as exc:
                    failures.append(f"rep {rep} {name}: {exc}")
                    click.echo(f"    FAILED: {exc}", err=True)
            figures["tcp_stream"] = {"stream": {"bytes_per_s": run_stream(cluster, 64 if quick else 256, job_timeout)}}
            per_rep.append(figures)
    report = _report(per_rep, sizes_b, line_rate, rate)
    report["failures"] = failures
    click.echo(_render(report))
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
    sys.exit(1 if failures else 0)


def _report(per_rep: list[dict], sizes: list[int], line_rate: float, rate: str) -> dict:
    rows = []
    for nbytes in sizes:
        measure = f"pushpull_{nbytes}"
        row = {"measure": measure, "MiB": nbytes / MiB}
        for name in SYSTEMS:
            got = [r[name][measure]["bytes_per_s"] for r in per_rep if name in r and measure in r[name]]
            if got:
                row[name] = {"bytes_per_s": statistics.median(got), "of_line_rate": statistics.median(got) / line_rate}
        pairs = [r["pslaunch_tcp"][measure]["bytes_per_s"] / r["mxnet_tcp"][measure]["bytes_per_s"]
                 for r in per_rep if "pslaunch_tcp" in r and "mxnet_tcp" in r]
        if pairs:
            row["pslaunch_over_mxnet"] = statistics.median(pairs)
        rows.append(row)
    stream = statistics.median(r["tcp_stream"]["stream"]["bytes_per_s"] for r in per_rep)
    return {"rate": rate, "line_rate_bytes_per_s": line_rate, "reps": len(per_rep), "rows": rows,
            "tcp_stream": {"bytes_per_s": stream, "of_line_rate": stream / line_rate},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _render(report: dict) -> str:
    lines = [f"capped link {report['rate']} ({report['line_rate_bytes_per_s'] / 1e6:.0f} MB/s line rate), "
             f"{report['reps']} repetition(s); push+pull of one worker to one server across it",
             f"{'measure':<18}{'pslaunch_tcp':>22}{'mxnet_tcp':>22}{'pslaunch/mxnet':>16}"]
    for row in report["rows"]:
        cells = []
        for name in SYSTEMS:
            fig = row.get(name)
            cells.append(f"{fig['bytes_per_s'] / 1e6:7.1f} MB/s ({fig['of_line_rate']:.0%})" if fig else "-")
        ratio = f"{row['pslaunch_over_mxnet']:.2f}x" if "pslaunch_over_mxnet" in row else "-"
        lines.append(f"{'pushpull ' + format(row['MiB'], 'g') + ' MiB':<18}{cells[0]:>22}{cells[1]:>22}{ratio:>16}")
    stream = report["tcp_stream"]
    lines.append(f"{'raw TCP stream':<18}{stream['bytes_per_s'] / 1e6:7.1f} MB/s ({stream['of_line_rate']:.0%})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()  # pylint: disable=no-value-for-parameter
