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
            "--scheduler-nodes", "32", "--death-timeout", "2", "--server-workers", "4", "--many-keys", "5000",
            "--per-call-servers", "4", "--json", str(out)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert {(r["model"], r["servers"]) for r in report["placement"]} == {
        (m, s) for m in ("ResNet-50", "BERT-base", "100 random keys") for s in (2, 4, 8, 16)}
    assert all(r["by_bytes"] <= 1.05 < r["hash"] or r["hash"] <= 1.05 for r in report["placement"])
    assert {(r["model"], r["servers"]) for r in report["per_call"]} == {("ResNet-50", 4), ("100 random keys", 4)}
    assert all(r["balance"] <= 1.05 and len(r["held_bytes"]) == 4 for r in report["per_call"]), report["per_call"]
    many = report["many_keys"]
    assert many["keys"] == 5000 and set(many["calls_s"]) == {"0", "1"}, many
    assert many["rss_mib"]["scheduler"] > 0 and many["rss_mib"]["worker 0"] > 0 and len(many["rss_mib"]["servers"]) == 2
    job = report["job"]
    assert job["rss_mib"]["worker"]["seen"] == 3 and job["rss_mib"]["server"]["seen"] == 2
    assert job["wall_s"] > 0 and job["launcher_rss_mib"] > 0
    assert "torch" not in job["libraries"]["server"] and "sklearn" not in job["libraries"]["server"]
    (scheduler,) = report["scheduler"]
    assert scheduler["nodes"] == 32 and scheduler["death_told"] == "31 of 31", scheduler
    (server,) = report["server"]
    assert server["workers"] == 4 and not server["offered"] and server["ns_per_byte"] >= 0, server


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


def test_the_server_benchmark_measures_rounds_sent_at_once_and_by_invitation(tmp_path):
    out = tmp_path / "server.json"
    # 8 workers x 1 MiB: over a 4 MiB window (offered), then under a 16 MiB one (sent at once)
    for window in ("4", "16"):
        argv = [sys.executable, "-m", "benchmarks.server_scale", "--workers", "8", "--rounds", "2", "--window-mib",
                window, "--json", str(out)]
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (row,) = json.loads(out.read_text())
        assert row["workers"] == 8 and row["offered"] == (window == "4"), row
        assert row["round_s"] > 0 and row["ns_per_byte"] >= 0 and row["rss_peak_mib"] > 0, row
