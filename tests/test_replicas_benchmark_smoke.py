"""The replicas benchmark runs: a quick pass measures push+pull with and without ``--server-replicas``,
kills a server mid-run and says how long the round it interrupted took, every job ending well.

No timing is asserted (the figures live in docs/benchmarks.md and docs/failures.md); this checks that
``python -m benchmarks.replicas`` kills what it says, reaps every job and writes a complete report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.launcher import reaped, wait_gone

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_quick_run_measures_both_ways_and_a_server_killed(tmp_path):
    out = tmp_path / "out.json"
    argv = [sys.executable, "-m", "benchmarks.replicas", "--quick", "--reps", "1", "--kills", "1", "--json", str(out)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    with reaped(proc, "pslaunch-replicas-"):  # its jobs' processes carry their folder's name
        stdout, _ = proc.communicate(timeout=280)
    assert proc.returncode == 0, stdout
    report = json.loads(out.read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert set(rows) == {"throughput-r0-0", "throughput-r0-tcp-0", "throughput-r1-0", "kill-0"}, rows
    assert all(row["ok"] and row["mb_per_s"] > 0 for row in rows.values()), rows
    # a replica holds a copy of every key, and each holder keeps the value before its last round
    assert rows["throughput-r1-0"]["held_bytes"] == 2 * rows["throughput-r0-0"]["held_bytes"] > 0, rows
    assert rows["throughput-r0-0"]["kept_bytes"] == 0 < rows["throughput-r1-0"]["kept_bytes"], rows
    kill = rows["kill-0"]
    assert kill["killed_pid"] > 0 and 0 < kill["kill_to_next_round_s"] < 30 and kill["rounds_after_kill"] > 0, kill
    assert report["throughput_ratio"]["tcp"] > 0 and report["throughput_ratio"]["default"] > 0, report
    assert "| kill-0 | 1 |" in stdout, stdout
    assert not wait_gone("pslaunch-replicas-")
