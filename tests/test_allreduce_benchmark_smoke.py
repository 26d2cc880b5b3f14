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
