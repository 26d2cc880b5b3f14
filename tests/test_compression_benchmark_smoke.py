"""benchmarks/compression_kernels.py runs as a standalone script and reports every measure.

No timing is asserted (performance lives in benchmarks/); this only keeps the script working.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "compression_kernels.py"


def test_compression_benchmark_reports_every_measure_for_kvcore(tmp_path):
    out = tmp_path / "report.json"
    argv = [sys.executable, str(SCRIPT), "--skip-mxnet", "--size", "40000", "--reps", "2", "--rounds", "1",
            "--json", str(out), "--timeout", "60"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    seconds = report["systems"]["numpy"]["seconds"]
    assert set(seconds) == {"quantize", "dequantize", "push+pull"}
    assert all(value > 0 for value in seconds.values()), seconds
    assert report["ratios"] == {} and "MXNet" not in proc.stdout
    assert "quantize" in proc.stdout and "ns/v" in proc.stdout
