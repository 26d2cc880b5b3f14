"""Stopping what a test or a benchmark started: the one TERM, grace, KILL sequence of the kits."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Sequence

__all__ = ["reap", "signal_group"]


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to ``popen``'s process group (its own: started with ``start_new_session``); a
    group already gone is no error."""
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap(popens: Sequence[subprocess.Popen], grace: float = 2.0, term: bool = True) -> None:
    """Stop every process group still running: SIGTERM (unless ``term`` is False: they were asked to
    end already), up to ``grace`` seconds for all of them together, then SIGKILL; wait for every
    leader. A group whose leader ended is killed too, so nothing it spawned lingers."""
    if term:
        for popen in popens:
            if popen.poll() is None:
                signal_group(popen, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for popen in popens:
        try:
            popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for popen in popens:
        signal_group(popen, signal.SIGKILL)
        if popen.poll() is None:
            popen.wait()
