"""How a test runs pslaunch on a given backend: the flags, environment and working directory.

``backend_launch("ssh" | "slurm" | "sge" | "local" | "mpi", request, tmp_path)`` asks pytest for
what the backend needs (the ``sshd`` fixture and two loopback hosts; the session's Slurm or SGE
cluster, whose clients need its environment, and whose jobs run in ``tmp_path``), so that one test
can be parametrized over every backend.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from .processes import REPO, Result, run_pslaunch, start_pslaunch

__all__ = ["Launch", "backend_launch", "BATCH_BACKENDS"]

BATCH_BACKENDS = ("slurm", "sge")


@dataclass(frozen=True)
class Launch:
    """pslaunch's flags for one backend, and the environment and directory to run it in."""

    args: tuple[str, ...]
    env: dict[str, str] | None = None
    cwd: str | None = None

    def run(self, args: list[str], timeout: float = 60) -> Result:
        """``run_pslaunch`` with this backend's environment and directory."""
        return run_pslaunch(args, timeout=timeout, cwd=self.cwd, env=self.env)

    def start(self, args: list[str]) -> subprocess.Popen:
        """``start_pslaunch`` with this backend's environment and directory."""
        return start_pslaunch(args, cwd=self.cwd, env=self.env)


def backend_launch(backend: str, request, tmp_path: Path) -> Launch:
    """How to run pslaunch on ``backend`` in the test ``request`` (fixtures it needs come from it)."""
    if backend == "ssh":
        sshd = request.getfixturevalue("sshd")
        hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2", "127.0.0.3"])
        # the remote login shell's PYTHONPATH lacks this checkout (the runtime, the helpers' imports)
        return Launch(("-H", hosts, *sshd.ssh_flags(), "--env", f"PYTHONPATH:{REPO}"))
    if backend in BATCH_BACKENDS:
        cluster = request.getfixturevalue(backend)
        return Launch(("--launcher", backend), cluster.client_env(), str(tmp_path))
    return Launch(("--launcher", backend))
