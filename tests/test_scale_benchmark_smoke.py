"""benchmarks.scale and benchmarks.agents run end to end and report every measure they name.

No timing is asserted (performance lives in benchmarks/); this keeps the benchmarks working.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_scale_benchmark_reports_the_placement_table_and_a_small_jobs_costs(tmp_path):
    out = tmp_path / "scale.json"
    argv = [sys.executable, "-m", "benchmarks.scale", "--workers", "3", "--servers", "2", "--rounds", "2",
            "--json", str(out)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert {(r["model"], r["servers"]) for r in report["placement"]} == {
        (m, s) for m in ("ResNet-50", "BERT-base", "100 random keys") for s in (2, 4, 8, 16)}
    assert all(r["by_bytes"] <= 1.05 < r["hash"] or r["hash"] <= 1.05 for r in report["placement"])
    job = report["job"]
    assert job["rss_mib"]["worker"]["seen"] == 3 and job["rss_mib"]["server"]["seen"] == 2
    assert job["wall_s"] > 0 and job["launcher_rss_mib"] > 0
    assert "torch" not in job["libraries"]["server"] and "sklearn" not in job["libraries"]["server"]


@pytest.mark.netns
def test_the_agents_benchmark_reports_formation_and_loss(tmp_path):
    from testkit.netns import usable

    why = usable()
    if why is not None:
        pytest.skip(why)
    out = tmp_path / "agents.json"
    argv = [sys.executable, "-m", "benchmarks.agents", "--reps", "1", "--link-timeout", "2", "--json", str(out)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    for name in ("local_s", "form_node0_last_s", "form_node0_first_s", "lost_s"):
        assert len(report[name]["runs"]) == 1 and report[name]["median"] > 0, report


def test_the_scheduler_benchmark_measures_a_simulated_job_of_64_nodes(tmp_path):
    out = tmp_path / "scheduler.json"
    argv = [sys.executable, "-m", "benchmarks.scheduler_scale", "--nodes", "64", "--death-timeout", "3", "--json",
            str(out)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads(out.read_text())
    assert row["nodes"] == 64 and row["servers"] == 8 and row["death_told"] == "63 of 63", row
    assert row["simulator_processes"] == 1, row
    # every worker's book holds the 8 servers, every server's the 56 workers: 8 x 56 x 2 records in all
    assert row["book_bytes_total"] < 64 * 64 * 150, row
    for name in ("book_s", "barrier_ms", "heartbeat_cpu", "rss_mib", "death_s"):
        assert row[name] > 0, (name, row)
