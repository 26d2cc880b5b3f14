"""What a finished job left for a test to read: the weights worker 0 saved (``saved_weights``,
``same_weights``), the rows of pslaunch's summary table (``table_rows``), and whether it ended as an
uninterrupted run does (``ended_like``)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .processes import wait_gone

__all__ = ["saved_weights", "same_weights", "table_rows", "ended_like"]

_ROW = re.compile(r"^\| (worker|server|scheduler|replica) +\| +(\d) \| [^|]+\| +(\d+) \| (\S+(?: \S+)?) +\| +[\d.]+s \| "
                  r"(.*?) *\|$", re.M)


def saved_weights(out: Path) -> dict[str, np.ndarray]:
    """The arrays of ``out/weights.npz`` by name."""
    with np.load(out / "weights.npz") as data:
        return {k: data[k].copy() for k in data.files}


def same_weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """Whether two sets of weights are equal, bit for bit."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def table_rows(stderr: str) -> list[tuple[str, str, str, str, str]]:
    """The summary table's ``(role, rank, pid, exit, note)`` rows, in order."""
    return _ROW.findall(stderr)


def ended_like(returncode: int, stderr: str, out: Path, reference: dict[str, np.ndarray]) -> None:
    """Assert that the job writing to ``out`` left nothing running, exited 0 and saved the ``reference``
    weights (an uninterrupted run's), bit for bit."""
    assert not wait_gone(str(out)), f"processes of the job in {out} outlived it"
    assert returncode == 0, stderr
    assert same_weights(saved_weights(out), reference), "the weights differ from the uninterrupted run's"
