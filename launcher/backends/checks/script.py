"""Is COMMAND's script there? Checked before any process starts, so a typo costs no started job.

``ProcessSpec.script`` is the file COMMAND runs when pslaunch can tell (``train.py``, ``python
train.py``; see ``launcher.planning.plan.script_of``). On this machine it is looked up relative to the
process's working directory; on remote hosts, over the pre-flight check's ssh connections, in the
directory the guard will start the process in (after ``--sync-dst-dir`` copied the code there).
A missing script is a ``ConfigError`` (exit code 2) naming the file, the directory and the host.
"""

from __future__ import annotations

import os
import shlex

from ...errors import ConfigError
from ...planning.plan import ProcessSpec

__all__ = ["check_scripts_here", "check_scripts_remote"]


def check_scripts_here(specs: list[ProcessSpec], cwd: str | None) -> None:
    """Raise ``ConfigError`` when the script of a process in ``specs`` is not a file here.

    ``cwd`` is pslaunch's working directory, where processes without their own ``cwd`` start.
    """
    problems: dict[str, str] = {}
    for spec in specs:
        if not spec.script:
            continue
        base = spec.cwd or cwd or os.getcwd()
        path = os.path.join(base, spec.script)
        if not os.path.isfile(path) and path not in problems:
            problems[path] = f"{spec.script!r} is not a file in {base} (the script of {spec.name})"
    _raise(list(problems.values()))


def check_scripts_remote(specs: list[ProcessSpec], clients: dict, timeout: float) -> None:
    """Check the scripts of ``specs`` on their hosts through ``clients`` (``{Host: SSHClient}``).

    Raises ``ConfigError`` with one line per missing script and host.
    """
    from ..ssh.connection import run_remote

    wanted: dict = {}
    for spec in specs:
        if spec.script and spec.host in clients:
            wanted.setdefault(spec.host, {}).setdefault((spec.cwd or "", spec.script), spec)
    problems = []
    for host, items in wanted.items():
        for (cwd, script), spec in items.items():
            # Where the guard runs it: the directory, or the home directory when that is missing.
            command = f"{{ cd {shlex.quote(cwd)} 2>/dev/null || cd; }} && test -f {shlex.quote(script)}" if cwd \
                else f"test -f {shlex.quote(script)}"
            if run_remote(clients[host], command, timeout) != 0:
                where = f"{cwd} on {host.label}" if cwd else f"the home directory on {host.label}"
                problems.append(f"{script!r} is not a file in {where} (the script of {spec.name})")
    _raise(problems)


def _raise(problems: list[str]) -> None:
    if len(problems) == 1:
        raise ConfigError(f"COMMAND's script is missing: {problems[0]}; nothing was started")
    if problems:
        raise ConfigError("COMMAND's script is missing:\n  " + "\n  ".join(problems) + "\nnothing was started")
