"""benchmarks.compression_wire runs its jobs over loopback TCP and across the shaped link between
network namespaces, reports every configuration, and leaves no namespace behind.

No timing is asserted (performance lives in benchmarks/); this keeps the benchmark working. The
capped network is left out where network namespaces cannot be made (not root).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_netns_link import _UNUSABLE, _namespaces

REPO = Path(__file__).resolve().parent.parent


def test_the_wire_benchmark_reports_both_compressions_on_every_network_with_the_same_bits(tmp_path):
    out = tmp_path / "report.json"
    argv = [sys.executable, "-m", "benchmarks.compression_wire", "--size-mib", "1", "--rounds", "1", "--warmup", "0",
            "--reps", "1", "--skip-mxnet", "--rate", "200mbit", "--json", str(out), "--job-timeout", "60"]
    if _UNUSABLE is not None:
        argv.append("--skip-capped")
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        proc.terminate()  # TERM unwinds: the jobs are reaped and the namespaces deleted
        stdout, _ = proc.communicate(timeout=30)
        raise AssertionError(f"the benchmark ran past 150 s:\n{stdout}") from None
    assert proc.returncode == 0, stdout
    report = json.loads(out.read_text())
    networks = ["tcp"] if _UNUSABLE is not None else ["tcp", "capped"]
    rows = {(r["network"], r["compression"]): r for r in report["rows"]}
    assert sorted(rows) == sorted((n, c) for n in networks for c in ("2bit", "none")), report["rows"]
    assert all(r["ms"] > 0 and r["system"] == "pslaunch" for r in rows.values())
    for network in networks:
        assert f"{network}:pslaunch_none/pslaunch_2bit" in report["ratios"]
    assert rows[("tcp", "2bit")]["digest"] == rows[(networks[-1], "2bit")]["digest"]  # the same pushes, the same bits
    assert not [ns for ns in _namespaces() if ns.startswith(f"pslbench-{proc.pid}-")]
    if _UNUSABLE is None:
        assert "tc tbf rate 200mbit" in report["link"]
