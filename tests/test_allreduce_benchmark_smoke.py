"""The allreduce benchmark runs: one quick pass with 2 workers yields every collective row against gloo.

No timing is asserted (the figures live in docs/benchmarks.md); this checks that
``python -m benchmarks.allreduce`` starts the gloo and pslaunch jobs, that their sums were checked
(a wrong sum fails a job, and then the run), reaps them, and writes a complete report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_a_quick_run_reports_every_collective_row_with_measured_figures(tmp_path):
    pytest.importorskip("torch", reason="the gloo baseline needs the torch extra")
    out = tmp_path / "out.json"
    argv = [sys.executable, "-m", "benchmarks.allreduce", "--quick", "--ranks", "2", "--sizes", "1", "--skip-train", "--json", str(out),
            "--results-dir", str(tmp_path / "results"), "--job-timeout", "90"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the runner reaps its jobs on TERM
        stdout, _ = proc.communicate(timeout=30)
        pytest.fail(f"the benchmark ran past 240 s:\n{stdout[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == []
    measures = [row["measure"] for row in report["rows"]]
    # bandwidth and CPU over TCP, on one host and on one host with a shared array; latency and the 1000 keys
    # over TCP and on one host
    assert len(measures) == 10, measures
    assert sum("shared array" in m for m in measures) == 2, measures
    assert all(row["ratio"] is not None and row["ours"] > 0 and row["base"] > 0 for row in report["rows"]), report["rows"]


def test_the_training_step_benchmark_runs_resnet20_under_every_system(tmp_path):
    pytest.importorskip("torch", reason="the models and the DDP baseline need the torch extra")
    out = tmp_path / "steps.json"
    argv = [sys.executable, "-m", "benchmarks.train_step", "--model", "resnet20", "--quick", "--json", str(out),
            "--log-dir", str(tmp_path / "logs"), "--job-timeout", "90"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == [] and report["model"] == "resnet20"
    rows = {row["system"]: row for row in report["rows"]}
    from benchmarks.train_step import SYSTEMS

    assert set(rows) == set(SYSTEMS), rows  # every worker checked its weights equal worker 0's, or its job failed
    assert all(row["ms_per_step"] > 0 and row["images_per_s"] > 0 for row in rows.values()), rows
    assert rows["trainer_allreduce"]["target"] == "<= 1x DDP" and rows["trainer_dist_sync"]["target"] == "<= 1.1x DDP"
    assert set(report["hidden_share"]) == {"allreduce", "dist_sync"}
