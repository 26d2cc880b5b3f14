"""The training step of a model: torch DDP on gloo against ``kvcore.Trainer``, 2 workers, one run.

    python -m benchmarks.train_step --model resnet20|mlp [--reps 3] [--quick] [--profile-dir DIR] [--json FILE]

The systems (``benchmarks/train_step_worker.py``: the model, data and step of the DDP baseline), each a
job of 2 workers on 127.0.0.1, one thread each:

- ``floor``: one process, no communication: the step's compute alone;
- ``ddp``: ``DistributedDataParallel`` over gloo (bucketed allreduce overlapping backward);
- ``trainer_allreduce``: ``kvcore.Trainer`` on ``kvcore.create('allreduce')`` in a job without
  servers (gradients summed in place through ``kvcore.collectives``, the optimizer on each worker);
- ``trainer_dist_sync``: ``kvcore.Trainer`` on ``dist_sync`` with 2 servers (the optimizer on the
  servers, weights pulled back); ``trainer_dist_sync_1server``: the same with 1 server;
- ``..._no_overlap``: the Trainer systems with ``overlap=False`` (gradients leave after backward).

In the Trainer systems each group of gradients leaves as soon as backprop produced it (PyTorch's
gradient hooks). The figure is the median step time of worker 0; a ratio is the median of the
per-repetition ratios against ``ddp``. The share of communication hidden behind backward, per
Trainer store: ``(no_overlap - overlap) / (no_overlap - floor)``, what overlapping saved of what
the communication costs when nothing hides it (1: all hidden; about 0 when the communication is
too small to measure against the compute's noise). ``--profile-dir``: every worker of a Trainer
system writes a cProfile of its timed steps there (``benchmarks.profile_summary DIR`` reads them).

``python -m benchmarks.allreduce`` runs the MLP's ``ddp``/``trainer_allreduce``/``trainer_dist_sync``
(``TRAIN_SYSTEMS``) in the same run as the collectives, as before.
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import click

from testkit import JobFailed, LocalJob, free_port

HERE = Path(__file__).resolve().parent
TRAIN_SYSTEMS = ("ddp", "trainer_allreduce", "trainer_dist_sync")
#: Every system of this module: (worker mode, store, servers, overlap).
SYSTEMS = {
    "floor": ("floor", None, 0, True),
    "ddp": ("ddp", None, 0, True),
    "trainer_allreduce": ("trainer", "allreduce", 0, True),
    "trainer_dist_sync": ("trainer", "dist_sync", 2, True),
    "trainer_dist_sync_1server": ("trainer", "dist_sync", 1, True),
    "trainer_allreduce_no_overlap": ("trainer", "allreduce", 0, False),
    "trainer_dist_sync_no_overlap": ("trainer", "dist_sync", 2, False),
}
#: Step time against DDP's, per model (issue targets; the MLP's as docs/benchmarks.md has them).
TARGETS = {
    "mlp": {"trainer_allreduce": 1.0, "trainer_dist_sync": 0.8},
    "resnet20": {"trainer_allreduce": 1.0, "trainer_dist_sync": 1.1},
}
WORKERS = 2


def _result(job: LocalJob, role: str, index: int) -> dict:
    for line in job.output_of(role, index).splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise JobFailed(f"{role} {index} printed no RESULT line")


def run_train_job(system: str, log_dir: Path, timeout: float, quick: bool = False, model: str = "mlp",
                  profile_dir: Path | None = None) -> dict[str, float]:
    """One job of ``system``; ``{"ms_per_step": worker 0's median, "params": ...}``.

    Raises:
        JobFailed: a process failed, printed no result, or ran past ``timeout``.
    """
    mode, store, servers, overlap = SYSTEMS[system]
    steps = ["--warmup", "1", "--steps", "3"] if quick else []
    single = {"OMP_NUM_THREADS": "1"}
    worker = [str(HERE / "train_step_worker.py")]
    options = ["--model", model, *steps]
    if mode == "floor":
        with LocalJob(1, 0, start_scheduler=False, start_servers=0, log_dir=log_dir, test_settings=False) as job:
            job.start("floor", 0, [sys.executable, *worker, "floor", *options], {"DMLC_ROLE": "", **single})
            job.wait_ok(["floor"], timeout)
            result = _result(job, "floor", 0)
    elif mode == "ddp":
        port = free_port()
        with LocalJob(WORKERS, 0, start_scheduler=False, start_servers=0, log_dir=log_dir, test_settings=False) as job:
            for i in range(WORKERS):
                job.start("ddp", i, [sys.executable, *worker, "ddp", *options],
                          {"DMLC_ROLE": "", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(i),
                           "WORLD_SIZE": str(WORKERS), **single})
            job.wait_ok(["ddp"], timeout)
            result = _result(job, "ddp", 0)
    else:
        argv = [*worker, "trainer", "--store", store, *options] + ([] if overlap else ["--no-overlap"])
        worker_env = None
        if profile_dir is not None:
            profile_dir.mkdir(parents=True, exist_ok=True)
            worker_env = [{"TRAIN_STEP_PROFILE": str(profile_dir / f"{model}-{system}.prof.rank{i}")}
                          for i in range(WORKERS)]
        with LocalJob(WORKERS, servers, worker=argv, env=single, log_dir=log_dir, test_settings=False,
                      worker_env=worker_env) as job:
            job.wait_ok(["worker"], timeout)
            results = [_result(job, "worker", i) for i in range(WORKERS)]
            result = next(r for r in results if r["rank"] == 0)
    return {"ms_per_step": result["ms_per_step"], "cpu_ms_per_step": result["cpu_ms_per_step"],
            "params": result["params"]}


def train_rows(reps: list[dict[str, Any]], model: str = "mlp") -> list[dict[str, Any]]:
    """Rows for ``benchmarks.allreduce``'s report: each Trainer system's step time against DDP's."""
    rows = []
    for system, target in TARGETS[model].items():
        ratios = [r[system]["ms_per_step"] / r["ddp"]["ms_per_step"] for r in reps if r.get(system) and r.get("ddp")]
        ours = [r[system]["ms_per_step"] for r in reps if r.get(system)]
        base = [r["ddp"]["ms_per_step"] for r in reps if r.get("ddp")]
        ratio = statistics.median(ratios) if ratios else None
        rows.append({"measure": f"training step, 2 workers, {system.removeprefix('trainer_')} store",
                     "ours": statistics.median(ours) if ours else None, "base": statistics.median(base) if base else None,
                     "unit": "ms", "ratio": ratio, "target": f"<= {target:g}x DDP",
                     "met": "n/a" if ratio is None else "yes" if ratio <= target else "no"})
        cpu = [r[system]["cpu_ms_per_step"] / r["ddp"]["cpu_ms_per_step"] for r in reps if r.get(system) and r.get("ddp")]
        rows.append({"measure": f"CPU per training step of worker 0, {system.removeprefix('trainer_')} store",
                     "ours": statistics.median([r[system]["cpu_ms_per_step"] for r in reps if r.get(system)] or [0]),
                     "base": statistics.median([r["ddp"]["cpu_ms_per_step"] for r in reps if r.get("ddp")] or [0]),
                     "unit": "ms", "ratio": statistics.median(cpu) if cpu else None, "target": "(none; context)",
                     "met": "-"})
    return rows


BATCH = 32  # samples per worker and step (train_step_worker's default)


def step_rows(reps: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    """One row per system measured: worker 0's step, images/s of the job, the ratio to DDP, the target."""
    rows = []
    for system in SYSTEMS:
        times = [r[system]["ms_per_step"] for r in reps if r.get(system)]
        if not times:
            continue
        ratios = [r[system]["ms_per_step"] / r["ddp"]["ms_per_step"] for r in reps if r.get(system) and r.get("ddp")]
        ratio = statistics.median(ratios) if ratios else None
        target = TARGETS[model].get(system)
        ranks = 1 if system == "floor" else WORKERS
        rows.append({"system": system, "ms_per_step": statistics.median(times), "ms_range": [min(times), max(times)],
                     "images_per_s": ranks * BATCH / (statistics.median(times) / 1e3), "ratio_to_ddp": ratio,
                     "target": None if target is None else f"<= {target:g}x DDP",
                     "met": None if target is None or ratio is None else ratio <= target})
    return rows


def hidden_shares(reps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per Trainer store, the share of its communication that overlapping hid behind backward
    (median of the repetitions), with what it was computed from. The share is None when the
    communication left exposed without overlap (``no_overlap - floor``) is within the noise (less
    than 5% of the floor's step): then there is nothing to hide, and the ratio would be noise."""
    shares: dict[str, dict[str, Any]] = {}
    for store in ("allreduce", "dist_sync"):
        on, off = f"trainer_{store}", f"trainer_{store}_no_overlap"
        both = [r for r in reps if r.get(on) and r.get(off) and r.get("floor")]
        if not both:
            continue
        floor = statistics.median([r["floor"]["ms_per_step"] for r in both])
        exposed = statistics.median([r[off]["ms_per_step"] - r["floor"]["ms_per_step"] for r in both])
        share = None
        if exposed > 0.05 * floor:
            share = statistics.median([(r[off]["ms_per_step"] - r[on]["ms_per_step"])
                                       / (r[off]["ms_per_step"] - r["floor"]["ms_per_step"]) for r in both])
        shares[store] = {"share": share, "exposed_ms": exposed, "floor_ms": floor}
    return shares


def render_steps(rows: list[dict[str, Any]], shares: dict[str, dict[str, Any]], model: str) -> str:
    lines = [f"| {model}, 2 workers | step (median, range) | images/s | vs DDP | target | met? |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        low, high = row["ms_range"]
        ratio = "-" if row["ratio_to_ddp"] is None else f"{row['ratio_to_ddp']:.2f}x"
        met = "-" if row["met"] is None else "yes" if row["met"] else "no"
        lines.append(f"| {row['system']} | {row['ms_per_step']:.1f} ms ({low:.1f}-{high:.1f}) | "
                     f"{row['images_per_s']:.0f} | {ratio} | {row['target'] or '-'} | {met} |")
    for store, figures in shares.items():
        exposed = f"{figures['exposed_ms']:.1f} ms over the floor without overlap"
        if figures["share"] is None:
            lines.append(f"\ncommunication hidden behind backward, {store} store: not measurable ({exposed}: "
                         "within 5% of the floor's step)")
        else:
            lines.append(f"\ncommunication hidden behind backward, {store} store: {figures['share'] * 100:.0f}% "
                         f"({exposed})")
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", type=click.Choice(["resnet20", "mlp"]), default="resnet20", show_default=True)
@click.option("--reps", type=click.IntRange(1, 50), default=3, show_default=True, help="Repetitions.")
@click.option("--systems", default=",".join(SYSTEMS), show_default=True, help="Systems, comma-separated.")
@click.option("--quick", is_flag=True, help="Few steps, one repetition: does it all run?")
@click.option("--job-timeout", type=float, default=300.0, show_default=True, help="Seconds per job.")
@click.option("--profile-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Each Trainer worker writes a cProfile of its timed steps here.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=HERE / "results" / "logs",
              show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(model: str, reps: int, systems: str, quick: bool, job_timeout: float, profile_dir: Path | None,
         log_dir: Path, json_path: Path | None) -> None:
    """The training step of --model under every system (see the module docstring)."""
    chosen = [name for name in systems.split(",") if name]
    unknown = sorted(set(chosen) - set(SYSTEMS))
    if unknown:
        raise click.BadParameter(f"unknown systems {', '.join(unknown)}; the systems are {', '.join(SYSTEMS)}")
    if quick:
        reps = 1
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    all_reps: list[dict] = []
    failures = []
    for rep in range(reps):
        order = chosen[rep % len(chosen):] + chosen[:rep % len(chosen)]  # each system in each place in turn
        figures: dict[str, Any] = {}
        for system in order:
            click.echo(f"[rep {rep + 1}/{reps}] {model}, {system} ...", err=True)
            try:
                figures[system] = run_train_job(system, log_dir / f"train-{stamp}" / f"rep{rep}-{system}", job_timeout,
                                                quick, model, profile_dir)
            except (JobFailed, OSError, ValueError, KeyError) as exc:
                figures[system] = None
                failures.append(f"rep {rep} {system}: {exc}")
                click.echo(f"    FAILED: {exc}", err=True)
        all_reps.append(figures)
    rows = step_rows(all_reps, model)
    shares = hidden_shares(all_reps)
    click.echo(render_steps(rows, shares, model))
    if json_path is not None:
        json_path.write_text(json.dumps({"model": model, "reps": all_reps, "rows": rows, "hidden_share": shares,
                                         "failures": failures}, indent=2))
    if failures:
        click.echo("failed jobs:\n  " + "\n  ".join(failures), err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
