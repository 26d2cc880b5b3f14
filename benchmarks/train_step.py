"""The training step of a 10.5 M-parameter MLP: torch DDP on gloo against ``kvcore.Trainer``.

    python -m benchmarks.allreduce --skip-collectives [--reps 3] [--quick]

Three systems, 2 workers each on 127.0.0.1 (``benchmarks/train_step_worker.py``: the model, data
and step of the DDP baseline):

- ``ddp``: ``DistributedDataParallel`` over gloo (bucketed allreduce overlapping backward);
- ``trainer_allreduce``: ``kvcore.Trainer`` on ``kvcore.create('allreduce')`` in a job without
  servers (gradients summed in place through ``kvcore.collectives``, the optimizer on each worker);
- ``trainer_dist_sync``: ``kvcore.Trainer`` on ``dist_sync`` with 2 servers (the optimizer on the
  servers, weights pulled back).

In both Trainer systems each group of gradients leaves as soon as backprop produced it (PyTorch's
gradient hooks). The figure is the median step time of worker 0; a ratio is the median of the
per-repetition ratios against ``ddp`` (targets: at most 1.0x for the allreduce store, 0.8x for
``dist_sync``). ``python -m benchmarks.allreduce`` runs them (the module that owns the command line),
without ``--skip-collectives`` in the same run as the collectives.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


from testkit import JobFailed, LocalJob, free_port

HERE = Path(__file__).resolve().parent
TRAIN_SYSTEMS = ("ddp", "trainer_allreduce", "trainer_dist_sync")
TARGETS = {"trainer_allreduce": 1.0, "trainer_dist_sync": 0.8}
WORKERS = 2


def _result(job: LocalJob, role: str, index: int) -> dict:
    for line in job.output_of(role, index).splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise JobFailed(f"{role} {index} printed no RESULT line")


def run_train_job(system: str, log_dir: Path, timeout: float, quick: bool = False) -> dict[str, float]:
    """One job of ``system``; ``{"ms_per_step": worker 0's median, "params": ...}``.

    Raises:
        JobFailed: a process failed, printed no result, or ran past ``timeout``.
    """
    steps = ["--warmup", "1", "--steps", "3"] if quick else []
    single = {"OMP_NUM_THREADS": "1"}
    worker = [str(HERE / "train_step_worker.py")]
    if system == "ddp":
        port = free_port()
        with LocalJob(WORKERS, 0, start_scheduler=False, start_servers=0, log_dir=log_dir, test_settings=False) as job:
            for i in range(WORKERS):
                job.start("ddp", i, [sys.executable, *worker, "ddp", *steps],
                          {"DMLC_ROLE": "", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(i),
                           "WORLD_SIZE": str(WORKERS), **single})
            job.wait_ok(["ddp"], timeout)
            result = _result(job, "ddp", 0)
    else:
        store = system.removeprefix("trainer_")
        servers = 0 if store == "allreduce" else 2
        with LocalJob(WORKERS, servers, worker=[*worker, "trainer", "--store", store, *steps], env=single,
                      log_dir=log_dir, test_settings=False) as job:
            job.wait_ok(["worker"], timeout)
            results = [_result(job, "worker", i) for i in range(WORKERS)]
            result = next(r for r in results if r["rank"] == 0)
    return {"ms_per_step": result["ms_per_step"], "cpu_ms_per_step": result["cpu_ms_per_step"],
            "params": result["params"]}


def train_rows(reps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for the report: each Trainer system's step time against DDP's."""
    rows = []
    for system, target in TARGETS.items():
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
