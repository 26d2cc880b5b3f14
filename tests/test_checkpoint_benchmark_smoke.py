"""benchmarks.checkpoint times commits against numpy.save, measures restart-to-resume, and leaves
nothing on disk.

No timing is asserted (performance lives in benchmarks/); this keeps the benchmark working.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_checkpoint_benchmark_reports_every_measure_and_removes_what_it_wrote(tmp_path):
    out = tmp_path / "report.json"
    where = tmp_path / "disk"
    argv = [sys.executable, "-m", "benchmarks.checkpoint", "--sizes-mib", "2", "--reps", "2", "--servers", "2",
            "--dir", str(where), "--json", str(out), "--job-timeout", "60"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert set(row["seconds"]) == {"commit", "commit+wait", "numpy.save", "numpy.save+fsync"}
    assert all(len(v) == 2 and min(v) > 0 for v in row["seconds"].values()), row
    assert row["commit_over_save"] > 0 and row["waited_over_save_fsync"] > 0
    assert report["restart"]["seconds"] > 0 and report["restart"]["pslaunch_s"] > report["restart"]["seconds"]
    assert list(where.iterdir()) == []  # checkpoints and baselines removed
