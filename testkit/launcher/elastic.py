"""What the elastic tests read back: the ``steps.*.txt`` lines of ``tests/launcher/helpers/elastic_join.py``
(``rank step num_workers value0 value1``), and the check that every step's values are the sum over the
workers that took part in it (each round sums exactly its members, counted right by each of them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from testkit import free_port, reap
from testkit.launcher.processes import REPO

__all__ = ["records", "check_exact", "lines", "wait_for", "ByHandJob"]


class ByHandJob:
    """A job started by hand with the ``DMLC_*`` variables: every process runs ``script OUT`` (the
    scheduler and servers too, as a kvcore script does) with its output in ``OUT/NAME.log``; a
    worker started later joins an elastic job. As a context manager it reaps every process."""

    def __init__(self, script: str, out: Path, **variables: str) -> None:
        self.script, self.out = script, out
        self.procs: list[subprocess.Popen] = []
        base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLAUNCH_"))}
        self.env = {**base, "PYTHONPATH": str(REPO), "DMLC_PS_ROOT_URI": "127.0.0.1",
                    "DMLC_PS_ROOT_PORT": str(free_port()), **variables}

    def start(self, name: str, role: str, **extra: str) -> subprocess.Popen:
        """Start one process of ``role`` (``extra``: more variables for it alone)."""
        with open(self.out / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, self.script, str(self.out)],
                                    env={**self.env, "DMLC_ROLE": role, **extra}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def logs(self) -> dict[str, str]:
        """Every process's output by name, for an assertion's message."""
        return {p.stem: p.read_text() for p in self.out.glob("*.log")}

    def __enter__(self) -> "ByHandJob":
        return self

    def __exit__(self, *exc: object) -> None:
        reap(self.procs)


def records(out: Path) -> dict[int, dict[int, tuple[int, float, float]]]:
    """Per step, each worker's ``rank -> (num_workers, value0, value1)``."""
    steps: dict[int, dict[int, tuple[int, float, float]]] = {}
    for path in out.glob("steps.*.txt"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                steps.setdefault(int(parts[1]), {})[int(parts[0])] = (int(parts[2]), float(parts[3]), float(parts[4]))
    return steps


def check_exact(steps: dict[int, dict[int, tuple[int, float, float]]], count: int) -> list[frozenset[int]]:
    """Assert that steps 0..count-1 each sum (rank + 1) * (step + 1) over the workers that took part, as
    every one of them saw it and counted them; returns the members of each step."""
    assert sorted(steps) == list(range(count)), sorted(steps)
    members = []
    for step in range(count):
        seen = steps[step]
        expected = float(sum(rank + 1 for rank in seen) * (step + 1))
        assert all(v == (len(seen), expected, expected) for v in seen.values()), (step, seen)
        members.append(frozenset(seen))
    return members


def lines(out: Path, rank: int) -> list[str]:
    """Every line the workers of ``rank`` wrote, in the order its processes held it (one file per
    process: a rank a joiner took again has two; one process holds a rank at a time, so the files
    are in the order they were last written, not of their pids, which need not grow)."""
    paths = sorted(out.glob(f"steps.{rank}.*.txt"), key=lambda path: path.stat().st_mtime_ns)
    return [line for path in paths for line in path.read_text().splitlines()]


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, explain: Callable[[], str] | None = None) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds (saying ``explain()``)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {explain()}" if explain else "timed out"
        time.sleep(0.05)
