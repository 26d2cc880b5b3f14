"""Output throughput: how fast one chatty worker can print through pslaunch, against a bare pipe.

    python benchmarks/output_throughput.py [--mib 512] [--line 100] [--runs 5] [--json out.json]

A worker writes ``--mib`` MiB of ``--line``-byte lines to its stdout as fast as it can (blocks of
about 1 MiB, each many whole lines) and records how long its writes took: a writer can only go as
fast as the other end of its pipe reads, so that is the rate the output path sustains.

* ``pslaunch``: ``pslaunch -n 1 -s 1 python chatty.py``: pslaunch reads the worker's pipe, splits
  and prefixes every line (``[worker.0@localhost] ...``) and writes them to its own stdout, a pipe
  this script reads and throws away;
* ``pipe``: the same worker with its stdout a pipe this script reads and throws away: the ceiling,
  with no launcher in between.

The two run in turn; the ratio is the median of the per-pair ratios pslaunch / pipe. Standalone:
imports nothing from benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_WORKER = """\
import sys, time
total, size, out_file = int(sys.argv[1]) << 20, int(sys.argv[2]), sys.argv[3]
line = b"x" * (size - 1) + b"\\n"
block = line * max(1, (1 << 20) // size)
out = sys.stdout.buffer
sent = 0
start = time.perf_counter()
while sent < total:
    out.write(block)
    sent += len(block)
out.flush()
seconds = time.perf_counter() - start
with open(out_file, "w") as fh:
    fh.write(f"{sent} {seconds}\\n")
"""


def _drain(stream) -> None:
    while os.read(stream.fileno(), 1 << 20):
        pass


def _run(argv: list[str], env: dict[str, str], result: Path, timeout: float) -> float:
    """Run ``argv`` with stdout and stderr drained by threads; returns the worker's MB/s."""
    result.unlink(missing_ok=True)
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    readers = [threading.Thread(target=_drain, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(10)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode} and recorded no rate")
    sent, seconds = result.read_text().split()
    return int(sent) / float(seconds) / 1e6


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; print the table (and write JSON with ``--json``). Returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB the worker writes per run (default 512)")
    parser.add_argument("--line", type=int, default=100, help="bytes per line, newline included (default 100)")
    parser.add_argument("--runs", type=int, default=5, help="pairs of runs (default 5)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take (default 300)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.pop("NO_COLOR", None)
    with tempfile.TemporaryDirectory(prefix="pslaunch-output-") as tmp:
        worker = Path(tmp) / "chatty.py"
        worker.write_text(_WORKER)
        result = Path(tmp) / "rate"
        worker_args = [str(worker), str(args.mib), str(args.line), str(result)]
        commands = {
            "pslaunch": [sys.executable, "-m", "launcher.cli", "-n", "1", "-s", "1", "python", *worker_args],
            "pipe": [sys.executable, *worker_args],
        }
        rates: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, cmd in commands.items():
                rates[name].append(_run(cmd, env, result, args.timeout))
    ratios = [p / b for p, b in zip(rates["pslaunch"], rates["pipe"])]
    load = os.getloadavg()
    report = {
        "what": f"MB/s one worker writes {args.mib} MiB of {args.line}-byte lines (1 MB = 1e6 bytes)",
        "runs": args.runs,
        "median_mb_per_s": {name: statistics.median(values) for name, values in rates.items()},
        "mb_per_s": rates,
        "ratio_pslaunch_over_pipe": statistics.median(ratios),
        "per_pair_ratios": ratios,
        "cores": os.cpu_count(),
        "loadavg_end": load,
    }
    print(f"output throughput, {args.mib} MiB of {args.line}-byte lines, {args.runs} pairs "
          f"(median; min-max), {os.cpu_count()} cores, load {load[0]:.1f}")
    for name, values in rates.items():
        print(f"  {name:9s} {statistics.median(values):8.1f} MB/s   ({min(values):.1f}-{max(values):.1f})")
    print(f"  ratio pslaunch / pipe: {report['ratio_pslaunch_over_pipe']:.2f} "
          f"(median of per-pair ratios; {min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
