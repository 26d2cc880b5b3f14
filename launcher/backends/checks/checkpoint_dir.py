"""Can every server reach ``--checkpoint-dir``? Checked before any process starts.

The servers write the checkpoints (``kvcore.elastic.State.commit``) and read them back after a
restart, possibly on other hosts than before, so the directory must be one directory for all of
them: shared storage, or a local path when every server runs on one host. Each server host (this
machine for the servers pslaunch starts here) must be able to create and write the directory; when
the servers run on more than one host, a file written there from the first host must be seen, with
its contents, from every other host.

The backends call ``check_checkpoint_dir`` from their ``prepare`` with the ssh connections of their
pre-flight check. A problem is a ``ConfigError`` (exit code 2) with one line per host naming it.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
from typing import Callable

from ...errors import ConfigError
from ...planning.plan import Plan

__all__ = ["check_checkpoint_dir"]

_PROBE = ".pslaunch-probe-{job}-{token}"


def check_checkpoint_dir(plan: Plan, directory: str | None, clients: dict, timeout: float) -> None:
    """Check that every server of ``plan`` reaches ``directory`` (nothing to do without one).

    ``clients`` maps each remote ``Host`` of the plan to a connected ``paramiko.SSHClient``; servers
    that run on this machine (``on_launcher``, or an mpi rank on ``localhost``) are checked here.

    Raises:
        ConfigError: a server host cannot create or write it, or the hosts do not share it.
    """
    if not directory:
        return
    places: dict[str, Callable[[str], int]] = {}
    for spec in plan.by_role("server"):
        here = spec.on_launcher or spec.host.name == "localhost"
        label = "this machine" if here else spec.host.label
        if label in places:
            continue
        places[label] = _run_here(timeout) if here else _run_there(clients, spec.host, timeout)
    quoted = shlex.quote(directory)
    problems = []
    for label, run in places.items():
        # mkdir -p and a test write: the servers create files there
        probe = shlex.quote(os.path.join(directory, _PROBE.format(job="w", token=secrets.token_hex(4))))
        if run(f"mkdir -p {quoted} && test -d {quoted} && : > {probe} && rm -f {probe}") != 0:
            problems.append(f"{label}: cannot create or write {directory}")
    if not problems and len(places) > 1:
        token = secrets.token_hex(8)
        path = os.path.join(directory, _PROBE.format(job=plan.job_id.replace("/", "_"), token=token))
        first, *others = places.items()
        if first[1](f"printf %s {token} > {shlex.quote(path)}") != 0:
            problems.append(f"{first[0]}: cannot write {path}")
        else:
            for label, run in others:
                if run(f'test "$(cat {shlex.quote(path)} 2>/dev/null)" = {token}') != 0:
                    problems.append(f"{label}: does not see the file {first[0]} wrote in {directory}, so the "
                                    "servers' hosts do not share it")
            first[1](f"rm -f {shlex.quote(path)}")
    if problems:
        raise ConfigError("--checkpoint-dir must be one directory every server reaches (shared storage, or a local "
                          "path when the servers run on one host):\n  " + "\n  ".join(problems) + "\nnothing was started")


def _run_here(timeout: float) -> Callable[[str], int]:
    def run(command: str) -> int:
        try:
            return subprocess.run(["sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124

    return run


def _run_there(clients: dict, host, timeout: float) -> Callable[[str], int]:
    from ..ssh.connection import run_remote

    def run(command: str) -> int:
        client = clients.get(host)
        if client is None:
            return 255
        try:
            return run_remote(client, command, timeout)
        except Exception:  # the connection broke: the host cannot be checked, so it fails
            return 255

    return run
