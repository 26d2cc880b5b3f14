"""The launcher's own speed: start-up against torchrun, output throughput against a bare pipe.

    python benchmarks/launcher_speed.py startup [--runs 10] [--json out.json]
    python benchmarks/launcher_speed.py output [--mib 512] [--line 100] [--runs 5] [--json out.json]

``startup`` times whole commands from start to exit, as a user waits for them:

* ``pslaunch -n 4 -s 1 python trivial.py``: 4 workers, the smallest ``-s`` (1 server) and the
  scheduler, all on this machine (the local backend); the job ends when every worker exited 0;
* ``torchrun --standalone --nproc-per-node 4 trivial.py``: 4 workers under torch.distributed's
  elastic agent (``python -m torch.distributed.run``, the ``torchrun`` command). Needs torch
  (``pip install -e '.[torch]'``).

``output``: a worker writes ``--mib`` MiB of ``--line``-byte lines to its stdout as fast as it can
(blocks of about 1 MiB of whole lines) and records how long its writes took: a writer goes only as
fast as its pipe is read, so that is the rate the output path sustains.

* ``pslaunch -n 1 -s 1 python chatty.py``: pslaunch reads the worker's pipe, prefixes every line
  (``[worker.0@localhost] ...``) and writes them to its own stdout, a pipe this script drains;
* ``pipe``: the same worker writing straight into such a pipe: the ceiling, no launcher between.

The two commands of a measure run in turn (A B A B ...) so that both see the same machine load;
the ratio is the median of the per-pair ratios pslaunch / baseline. Standalone: imports nothing
from benchmarks/.
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
from typing import Callable

REPO = Path(__file__).resolve().parent.parent

_CHATTY = """\
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


def _run(argv: list[str], env: dict[str, str], timeout: float) -> float:
    """Run ``argv`` with both outputs drained; returns its wall seconds. Raises RuntimeError on failure."""
    start = time.perf_counter()
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
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}")
    return seconds


def _pairs(measures: dict[str, Callable[[], float]], runs: int, warmup: int) -> dict[str, list[float]]:
    """Run each measure in turn, ``warmup`` + ``runs`` times; the figures of the counted runs."""
    figures: dict[str, list[float]] = {name: [] for name in measures}
    for i in range(warmup + runs):
        pair = {name: measure() for name, measure in measures.items()}
        if i >= warmup:
            for name, value in pair.items():
                figures[name].append(value)
    return figures


def _report(title: str, unit: str, figures: dict[str, list[float]], labels: dict[str, str], json_path: str | None) -> None:
    (a, b), load = list(figures), os.getloadavg()
    ratios = [x / y for x, y in zip(figures[a], figures[b])]
    print(f"{title}, {len(ratios)} pairs (median; min-max), {os.cpu_count()} cores, load {load[0]:.1f}")
    for name, values in figures.items():
        print(f"  {name:9s} {statistics.median(values):9.2f} {unit}   ({min(values):.2f}-{max(values):.2f})   {labels[name]}")
    print(f"  ratio {a} / {b}: {statistics.median(ratios):.2f} (median of per-pair ratios; "
          f"{min(ratios):.2f}-{max(ratios):.2f})")
    if json_path:
        report = {"what": title, "unit": unit, "commands": labels, "figures": figures,
                  "median": {name: statistics.median(v) for name, v in figures.items()},
                  f"ratio_{a}_over_{b}": statistics.median(ratios), "per_pair_ratios": ratios,
                  "cores": os.cpu_count(), "loadavg_end": load}
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")


def startup(args, env: dict[str, str], tmp: Path) -> None:
    """pslaunch -n 4 -s 1 against torchrun --nproc-per-node 4, whole-command seconds."""
    trivial = tmp / "trivial.py"
    trivial.write_text("")
    commands = {
        "pslaunch": [sys.executable, "-m", "launcher.cli", "-n", "4", "-s", "1", "python", str(trivial)],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                     str(trivial)],
    }
    figures = _pairs({name: (lambda cmd=cmd: _run(cmd, env, args.timeout)) for name, cmd in commands.items()},
                     args.runs, args.warmup)
    _report("start-up overhead, 4 trivial processes, start to exit", "s", figures,
            {"pslaunch": "pslaunch -n 4 -s 1 python trivial.py",
             "torchrun": "torchrun --standalone --nproc-per-node 4 trivial.py"}, args.json)


def output(args, env: dict[str, str], tmp: Path) -> None:
    """One chatty worker through pslaunch against the same worker into a bare pipe, MB/s."""
    worker, result = tmp / "chatty.py", tmp / "rate"
    worker.write_text(_CHATTY)
    worker_args = [str(worker), str(args.mib), str(args.line), str(result)]
    commands = {
        "pslaunch": [sys.executable, "-m", "launcher.cli", "-n", "1", "-s", "1", "python", *worker_args],
        "pipe": [sys.executable, *worker_args],
    }

    def rate(cmd: list[str]) -> float:
        result.unlink(missing_ok=True)
        _run(cmd, env, args.timeout)
        sent, seconds = result.read_text().split()
        return int(sent) / float(seconds) / 1e6

    figures = _pairs({name: (lambda cmd=cmd: rate(cmd)) for name, cmd in commands.items()}, args.runs, args.warmup)
    _report(f"output throughput, one worker writing {args.mib} MiB of {args.line}-byte lines", "MB/s", figures,
            {"pslaunch": "pslaunch -n 1 -s 1 python chatty.py", "pipe": "python chatty.py | (drained)"}, args.json)


def main(argv: list[str] | None = None) -> int:
    """Run one measure (see the module docstring); returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measure", choices=["startup", "output"])
    parser.add_argument("--runs", type=int, default=None, help="pairs of runs (default: startup 10, output 5)")
    parser.add_argument("--warmup", type=int, default=1, help="pairs run first and not counted (default 1)")
    parser.add_argument("--mib", type=int, default=512, help="output: MiB the worker writes per run (default 512)")
    parser.add_argument("--line", type=int, default=100, help="output: bytes per line, newline included (default 100)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one command may take (default 300)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.runs is None:
        args.runs = 10 if args.measure == "startup" else 5
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="pslaunch-speed-") as tmp:
        (startup if args.measure == "startup" else output)(args, env, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
