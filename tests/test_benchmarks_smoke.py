"""The benchmark runner itself works: one quick run with tiny keys yields every row, for every system.

No timing is asserted (performance lives in benchmarks/, not in tests); this only checks that
`python -m benchmarks.run` starts the pslaunch job and the raw pyzmq ceiling, reaps them, and writes a
complete JSON report with values that were actually measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SIZES_MIB = ["0.0625", "1"]  # 64 KiB (sent in messages) and 1 MiB (through shared memory on the fast path)
KEYS = 20

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("psnode.__main__") is None, reason="psnode has no runnable node yet (python -m psnode)"
)


def _run_quick(tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out.json"
    argv = [sys.executable, "-m", "benchmarks.run", "--quick", "--skip-mxnet", "--sizes", ",".join(SIZES_MIB), "--keys", str(KEYS),
            "--json", str(out), "--results-dir", str(tmp_path / "results"), "--job-timeout", "60"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        # TERM lets run.py stop and reap its jobs' processes before it exits
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate(timeout=10)
        pytest.fail(f"python -m benchmarks.run --quick did not finish within 100 s; output:\n{stdout[-3000:]}")
    completed = subprocess.CompletedProcess(argv, proc.returncode, stdout, None)
    assert out.exists(), f"no JSON written (exit {proc.returncode}); output:\n{stdout[-3000:]}"
    return completed, json.loads(out.read_text())


def test_quick_run_reports_every_row_for_pslaunch_and_raw_pyzmq(tmp_path):
    completed, report = _run_quick(tmp_path)
    assert completed.returncode == 0, f"run.py exited {completed.returncode}:\n{completed.stdout[-3000:]}"

    sizes = [int(float(m) * (1 << 20)) for m in SIZES_MIB]
    rows = {r["measure"]: r for r in report["rows"]}
    kv_measures = [f"pushpull_{n}" for n in sizes] + ["roundtrip_4elem", f"many_{KEYS}x1float"]
    assert set(kv_measures + [f"oneway_{n}" for n in sizes]) <= set(rows), sorted(rows)

    for system in ("pslaunch_tcp", "pslaunch_fast", "pslaunch_ipc"):
        assert report["systems"][system]["status"] == "ok", report["systems"][system]
        for measure in kv_measures:
            value = rows[measure]["values"][system]
            assert value is not None and value > 0, (system, measure, value)
    for system in ("zmq_tcp", "zmq_ipc"):
        for measure in [f"pushpull_{n}" for n in sizes] + ["roundtrip_4elem"] + [f"oneway_{n}" for n in sizes]:
            value = rows[measure]["values"][system]
            assert value is not None and value > 0, (system, measure, value)
    assert report["systems"]["mxnet_tcp"]["status"] == "skipped"
    assert rows["roundtrip_4elem"]["values"]["mxnet_tcp"] is None

    # pslaunch / raw-pyzmq ratios exist; MXNet targets are honestly "not measured"
    ratio_pairs = {(r["measure"], r["ours"], r["baseline"]) for r in report["ratios"]}
    assert ("roundtrip_4elem", "pslaunch_tcp", "zmq_tcp") in ratio_pairs
    assert ("roundtrip_4elem", "pslaunch_fast", "zmq_ipc") in ratio_pairs
    for target in report["targets"]:  # against MXNet: honestly not measured; against raw pyzmq: judged
        row = rows.get(target["measure"])  # (a quick run measures its own sizes)
        measured = target["baseline"].startswith("zmq_") and row is not None and row["values"][target["baseline"]]
        assert (target["met"] is None) == (not measured), target
        if measured:
            assert target["ratio"] > 0 and isinstance(target["met"], bool), target

    machine = report["machine"]
    assert machine["nproc"] >= 1 and "cpu_model" in machine
    # the table went to stdout too
    assert "4-element key" in completed.stdout and "data path targets" in completed.stdout


def test_python_cost_measures_the_one_frame_round_trip_on_both_sides():
    # the script exits non-zero unless the timed rounds were PUSH_PULL frames answered by VALUE
    # frames, and the pulled value is right: a check that the small round trip takes its compact path
    proc = subprocess.run([sys.executable, "-m", "benchmarks.python_cost", "--rounds", "200", "--reps", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["worker", "server"], proc.stdout
    for line in lines:
        assert float(line.split(":")[1].split()[0]) > 0, line


def test_the_sync_round_ceiling_runs_every_variant_and_reports_each(tmp_path):
    out = tmp_path / "round.json"
    completed = subprocess.run([sys.executable, "-m", "benchmarks.sync_round", "--size-mib", "0.25", "--rounds", "3",
                                "--reps", "1", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    figures = json.loads(out.read_text())["per_rep"]
    from benchmarks.sync_round import VARIANTS

    assert list(figures) == VARIANTS and all(len(v) == 1 and v[0] > 0 for v in figures.values()), figures
    for variant in VARIANTS:
        assert variant in completed.stdout, completed.stdout


def test_the_round_cost_runs_a_job_per_checkout_alternating_and_reports_each(tmp_path):
    # this checkout twice over: the before/after form; each job checks every pulled value
    completed = subprocess.run([sys.executable, "-m", "benchmarks.round_cost", "--size-mib", "0.5", "--rounds", "5",
                                "--pairs", "1", "--checkout", str(REPO), "--checkout", "."], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0].startswith("0.5 MiB, 5 rounds, PSLAUNCH_SAME_HOST=tcp, copy=True"), completed.stdout
    assert len(lines) == 3 and all(line.startswith(f"{REPO}: round ") for line in lines[1:]), completed.stdout
    for line in lines[1:]:
        assert float(line.split("round ")[1].split()[0]) > 0, line
        # a round wakes every process's threads: each one's context switches are counted
        switches = re.search(r"context switches worker ([0-9.]+) server ([0-9.]+) per round", line)
        assert switches and float(switches[1]) > 0 and float(switches[2]) > 0, line


def test_a_bound_job_runs_each_process_and_the_threads_it_starts_on_one_core_in_turn():
    from testkit.jobs import LocalJob

    # what each process prints: its own cores and those of a thread it starts
    report = ("import os, threading; seen = []; t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)));"
              " t.start(); t.join(); print(sorted(os.sched_getaffinity(0)), sorted(seen[0]))")
    cores = sorted(os.sched_getaffinity(0))
    with LocalJob(3, 0, start_scheduler=False, start_servers=0, test_settings=False, cpu_bind=True) as job:
        for i in range(3):
            job.start("worker", i, [sys.executable, "-c", report])
        results = job.wait(timeout=30)
    for i, result in enumerate(results):
        core = cores[i % len(cores)]
        assert result.returncode == 0 and result.output.split() == [f"[{core}]", f"[{core}]"], (i, result)


def test_a_bound_benchmark_run_says_so_in_its_report_and_measures_every_system(tmp_path):
    out = tmp_path / "bound.json"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--only", "roundtrip", "--systems", "pslaunch_tcp,zmq_tcp",
         "--cpu-bind", "--json", str(out), "--results-dir", str(tmp_path / "results"), "--job-timeout", "60"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = json.loads(out.read_text())
    assert report["config"]["cpu_bind"] is True
    assert "each process on one core (--cpu-bind)" in " ".join(completed.stdout.split())  # the title may wrap
    values = {r["measure"]: r["values"] for r in report["rows"]}["roundtrip_4elem"]
    assert values["pslaunch_tcp"] > 0 and values["zmq_tcp"] > 0, values


def test_the_round_cost_runs_bound_and_says_so():
    completed = subprocess.run([sys.executable, "-m", "benchmarks.round_cost", "--size-mib", "0.25", "--rounds", "3",
                                "--pairs", "1", "--cpu-bind"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0].endswith("2 workers, 1 server, each process on one core"), completed.stdout
    assert len(lines) == 2 and float(lines[1].split("round ")[1].split()[0]) > 0, completed.stdout
