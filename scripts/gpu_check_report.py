"""Gathers what scripts/gpu_check.sh left in its folder into gpu_check.json and gpu_check.md.

    python scripts/gpu_check_report.py OUTDIR EXIT_STATUS

Reads the stages' status (stages.tsv), the GPUs (driver.log), CuPy's probe (probe.log), the GPU
tests (tests.xml, JUnit) and the benchmarks' JSON files; anything missing is reported as missing,
never guessed. Prints the Markdown table as well. Standard library only: it runs with whatever
Python the machine has when the install failed.
"""

from __future__ import annotations

import csv
import io
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BENCHMARKS = {
    "level1": "Level-1 aggregation (every GPU)",
    "level1_one_gpu": "Level-1 round on one GPU",
    "server_shards": "server shards on the GPU vs the host",
    "allreduce": "NCCL allreduce between workers (no servers)",
    "overlap": "overlap_mlp.py on the GPU",
}


def _read(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.exists() else None


def _stages(out: Path) -> list[dict]:
    rows = []
    for line in (_read(out / "stages.tsv") or "").splitlines():
        name, status, seconds = (line.split("\t") + ["", ""])[:3]
        rows.append({"stage": name, "status": status, "seconds": int(seconds or 0), "log": f"{name}.log"})
    return rows


def _gpus(out: Path) -> list[dict]:
    text = _read(out / "driver.log") or ""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2 or "," not in lines[0]:
        return []
    return [{k.strip(): v.strip() for k, v in row.items()} for row in csv.DictReader(io.StringIO("\n".join(lines)))]


def _probe(out: Path) -> dict | None:
    for line in reversed((_read(out / "probe.log") or "").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _tests(out: Path) -> dict | None:
    text = _read(out / "tests.xml")
    if text is None:
        return None
    root = ET.fromstring(text)
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            counts["failed" if problem.tag == "failure" else "errors"] += 1
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            failures.append({"test": name, "kind": problem.tag, "message": message[0][:400] if message else ""})
        elif skipped is not None:
            counts["skipped"] += 1
            skips.append({"test": name, "reason": (skipped.get("message") or "")[:200]})
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures, "skips": skips}


def _benchmarks(out: Path) -> dict:
    found = {}
    for name in BENCHMARKS:
        text = _read(out / f"{name}.json")
        if text is not None:
            try:
                found[name] = json.loads(text)
            except json.JSONDecodeError as exc:
                found[name] = {"error": f"unreadable JSON: {exc}"}
    return found


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _markdown(report: dict) -> str:
    lines = [f"# GPU check: {'passed' if report['exit_status'] == 0 else 'FAILED'} (exit {report['exit_status']})", ""]
    lines.append(f"commit `{report['commit']}`, host `{report['host']}`")
    for gpu in report["gpus"]:
        lines.append(f"- GPU {gpu.get('index', '?')}: {gpu.get('name', '?')}, driver {gpu.get('driver_version', '?')}, "
                     f"{gpu.get('memory.total [MiB]', gpu.get('memory.total', '?'))}")
    probe = report["probe"]
    lines.append(f"- probe: {probe['gpu_status'] if probe else 'did not run'}; NCCL usable: "
                 f"{probe['nccl_available'] if probe else '?'}")
    lines += ["", "| stage | status | seconds | log |", "| --- | --- | --- | --- |"]
    lines += [f"| {s['stage']} | {s['status']} | {s['seconds']} | {s['log']} |" for s in report["stages"]]
    tests = report["tests"]
    if tests:
        lines += ["", f"GPU tests: {tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, "
                      f"{tests['skipped']} skipped"]
        for f in tests["failures"]:
            lines.append(f"- {f['kind']}: `{f['test']}`: {f['message']}")
        for s in tests["skips"]:
            lines.append(f"- skipped: `{s['test']}`: {s['reason']}")
    for name, title in BENCHMARKS.items():
        bench = report["benchmarks"].get(name)
        if bench is None:
            continue
        lines += ["", f"## {title}", ""]
        if bench.get("error"):
            lines.append(f"error: {bench['error']}")
        rows = bench.get("rows") or []
        if name.startswith("level1") and rows:
            lines += [f"devices {bench.get('devices')} ({', '.join(bench.get('gpu_names', []))}); NCCL used: "
                      f"{bench.get('nccl_used')}; target {bench.get('target')}: {bench.get('target_met')}", "",
                      "| MiB | copy GB/s | peer GB/s | level1 GB/s | level1/copy | round ms | aggregation |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            for r in rows:
                peer = f"{r['peer_gbps']:.1f}" if r.get("peer_gbps") else "-"
                lines.append(f"| {r['mib']:g} | {r['copy_gbps']:.1f} | {peer} | {r['level1_gbps']:.2f} | "
                             f"{r['level1_over_copy']:.2f} | {r['round_seconds'] * 1000:.2f} | {r['aggregation']} |")
        elif name == "server_shards" and rows:
            lines += ["| MiB | host GB/s | gpu GB/s | gpu/host |", "| --- | --- | --- | --- |"]
            lines += [f"| {r['mib']:g} | {r['host_gbps']:.2f} | {r['gpu_gbps']:.2f} | {r['gpu_over_host']:.2f} |" for r in rows]
        elif name == "allreduce" and rows:
            lines += [f"GPUs {bench.get('gpus')}; NCCL usable: {bench.get('nccl')}" + (f"; {bench['note']}" if bench.get("note") else ""),
                      "", "| MiB | copy GB/s | bus GB/s | bus/copy |", "| --- | --- | --- | --- |"]
            for r in rows:
                bus = f"{r['busbw_bytes_per_s'] / 1e9:.1f}" if r.get("busbw_bytes_per_s") else "-"
                ratio = f"{r['busbw_over_copy']:.2f}" if r.get("busbw_over_copy") else "-"
                lines.append(f"| {r['mib']:g} | {r['copy_bytes_per_s'] / 1e9:.1f} | {bus} | {ratio} |")
        elif name == "overlap" and bench.get("results"):
            lines += ["| schedule | best ms/epoch | median ms/epoch | test accuracy |", "| --- | --- | --- | --- |"]
            for schedule, r in bench["results"].items():
                lines.append(f"| {schedule} | {r['best_seconds_per_epoch'] * 1000:.1f} | "
                             f"{r['median_seconds_per_epoch'] * 1000:.1f} | {r['test_accuracy']:.4f} |")
            lines.append(f"\noverlap speed-up {bench.get('speedup', float('nan')):.2f}x; identical weights: "
                         f"{bench.get('identical_weights')}; devices {bench.get('devices')}, backend {bench.get('backend')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    out, status = Path(argv[0]), int(argv[1])
    report = {
        "exit_status": status,
        "commit": _git_commit(),
        "host": platform.node(),
        "python": platform.python_version(),
        "gpus": _gpus(out),
        "probe": _probe(out),
        "stages": _stages(out),
        "tests": _tests(out),
        "benchmarks": _benchmarks(out),
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    markdown = _markdown(report)
    (out / "gpu_check.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
