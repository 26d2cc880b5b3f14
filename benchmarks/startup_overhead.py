"""Start-up overhead: pslaunch against torchrun for 4 trivial processes, measured in the same run.

    python benchmarks/startup_overhead.py [--runs 10] [--json out.json]

Each run times one whole command from start to exit, as a user would wait for it:

* ``pslaunch -n 4 -s 1 python trivial.py``: 4 workers, the smallest ``-s`` (1 server) and the
  scheduler, all on this machine (the local backend); the job ends when every worker exited 0;
* ``torchrun --standalone --nproc-per-node 4 trivial.py``: 4 workers under torch.distributed's
  elastic agent (``python -m torch.distributed.run``, the same as the ``torchrun`` command).

``trivial.py`` is an empty script. The two commands run in turn (A B A B ...) so that both see the
same machine load, and the ratio is the median of the per-pair ratios pslaunch / torchrun (below 1:
pslaunch starts and ends the job faster). Needs torch (``pip install -e '.[torch]'``). Standalone:
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_SHOWN = {"pslaunch": "pslaunch -n 4 -s 1 python trivial.py",
          "torchrun": "torchrun --standalone --nproc-per-node 4 trivial.py"}


def _timed(argv: list[str], env: dict[str, str], timeout: float) -> float:
    """Seconds from start to exit of ``argv``; raises RuntimeError when it fails."""
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, timeout=timeout)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}: " + " / ".join(tail))
    return seconds


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; print the table (and write JSON with ``--json``). Returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="pairs of runs (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="pairs run first and not counted (default 1)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds one command may take (default 120)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="pslaunch-startup-") as tmp:
        trivial = Path(tmp) / "trivial.py"
        trivial.write_text("")
        commands = {
            "pslaunch": [sys.executable, "-m", "launcher.cli", "-n", "4", "-s", "1", "python", str(trivial)],
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                         str(trivial)],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for i in range(args.warmup + args.runs):
            pair = {name: _timed(cmd, env, args.timeout) for name, cmd in commands.items()}
            if i >= args.warmup:
                for name, seconds in pair.items():
                    times[name].append(seconds)
    ratios = [p / t for p, t in zip(times["pslaunch"], times["torchrun"])]
    load = os.getloadavg()
    report = {
        "what": "whole-command seconds, 4 trivial workers (pslaunch: -n 4 -s 1, local backend)",
        "runs": args.runs,
        "median_seconds": {name: statistics.median(values) for name, values in times.items()},
        "seconds": times,
        "ratio_pslaunch_over_torchrun": statistics.median(ratios),
        "per_pair_ratios": ratios,
        "cores": os.cpu_count(),
        "loadavg_end": load,
    }
    print(f"start-up overhead, {args.runs} pairs (median of each; min-max), {os.cpu_count()} cores, "
          f"load {load[0]:.1f}")
    for name, values in times.items():
        print(f"  {name:9s} {statistics.median(values):6.2f} s   ({min(values):.2f}-{max(values):.2f})   {_SHOWN[name]}")
    print(f"  ratio pslaunch / torchrun: {report['ratio_pslaunch_over_torchrun']:.2f} "
          f"(median of per-pair ratios; {min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
