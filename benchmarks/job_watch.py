"""A pslaunch job run as a benchmark, watched from ``/proc``: each process's peak RSS by role.

``watch_job(argv, env, job_id, role_of)`` starts pslaunch and samples every 0.2 s, until it ends,
the processes of the job (those whose ``PSLAUNCH_JOB_ID`` is ``job_id``, so another job on a busy
machine is never counted): each one's peak RSS (``VmHWM``) and the heavy libraries it mapped, and
pslaunch's own CPU seconds and peak RSS. ``role_of(cmdline)`` names a process's role, or None.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["JobWatch", "watch_job", "psnode_role", "cpu_seconds", "context_switches"]

#: Libraries a process may load whose cost a server must not pay (what they map, by path piece).
_HEAVY = {"torch": "/torch/", "sklearn": "/sklearn/", "scipy": "/scipy/", "numpy": "/numpy/", "cupy": "/cupy"}


@dataclass
class JobWatch:
    """What ``watch_job`` saw: pslaunch's outcome and the job's processes' peaks."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    peaks_kib: dict[int, tuple[str, int]] = field(default_factory=dict)  # pid -> (role, peak RSS)
    libraries: dict[int, tuple[str, frozenset]] = field(default_factory=dict)  # pid -> (role, heavy libraries)
    launcher_cpu_s: float = 0.0
    launcher_rss_kib: int = 0

    def rss_mib(self) -> dict[str, dict]:
        """Per role: the largest and the median peak RSS in MiB, and how many processes were seen."""
        roles: dict[str, list[int]] = {}
        for role, kib in self.peaks_kib.values():
            roles.setdefault(role, []).append(kib)
        return {role: {"max": max(v) / 1024, "median": statistics.median(v) / 1024, "seen": len(v)}
                for role, v in roles.items()}

    def libraries_by_role(self) -> dict[str, list[str]]:
        found: dict[str, set] = {}
        for role, names in self.libraries.values():
            found.setdefault(role, set()).update(names)
        return {role: sorted(names) for role, names in found.items()}


def psnode_role(worker_marker: str) -> Callable[[str], str | None]:
    """A ``role_of`` for jobs whose workers' command lines hold ``worker_marker`` (their script)."""
    def role_of(cmd: str) -> str | None:
        if worker_marker in cmd:
            return "worker"
        return "server" if "psnode server" in cmd else "scheduler" if "psnode scheduler" in cmd else None
    return role_of


def watch_job(argv: list[str], env: dict[str, str], job_id: str, role_of: Callable[[str], str | None],
              timeout: float = 1200) -> JobWatch:
    """Run pslaunch ``argv`` and watch its job (see the module docstring)."""
    watch = JobWatch(0, "", "", 0.0)
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def sample() -> None:
        looks = 0
        while not done.is_set():
            status = _status(proc.pid)
            if status:
                watch.launcher_rss_kib = max(watch.launcher_rss_kib, _kib(status))
                watch.launcher_cpu_s = max(watch.launcher_cpu_s, cpu_seconds(proc.pid))
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) == proc.pid:
                    continue
                pid = int(entry)
                role = role_of(_cmdline(pid))
                if role is None or not _of_job(pid, job_id):  # another job's, on a busy machine
                    continue
                watch.peaks_kib[pid] = (role, max(_kib(_status(pid)), watch.peaks_kib.get(pid, (role, 0))[1]))
                if looks % 5 == 0 or pid not in watch.libraries:  # what it mapped so far (it imports as it goes)
                    seen = watch.libraries.get(pid, (role, frozenset()))[1]
                    watch.libraries[pid] = (role, seen | _heavy_libraries(pid))
            looks += 1
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        watch.stdout, watch.stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        watch.wall_s = time.monotonic() - start
        done.set()
        sampler.join()
    watch.returncode = proc.returncode
    return watch


def _kib(status: dict[str, str]) -> int:
    return int(status.get("VmHWM", "0 kB").split()[0] or 0)


def _status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)
    except OSError:
        return {}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _of_job(pid: int, job_id: str) -> bool:
    """Whether process ``pid`` belongs to job ``job_id`` (its ``PSLAUNCH_JOB_ID``)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return f"PSLAUNCH_JOB_ID={job_id}".encode() in fh.read().split(b"\0")
    except OSError:
        return False


def cpu_seconds(pid: int | str) -> float:
    """CPU seconds (user and system) process ``pid`` has used: /proc counts clock ticks; 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def context_switches(pid: int | str) -> int:
    """Context switches (voluntary and not) of every thread of process ``pid`` so far, from
    ``/proc/PID/task/*/status``: how often its threads slept and woke; 0 once it is gone. Threads that
    already ended are not counted."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/status") as fh:
                total += sum(int(line.split()[-1]) for line in fh if "ctxt_switches:" in line)
        except (OSError, ValueError):
            continue
    return total


def _heavy_libraries(pid: int) -> frozenset:
    """Which of ``_HEAVY`` process ``pid`` has mapped (read from ``/proc/PID/maps``)."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            maps = fh.read()
    except OSError:
        return frozenset()
    return frozenset(name for name, piece in _HEAVY.items() if piece in maps)
