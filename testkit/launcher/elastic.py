"""What the elastic tests read back: the ``steps.*.txt`` lines of ``tests/launcher/helpers/elastic_join.py``
(``rank step num_workers value0 value1``), and the check that every step's values are the sum over the
workers that took part in it (each round sums exactly its members, counted right by each of them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

__all__ = ["records", "check_exact", "lines", "wait_for"]


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
    """Every line the workers of ``rank`` wrote (one file per process: a rank a joiner took again has two)."""
    return [line for path in sorted(out.glob(f"steps.{rank}.*.txt")) for line in path.read_text().splitlines()]


def wait_for(predicate: Callable[[], object], timeout: float = 30.0) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
