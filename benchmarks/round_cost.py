"""What one ``dist_sync`` round of a big key costs: its time, each process's CPU, and ``push()``'s call.

    python -m benchmarks.round_cost [--size-mib 4] [--rounds 100] [--same-host tcp] [--no-copy]
                                    [--checkout DIR --checkout DIR] [--pairs 5]

``benchmarks.run`` gives throughput, which a 2-core machine moves by up to 2x between minutes. A
change that saves CPU shows more steadily in the CPU a round costs: this runs one scheduler, one
server and 2 workers on 127.0.0.1 (``LocalJob``, as ``benchmarks.run``), each worker pushing and
pulling one float32 key of ``--size-mib`` ``--rounds`` times after a warm-up, and reports per round
the time (mean), rank 0's CPU and the server's CPU (``/proc``, user and system), and the time
until ``push()`` returned. ``--same-host`` is the job's ``PSLAUNCH_SAME_HOST`` (``tcp``: loopback
TCP, data lanes; ``shm``: the same-host path). Every pulled value is checked.

With two ``--checkout`` directories (each a pslaunch checkout, every process importing that one's
code through ``PYTHONPATH``) the jobs alternate between them ``--pairs`` times, so both see the same
minutes of the machine: a before/after of a change.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import click

from testkit.jobs import LocalJob

WORKER = str(Path(__file__).with_name("round_cost_worker.py"))
RESULT = "ROUND_COST "


def run_once(size: int, rounds: int, same_host: str, copy: bool, checkout: str | None, timeout_s: float = 300,
             cpu_bind: bool = False) -> dict:
    """One job; rank 0's result: ``round_ms``, ``worker_cpu_ms``, ``server_cpu_ms``, ``push_call_ms``;
    ``cpu_bind``: each process on one core, in turn (``LocalJob(cpu_bind=True)``)."""
    env = {"PSLAUNCH_SAME_HOST": same_host, "ROUND_COST": json.dumps({"size": size, "rounds": rounds, "copy": copy})}
    if checkout:
        env["PYTHONPATH"] = checkout
    here = os.getcwd()
    os.chdir(checkout or here)  # ``python -m psnode`` imports the package of its working directory first
    try:
        with LocalJob(2, 1, worker=[WORKER], env=env, test_settings=False, cpu_bind=cpu_bind) as job:
            job.wait_ok(["worker"], timeout_s)
            output = job.output_of("worker", 0) + job.output_of("worker", 1)  # the scheduler gives the ranks
    finally:
        os.chdir(here)
    for line in output.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"rank 0 printed no {RESULT.strip()} line:\n{output}")


def _line(name: str, results: list[dict]) -> str:
    keys = ("round_ms", "worker_cpu_ms", "server_cpu_ms", "push_call_ms", "worker_switches", "server_switches")
    medians = [statistics.median(r.get(k, float("nan")) for r in results) for k in keys]
    each = " ".join(f"{r['round_ms']:.2f}" for r in results)
    return (f"{name}: round {medians[0]:.2f} ms, worker CPU {medians[1]:.2f} ms, server CPU {medians[2]:.2f} ms, "
            f"push() {medians[3]:.2f} ms, context switches worker {medians[4]:.1f} server {medians[5]:.1f} "
            f"per round (medians of {len(results)}; rounds: {each})")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--size-mib", type=float, default=4.0, show_default=True, help="The key's size.")
@click.option("--rounds", type=click.IntRange(1), default=100, show_default=True, help="Timed rounds per job.")
@click.option("--same-host", type=click.Choice(["tcp", "shm", "ipc"]), default="tcp", show_default=True,
              help="PSLAUNCH_SAME_HOST of the job.")
@click.option("--copy/--no-copy", default=True, show_default=True, help="push(..., copy=...).")
@click.option("--checkout", "checkouts", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A pslaunch checkout whose code the job runs (twice: alternate before/after).")
@click.option("--pairs", type=click.IntRange(1), default=3, show_default=True, help="Jobs per checkout.")
@click.option("--cpu-bind", is_flag=True, help="Each process on one core, in turn (scheduler, server, workers): the "
              "workers on different cores in every job.")
def main(size_mib: float, rounds: int, same_host: str, copy: bool, checkouts: tuple[str, ...], pairs: int,
         cpu_bind: bool) -> None:
    size = int(size_mib * (1 << 20)) // 4 * 4
    sides = [str(Path(c).resolve()) for c in checkouts] or [None]
    results: dict[str | None, list[dict]] = {side: [] for side in sides}
    for _ in range(pairs):
        for side in sides:
            results[side].append(run_once(size, rounds, same_host, copy, side, cpu_bind=cpu_bind))
    bound = ", each process on one core" if cpu_bind else ""
    print(f"{size / (1 << 20):g} MiB, {rounds} rounds, PSLAUNCH_SAME_HOST={same_host}, copy={copy}, 2 workers, 1 server"
          f"{bound}")
    for side in sides:
        print(_line(side or "this checkout", results[side]))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
