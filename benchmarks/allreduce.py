"""Allreduce without servers against torch.distributed's gloo, and the training step against DDP, in one run.

    python -m benchmarks.allreduce [--reps 3] [--ranks 2,4] [--sizes 4,64] [--quick] [--skip-train] [--json out.json]

Measures (docs/benchmarks.md, "Allreduce"), every job on 127.0.0.1, each process started on its
own (``testkit.LocalJob``):

- ``gloo``: torch 2.13's gloo ``all_reduce`` (``benchmarks/gloo_worker.py``), the baseline;
- ``pslaunch_tcp``: ``kvcore.collectives.allreduce`` in a job without servers, every worker over
  TCP (``PSLAUNCH_SAME_HOST=tcp``: the pipelined ring for big values);
- ``pslaunch_shm``: the same over the same-host path (shared memory for big values, the default),
  with the caller's array in private memory and, in the same job, made by
  ``collectives.shared_empty`` (the rows marked "shared array": summed where it lies);

each with 2 and 4 workers: bus bandwidth of 4 MiB and 64 MiB float32 allreduces, the 4-element
allreduce's latency, and (pslaunch) 1000 one-float keys pushed and pulled through the
``allreduce`` store fused and one collective per key. Then the training step
(``benchmarks.train_step``): DDP on gloo against ``kvcore.Trainer`` on the ``allreduce`` store and
on ``dist_sync`` with 2 servers, 2 workers.

Systems run back to back within each repetition in a rotating order, so that a noisy shared
machine slows them alike; a ratio is the median of the per-repetition ratios. Each bandwidth job
also reports the CPU its workers spent per allreduce (user and system time of every thread,
``getrusage``), which a shared machine moves far less than wall time. Every figure is
checked (the sums are exact; the trained weights equal on every worker): a wrong one fails the
job. The JSON (every repetition's figures) and a Markdown table go to ``benchmarks/results/``.
Exit status: 0 when every job ran, 1 when one failed (the report says which), 2 for bad options.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click

from testkit import JobFailed, LocalJob, free_port

from . import report
from .train_step import TRAIN_SYSTEMS, run_train_job, train_rows

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SYSTEMS = ("gloo", "pslaunch_tcp", "pslaunch_shm")
PATH_ENV = {"pslaunch_tcp": {"PSLAUNCH_SAME_HOST": "tcp"}, "pslaunch_shm": {"PSLAUNCH_SAME_HOST": "shm"}}
SIZES = (4 << 20, 64 << 20)  # what the targets name


def plan_of(quick: bool, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Rounds per measure: fewer for bigger values (each job stays near 20 s on 2 cores). A 4 MiB
    allreduce takes about 10 ms: 60 rounds keep its median steady on a shared machine (20 did not)."""
    if quick:
        return {"sizes": list(sizes), "rounds": [3] * len(sizes), "warmup": 1, "latency_rounds": 30, "keys_rounds": 2}
    rounds = [60 if n <= 4 << 20 else 10 for n in sizes]
    return {"sizes": list(sizes), "rounds": rounds, "warmup": 4, "latency_rounds": 300, "keys_rounds": 5}


def _result(job: LocalJob, role: str, index: int) -> dict:
    for line in job.output_of(role, index).splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise JobFailed(f"{role} {index} printed no RESULT line")


def _merge(results: list[dict]) -> dict[str, float]:
    """Figures of one job: the mean over its workers of each worker's median."""
    merged: dict[str, float] = {}
    for name in results[0]["measures"]:
        rows = [r["measures"][name] for r in results]
        for field in ("busbw", "median_us", "median_ms"):
            if field in rows[0]:
                merged[name] = statistics.mean(r[field] for r in rows)
    return merged


def run_job(system: str, ranks: int, plan: dict, log_dir: Path, timeout: float) -> dict[str, float]:
    """One job of ``system`` with ``ranks`` workers; its figures.

    Raises:
        JobFailed: a process failed, printed no result, or ran past ``timeout``.
    """
    argv_plan = json.dumps(plan)
    single = {"OMP_NUM_THREADS": "1"}  # one compute thread per process, as the gloo baseline runs
    if system == "gloo":
        port = free_port()
        with LocalJob(ranks, 0, start_scheduler=False, start_servers=0, log_dir=log_dir, test_settings=False) as job:
            for i in range(ranks):
                job.start("gloo", i, [sys.executable, str(HERE / "gloo_worker.py"), argv_plan],
                          {"DMLC_ROLE": "", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(i),
                           "WORLD_SIZE": str(ranks), **single})
            job.wait_ok(["gloo"], timeout)
            return _merge([_result(job, "gloo", i) for i in range(ranks)])
    if system == "pslaunch_shm":
        argv_plan = json.dumps({**plan, "shared": True})
    with LocalJob(ranks, 0, worker=[str(HERE / "allreduce_worker.py"), argv_plan], env={**PATH_ENV[system], **single},
                  log_dir=log_dir, test_settings=False) as job:
        job.wait_ok(["worker"], timeout)
        results = [_result(job, "worker", i) for i in range(ranks)]
        job.wait_ok(["scheduler"], 30)
    return _merge(results)


def _ratio(reps: list[dict], ours: str, base: str, measure: str, base_measure: str | None = None) -> float | None:
    """The median over repetitions of ``ours``'s ``measure`` over ``base``'s ``base_measure`` (the same by default)."""
    theirs = base_measure or measure
    ratios = [r[ours][measure] / r[base][theirs] for r in reps
              if r.get(ours) and r.get(base) and measure in r[ours] and theirs in r[base] and r[base][theirs]]
    return statistics.median(ratios) if ratios else None


def _median(reps: list[dict], system: str, measure: str) -> float | None:
    values = [r[system][measure] for r in reps if r.get(system) and measure in r[system]]
    return statistics.median(values) if values else None


def collective_rows(reps_by_ranks: dict[int, list[dict]], sizes: list[int]) -> list[dict[str, Any]]:
    """The table's rows: each measure's medians and its ratio against its baseline, with the target."""
    rows = []
    for ranks, reps in sorted(reps_by_ranks.items()):
        for nbytes in sizes:
            measure = f"busbw_{nbytes}"
            for system, target in (("pslaunch_tcp", 1.0), ("pslaunch_shm", 2.0)):
                rows.append({"measure": f"bus bandwidth {nbytes / (1 << 20):g} MiB, {ranks} workers, "
                                        f"{'TCP' if system.endswith('tcp') else 'same host'}",
                             "ours": _median(reps, system, measure), "base": _median(reps, "gloo", measure),
                             "unit": "B/s", "ratio": _ratio(reps, system, "gloo", measure), "target": f">= {target:g}x gloo",
                             "met": _met(_ratio(reps, system, "gloo", measure), target, higher=True)})
            shared = _ratio(reps, "pslaunch_shm", "gloo", "shared_" + measure, base_measure=measure)
            if shared is not None:
                rows.append({"measure": f"bus bandwidth {nbytes / (1 << 20):g} MiB, {ranks} workers, same host, shared array",
                             "ours": _median(reps, "pslaunch_shm", "shared_" + measure),
                             "base": _median(reps, "gloo", measure), "unit": "B/s", "ratio": shared,
                             "target": ">= 2x gloo", "met": _met(shared, 2.0, higher=True)})
        for nbytes in sizes:  # what each worker's process spent, every thread: steadier than wall time here
            for system, prefix, where in (("pslaunch_tcp", "", "TCP"), ("pslaunch_shm", "", "same host"),
                                          ("pslaunch_shm", "shared_", "same host, shared array")):
                ratio = _ratio(reps, system, "gloo", f"{prefix}cpu_{nbytes}", base_measure=f"cpu_{nbytes}")
                if ratio is None and prefix:
                    continue
                rows.append({"measure": f"CPU per {nbytes / (1 << 20):g} MiB allreduce and worker, {ranks} workers, {where}",
                             "ours": _median(reps, system, f"{prefix}cpu_{nbytes}"),
                             "base": _median(reps, "gloo", f"cpu_{nbytes}"),
                             "unit": "ms", "ratio": ratio, "target": "(none; context)", "met": "-"})
        for system in ("pslaunch_tcp", "pslaunch_shm"):
            ratio = _ratio(reps, system, "gloo", "latency_4")
            rows.append({"measure": f"4-element allreduce, {ranks} workers, {'TCP' if system.endswith('tcp') else 'same host'}",
                         "ours": _median(reps, system, "latency_4"), "base": _median(reps, "gloo", "latency_4"),
                         "unit": "us", "ratio": ratio, "target": "<= 1x gloo", "met": _met(ratio, 1.0, higher=False)})
        for system in ("pslaunch_tcp", "pslaunch_shm"):
            ratio = _key_ratio(reps, system)
            rows.append({"measure": f"1000 one-float keys, {ranks} workers, {'TCP' if system.endswith('tcp') else 'same host'}",
                         "ours": _median(reps, system, "keys1000_fused"), "base": _median(reps, system, "keys1000_unfused"),
                         "unit": "ms", "ratio": ratio, "target": "<= 0.1x unfused", "met": _met(ratio, 0.1, higher=False)})
    return rows


def _key_ratio(reps: list[dict], system: str) -> float | None:
    ratios = [r[system]["keys1000_fused"] / r[system]["keys1000_unfused"] for r in reps if r.get(system)]
    return statistics.median(ratios) if ratios else None


def _met(ratio: float | None, target: float, higher: bool) -> str:
    if ratio is None:
        return "n/a"
    return "yes" if (ratio >= target if higher else ratio <= target) else "no"


def render(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| measure | pslaunch | baseline | ratio | target | met? |", "|---|---|---|---|---|---|"]
    for row in rows:
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.3f}x"
        lines.append(f"| {row['measure']} | {report.fmt_value(row['ours'], row['unit'])} | "
                     f"{report.fmt_value(row['base'], row['unit'])} | {ratio} | {row['target']} | {row['met']} |")
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--reps", type=click.IntRange(1, 50), default=3, show_default=True, help="Repetitions.")
@click.option("--ranks", default="2,4", show_default=True, help="Worker counts, comma-separated.")
@click.option("--sizes", default="4,64", show_default=True, help="Allreduce sizes in MiB, comma-separated.")
@click.option("--quick", is_flag=True, help="Few rounds, one repetition: does it all run?")
@click.option("--skip-train", is_flag=True, help="Leave the training step out.")
@click.option("--skip-collectives", is_flag=True, help="Only the training step.")
@click.option("--job-timeout", type=float, default=300.0, show_default=True, help="Seconds per job.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the JSON report here.")
@click.option("--results-dir", type=click.Path(file_okay=False, path_type=Path), default=RESULTS, show_default=True,
              help="Where the JSON, the table and the logs go.")
def main(reps: int, ranks: str, sizes: str, quick: bool, skip_train: bool, skip_collectives: bool,
         job_timeout: float, json_path: Path | None, results_dir: Path) -> None:
    """Allreduce and the training step against torch.distributed (see the module docstring)."""
    try:
        counts = sorted({int(r) for r in ranks.split(",") if r.strip()})
        size_list = tuple(int(float(m) * (1 << 20)) // 4 * 4 for m in sizes.split(",") if m.strip())
    except ValueError:
        raise click.BadParameter(f"--ranks {ranks!r} and --sizes {sizes!r} must be comma-separated numbers") from None
    if quick:
        reps = 1
    plan = plan_of(quick, size_list)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    log_root = results_dir / "logs" / f"allreduce-{stamp}"
    machine = report.machine_info()
    started = time.monotonic()
    failures: list[str] = []
    collective_reps: dict[int, list[dict]] = {n: [] for n in counts} if not skip_collectives else {}
    train_reps: list[dict] = []
    for rep in range(reps):
        for n in counts if not skip_collectives else ():
            order = list(SYSTEMS[rep % len(SYSTEMS):] + SYSTEMS[:rep % len(SYSTEMS)])
            figures: dict[str, Any] = {}
            for system in order:
                click.echo(f"[rep {rep + 1}/{reps}] {system}, {n} workers ...", err=True)
                try:
                    figures[system] = run_job(system, n, plan, log_root / f"rep{rep}-{system}-{n}", job_timeout)
                except (JobFailed, OSError, ValueError, KeyError) as exc:
                    figures[system] = None
                    failures.append(f"rep {rep} {system} {n} workers: {exc}")
                    click.echo(f"    FAILED: {exc}", err=True)
            collective_reps[n].append(figures)
        if not skip_train:
            order = list(TRAIN_SYSTEMS[rep % len(TRAIN_SYSTEMS):] + TRAIN_SYSTEMS[:rep % len(TRAIN_SYSTEMS)])
            figures = {}
            for system in order:
                click.echo(f"[rep {rep + 1}/{reps}] training step, {system} ...", err=True)
                try:
                    figures[system] = run_train_job(system, log_root / f"rep{rep}-train-{system}", job_timeout, quick)
                except (JobFailed, OSError, ValueError, KeyError) as exc:
                    figures[system] = None
                    failures.append(f"rep {rep} train {system}: {exc}")
                    click.echo(f"    FAILED: {exc}", err=True)
            train_reps.append(figures)
    rows = collective_rows(collective_reps, plan["sizes"]) + (train_rows(train_reps) if train_reps else [])
    machine["loadavg_end"] = list(os.getloadavg())
    out = {
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, "-m", "benchmarks.allreduce"] + sys.argv[1:],
        "wall_s": round(time.monotonic() - started, 1),
        "machine": machine,
        "plan": plan,
        "reps": {"collectives": {str(n): r for n, r in collective_reps.items()}, "train": train_reps},
        "rows": rows,
        "failures": failures,
        "log_dir": str(log_root),
    }
    table = render(rows)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"allreduce-{stamp}.json").write_text(json.dumps(out, indent=2))
    (results_dir / f"allreduce-{stamp}.md").write_text(table + "\n")
    if json_path is not None:
        json_path.write_text(json.dumps(out, indent=2))
    click.echo(table)
    click.echo(f"load average {machine['loadavg_start']} at start, {machine['loadavg_end']} at end; "
               f"{out['wall_s']} s; JSON in {results_dir / f'allreduce-{stamp}.json'}", err=True)
    if failures:
        click.echo("failed jobs:\n  " + "\n  ".join(failures), err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
