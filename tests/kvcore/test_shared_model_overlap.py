"""The overlap example trains the same weights with and without overlap (timings live in benchmarks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore import arrays

from kvcore_testkit import needs_gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind,devices", [
    ("cpu", ["0", "1"]),
    pytest.param("gpu", ["0"], marks=needs_gpu),
    pytest.param("gpu", None, marks=needs_gpu, id="gpu-every-gpu-by-default"),
])
def test_overlap_example_trains_identical_weights_in_both_schedules(tmp_path, kind, devices):
    pytest.importorskip("sklearn", reason="the example's digits data set ships with scikit-learn")
    out = tmp_path / "overlap.json"
    # every GPU splits each epoch into fewer (bigger) global steps: train as many steps as two devices do
    epochs = 2 if devices else max(2, arrays.num_gpus())
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "overlap_mlp.py"), *(["--devices", *devices] if devices else []),
         "--epochs", str(epochs), "--hidden", "64", "--device", kind, "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    expected_devices = [int(d) for d in devices] if devices else list(range(arrays.num_gpus()))
    assert report["backend"] == kind and report["devices"] == expected_devices
    assert report["identical_weights"] is True
    assert report["results"]["overlap"]["test_accuracy"] == report["results"]["sync"]["test_accuracy"]
    assert report["results"]["overlap"]["test_accuracy"] > 0.8


@pytest.mark.slow
@pytest.mark.parametrize("kind,devices", [("cpu", ["0", "1"]), pytest.param("gpu", ["0"], marks=needs_gpu)])
def test_overlap_example_under_dist_trains_identical_weights_with_one_worker(tmp_path, kind, devices):
    pytest.importorskip("sklearn", reason="the example's digits data set ships with scikit-learn")
    from testkit import LocalJob

    out = tmp_path / "overlap_dist.json"
    argv = [str(ROOT / "examples" / "overlap_mlp.py"), "--kind", "dist", "--devices", *devices, "--epochs", "1",
            "--hidden", "64", "--device", kind, "--json", str(out)]
    with LocalJob(num_workers=1, num_servers=1, worker=argv) as job:
        results = job.wait(timeout=120)
    assert all(r.returncode == 0 for r in results), "\n".join(str(r) for r in results)
    report = json.loads(out.read_text())
    assert report["kind"] == "dist" and report["workers"] == 1 and report["backend"] == kind
    assert report["identical_weights"] is True
    assert report["results"]["overlap"]["test_accuracy"] > 0.5  # one epoch; chance is 0.1
