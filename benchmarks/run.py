"""Run every pslaunch benchmark and its baselines in one go; print a table and write JSON.

    python -m benchmarks.run [--quick] [--json out.json] [--skip-mxnet] [--mxnet-python PATH]

Measures, with 1 scheduler, 1 server and 2 workers on 127.0.0.1 (see docs/benchmarks.md):
pslaunch ``dist_sync`` over TCP, over the same-host fast path (shared memory) and over ipc alone,
MXNet 1.9.1 ``dist_sync`` over TCP and ipc (when its virtual environment exists), and raw pyzmq
DEALER/ROUTER over TCP and ipc.
The systems run back to back within each repetition, in a rotating order, so that a noisy,
shared machine slows them alike; ratios are medians of the per-repetition ratios.

Exit status: 0 when every job that was run succeeded, 1 when any failed (the JSON still says which
and how), 2 for bad options.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from testkit import JobFailed

from . import jobs, report
from .kv_suite import Plan

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DEFAULT_MXNET_PYTHON = "/tmp/mxvenv/bin/python"
ALL_SYSTEMS = ["pslaunch_tcp", "pslaunch_fast", "pslaunch_ipc", "pslaunch_tcp_normal", "pslaunch_tcp_noauth",
               "pslaunch_fast_noauth", "pslaunch_tcp_curve", "pslaunch_tcp_timeline", "pslaunch_tcp_nolanes",
               "pslaunch_tcp_nocopy", "pslaunch_tcp_nostreams", "pslaunch_fast_nostreams", "mxnet_tcp", "mxnet_ipc",
               "zmq_tcp", "zmq_ipc"]
ON_REQUEST = ("pslaunch_tcp_normal", "pslaunch_tcp_noauth", "pslaunch_fast_noauth", "pslaunch_tcp_curve",
              "pslaunch_tcp_timeline", "pslaunch_tcp_nolanes", "pslaunch_tcp_nocopy", "pslaunch_tcp_nostreams",
              "pslaunch_fast_nostreams")
DEFAULT_SYSTEMS = [s for s in ALL_SYSTEMS if s not in ON_REQUEST]  # those only with --systems
NUM_WORKERS = 2


@dataclass(frozen=True)
class BenchConfig:
    """Everything one run needs, parsed from the command line."""

    plan: Plan
    reps: int
    systems: tuple[str, ...]
    mxnet_python: str | None
    json_path: Path | None
    results_dir: Path
    job_timeout_s: float
    profile_dir: Path | None
    cpu_bind: bool = False


MEASURE_GROUPS = ("pushpull", "roundtrip", "many")


def _plan(quick: bool, sizes_mib: list[float], keys: int, only: tuple[str, ...] = MEASURE_GROUPS,
          scale: float = 1.0) -> Plan:
    sizes = [int(m * (1 << 20)) // 4 * 4 for m in sizes_mib]
    if quick:
        big_rounds, small_rounds, many_rounds = [3] * len(sizes), 30, 3
        warm = dict(big_warmup=1, small_warmup=5, many_warmup=1)
    else:
        # fewer timed rounds for bigger keys keeps each job near 20 s on 2 cores
        big_rounds = [30 if n <= 4 << 20 else 15 if n <= 16 << 20 else 8 for n in sizes]
        small_rounds, many_rounds = 300, 15
        warm = dict(big_warmup=3, small_warmup=20, many_warmup=3)

    def scaled(n: int, group: str) -> int:
        return max(1, round(n * scale)) if group in only else 0

    return Plan(sizes=sizes, big_rounds=[scaled(n, "pushpull") for n in big_rounds],
                small_rounds=scaled(small_rounds, "roundtrip"), many_keys=keys,
                many_rounds=scaled(many_rounds, "many"), **warm)


def _statuses(cfg: BenchConfig, skip_mxnet: bool) -> dict[str, str]:
    """Why a system will not run ('ok' when it will)."""
    statuses = {}
    has_psnode = _psnode_runnable()
    for system in ALL_SYSTEMS:
        if system not in cfg.systems:
            statuses[system] = "skipped"
        elif system.startswith("pslaunch") and not has_psnode:
            statuses[system] = "not available (no psnode.__main__)"
        elif system.startswith("mxnet") and skip_mxnet:
            statuses[system] = "skipped"
        elif system.startswith("mxnet") and not cfg.mxnet_python:
            statuses[system] = "not installed"
        else:
            statuses[system] = "ok"
    return statuses


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _psnode_runnable() -> bool:
    """Whether ``python -m psnode`` would find a runnable node."""
    try:
        return importlib.util.find_spec("psnode.__main__") is not None
    except ImportError:
        return False


def run(cfg: BenchConfig, statuses: dict[str, str]) -> tuple[dict, str]:
    """Run every repetition; return the report (JSON-ready) and its rendered table."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    log_root = cfg.results_dir / "logs" / stamp
    kv_systems = jobs.kv_systems(cfg.mxnet_python, cfg.profile_dir)
    active = [s for s in ALL_SYSTEMS if statuses[s] == "ok"]
    machine = report.machine_info()
    reps: list[dict[str, dict | None]] = []
    errors: dict[str, list[str]] = {s: [] for s in active}
    started = time.monotonic()
    for rep in range(cfg.reps):
        order = active[rep % len(active):] + active[: rep % len(active)] if active else []
        results: dict[str, dict | None] = {}
        for system in order:
            log_dir = log_root / f"rep{rep}-{system}"
            click.echo(f"[rep {rep + 1}/{cfg.reps}] {system} ...", err=True)
            t0 = time.monotonic()
            try:
                if system.startswith("zmq_"):
                    results[system] = jobs.run_zmq_job(system[4:], cfg.plan, NUM_WORKERS, log_dir, cfg.job_timeout_s,
                                                       cfg.cpu_bind)
                else:
                    results[system] = jobs.run_kv_job(kv_systems[system], cfg.plan, NUM_WORKERS, log_dir,
                                                      cfg.job_timeout_s, cfg.cpu_bind)
                click.echo(f"    done in {time.monotonic() - t0:.1f} s", err=True)
            except (JobFailed, OSError, ValueError, KeyError) as exc:
                # a job's failure is data for the report; the other systems still run
                results[system] = None
                errors[system].append(f"rep {rep}: {exc}")
                click.echo(f"    FAILED after {time.monotonic() - t0:.1f} s: {exc}", err=True)
        reps.append(results)
    for system in active:
        failed = len(errors[system])
        if failed:
            statuses[system] = "failed" if failed == cfg.reps else f"failed in {failed}/{cfg.reps} reps"
    machine["loadavg_end"] = list(os.getloadavg())
    systems = list(ALL_SYSTEMS)
    rows = report.build_rows(cfg.plan.sizes, cfg.plan.many_keys, systems, reps)
    versions = {s: next((r[s]["system"] for r in reps if r.get(s)), None) for s in active}
    out = {
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name] + sys.argv,
        "wall_s": round(time.monotonic() - started, 1),
        "machine": machine,
        "config": {"plan": asdict(cfg.plan), "reps": cfg.reps, "num_workers": NUM_WORKERS, "num_servers": 1,
                   "cpu_bind": cfg.cpu_bind},
        "systems": {s: {"status": statuses[s], "version": versions.get(s), "errors": errors.get(s, [])}
                    for s in systems},
        "rows": [r.to_json(systems) for r in rows],
        "ratios": report.build_ratios(rows),
        "targets": report.build_targets(rows),
        "log_dir": str(log_root),
    }
    shown = [s for s in systems if s in cfg.systems]
    return out, report.render(out, rows, shown, statuses)


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--quick", is_flag=True, help="1 repetition with few rounds: checks that everything runs.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the JSON report here (it always goes to benchmarks/results/).")
@click.option("--skip-mxnet", is_flag=True, help="Do not run the MXNet baseline.")
@click.option("--mxnet-python", default=None,
              help=f"Python of a virtual environment holding mxnet 1.9.1 [default: {DEFAULT_MXNET_PYTHON} if it exists]")
@click.option("--reps", type=click.IntRange(1, 50), default=None, help="Repetitions [default: 3, 1 with --quick].")
@click.option("--sizes", default="4,16,64", show_default=True,
              help="Key sizes in MiB (float32 elements), comma-separated.")
@click.option("--keys", type=click.IntRange(1, 100_000), default=1000, show_default=True,
              help="Number of one-float keys pushed and pulled as lists.")
@click.option("--systems", default=",".join(DEFAULT_SYSTEMS), show_default=True,
              help="Which systems to run, comma-separated.")
@click.option("--job-timeout", type=click.FloatRange(1), default=None,
              help="Seconds one job may take [default: 600, 180 with --quick].")
@click.option("--only", type=click.Choice(MEASURE_GROUPS), multiple=True,
              help="Run only these measures (repeatable); for profiling one path.")
@click.option("--rounds-scale", type=click.FloatRange(0.01, 100), default=1.0, show_default=True,
              help="Multiply every timed round count (more samples for a profile).")
@click.option("--results-dir", type=click.Path(file_okay=False, path_type=Path), default=RESULTS, show_default=True,
              help="Where the JSON report and the job logs go.")
@click.option("--cpu-bind", is_flag=True,
              help="Run every process of every system's job on one core, in turn in the order they start "
                   "(scheduler, server, workers; the echo's router, then its dealers): the two workers never "
                   "share a core, in every run.")
@click.option("--profile-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Profile pslaunch: the server under cProfile, workers under yappi (every thread) or cProfile.")
def main(quick, json_path, skip_mxnet, mxnet_python, reps, sizes, keys, systems, job_timeout, only, rounds_scale,
         results_dir, cpu_bind, profile_dir) -> None:
    # TERM (a CI timeout, a test's cleanup) unwinds like Ctrl-C, so every job's processes are reaped
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        sizes_mib = [float(s) for s in sizes.split(",") if s.strip()]
    except ValueError:
        raise click.BadParameter(f"--sizes must be numbers in MiB, got {sizes!r}") from None
    if not sizes_mib or min(sizes_mib) <= 0:
        raise click.BadParameter(f"--sizes must be positive MiB values, got {sizes!r}")
    chosen = tuple(s.strip() for s in systems.split(",") if s.strip())
    unknown = [s for s in chosen if s not in ALL_SYSTEMS]
    if unknown:
        raise click.BadParameter(f"unknown systems {unknown}; known: {', '.join(ALL_SYSTEMS)}")
    if mxnet_python is None and Path(DEFAULT_MXNET_PYTHON).exists():
        mxnet_python = DEFAULT_MXNET_PYTHON
    elif mxnet_python is not None and not Path(mxnet_python).exists():
        raise click.BadParameter(f"--mxnet-python {mxnet_python} does not exist")
    if profile_dir is not None:
        profile_dir = profile_dir.resolve()
        profile_dir.mkdir(parents=True, exist_ok=True)
    cfg = BenchConfig(
        plan=_plan(quick, sizes_mib, keys, only or MEASURE_GROUPS, rounds_scale), reps=reps or (1 if quick else 3), systems=chosen,
        mxnet_python=None if skip_mxnet else mxnet_python, json_path=json_path, results_dir=results_dir,
        job_timeout_s=job_timeout or (180.0 if quick else 600.0), profile_dir=profile_dir, cpu_bind=cpu_bind,
    )
    statuses = _statuses(cfg, skip_mxnet)
    out, table = run(cfg, statuses)
    click.echo(table)
    paths = [cfg.results_dir / f"bench-{out['created_utc'].replace(':', '').replace('+0000', 'Z')}.json"]
    if json_path is not None:
        paths.append(json_path)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
        click.echo(f"wrote {path}")
    # the same tables in Markdown, ready for docs/benchmarks.md
    markdown_path = paths[0].with_suffix(".md")
    markdown_path.write_text(report.markdown(out))
    click.echo(f"wrote {markdown_path}")
    failed = [s for s, info in out["systems"].items() if info["errors"]]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
