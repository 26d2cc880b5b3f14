"""Stopping what a test or a benchmark started: the launcher's one TERM, grace, KILL sequence."""

from __future__ import annotations

import signal
import subprocess
from typing import Sequence

from launcher.on_node import process_groups

__all__ = ["reap", "signal_group"]


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to ``popen``'s process group (its own: started with ``start_new_session``); a
    group already gone is no error. Once its leader was reaped the id names the group only while
    members remain: a live process with the leader's pid is then a stranger that took the number (on
    a busy machine, another test's), and gets nothing."""
    if popen.returncode is not None and process_groups.leader_start(popen.pid) is not None:
        return
    process_groups.signal_group(popen.pid, sig)


def reap(popens: Sequence[subprocess.Popen], grace: float = 2.0, term: bool = True) -> None:
    """Stop every process group still running: SIGTERM (unless ``term`` is False: they were asked to
    end already), up to ``grace`` seconds for all of them together, then SIGKILL; wait for every
    leader. A group whose leader ended is killed too, so nothing it spawned lingers. The sequence is
    the launcher's own (``launcher.on_node.process_groups.stop``)."""
    running = [popen for popen in popens if popen.poll() is None]
    process_groups.stop(popens, terminate=lambda p: term and p in running and signal_group(p, signal.SIGTERM),
                        kill=lambda p: signal_group(p, signal.SIGKILL), alive=lambda p: p.poll() is None, grace=grace)
    for popen in popens:
        if popen.poll() is None:
            popen.wait()
