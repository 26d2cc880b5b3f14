"""The overlap example trains the same weights with and without overlap (timings live in benchmarks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_overlap_example_trains_identical_weights_in_both_schedules(tmp_path):
    pytest.importorskip("sklearn", reason="the example's digits data set ships with scikit-learn")
    out = tmp_path / "overlap.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "overlap_mlp.py"), "--devices", "0", "1", "--epochs", "2",
         "--hidden", "64", "--device", "cpu", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["identical_weights"] is True
    assert report["results"]["overlap"]["test_accuracy"] == report["results"]["sync"]["test_accuracy"]
    assert report["results"]["overlap"]["test_accuracy"] > 0.8


@pytest.mark.slow
def test_overlap_example_under_dist_trains_identical_weights_with_one_worker(tmp_path):
    pytest.importorskip("sklearn", reason="the example's digits data set ships with scikit-learn")
    from psnode.testing import LocalJob

    out = tmp_path / "overlap_dist.json"
    argv = [str(ROOT / "examples" / "overlap_mlp.py"), "--kind", "dist", "--devices", "0", "1", "--epochs", "1",
            "--hidden", "64", "--device", "cpu", "--json", str(out)]
    with LocalJob(num_workers=1, num_servers=1, worker=argv) as job:
        results = job.wait(timeout=120)
    assert all(r.returncode == 0 for r in results), "\n".join(str(r) for r in results)
    report = json.loads(out.read_text())
    assert report["kind"] == "dist" and report["workers"] == 1
    assert report["identical_weights"] is True
    assert report["results"]["overlap"]["test_accuracy"] > 0.5  # one epoch; chance is 0.1
