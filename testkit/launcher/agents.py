"""Jobs of per-node agents for the tests: the same pslaunch command once per node, each in its own
process group, on loopback or inside a network namespace per node (``prefix``).

    with AgentJob(tmp_path, nnodes=3, endpoint="127.0.0.1:29400", args=["-n", "3", "train.py"]) as job:
        job.start_all(order=[2, 1, 0])
        results = job.wait(60)                      # {rank: Result}
        job.output(1)                               # what node 1's pslaunch printed so far

Output goes to files (``node<R>.out`` / ``node<R>.err``), never to pipes that a silent reader
would let fill. ``close`` (also on an exception) kills every agent's process group and every
process still carrying ``marker``, so a failing test leaves nothing behind.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

from .processes import PSLAUNCH, REPO, Result, processes_with

__all__ = ["AgentJob", "Pods", "write_key"]


def write_key(path: Path) -> Path:
    """A fresh job key in ``path`` (64 hex digits, mode 0600), as a Kubernetes Secret would mount it."""
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


class Pods:
    """The hosts of a ``testkit.netns.NetnsCluster`` as the pods ``train-0``... of a Kubernetes
    Indexed Job named ``train`` behind the headless Service ``pslaunch``: each namespace resolves
    ``train-R.pslaunch`` through a hosts file of its own (``ip netns exec`` mounts
    ``/etc/netns/NAME/hosts`` over ``/etc/hosts``), removed by ``close``."""

    def __init__(self, net, port: int = 29400) -> None:
        self.net = net
        self.port = port
        self.names = {rank: f"train-{rank}.pslaunch" for rank in range(len(net.hosts))}
        self.hosts = {rank: f"h{rank + 1}" for rank in range(len(net.hosts))}
        self._etc = []
        lines = ["127.0.0.1 localhost"] + [f"{net.address(self.hosts[r])} {name} train-{r}"
                                            for r, name in self.names.items()]
        for host in self.hosts.values():
            folder = Path("/etc/netns") / net.namespace(host)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")
            self._etc.append(folder)

    def prefix(self, rank: int) -> list[str]:
        """argv that runs a command inside pod ``rank``."""
        return self.net.run_in(self.hosts[rank], [])

    @property
    def endpoint(self) -> str:
        return f"{self.names[0]}:{self.port}"

    def close(self) -> None:
        for folder in self._etc:
            shutil.rmtree(folder, ignore_errors=True)


class AgentJob:
    """One pslaunch agent per node; see the module docstring."""

    def __init__(self, d: Path, nnodes: int, endpoint: str, args: Sequence[str], env: dict | None = None,
                 prefix: Callable[[int], list[str]] | None = None, marker: str | None = None) -> None:
        self.d = d
        self.nnodes = nnodes
        self.endpoint = endpoint
        self.args = list(args)
        self.env = dict(os.environ if env is None else env)
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.prefix = prefix or (lambda rank: [])
        self.marker = marker
        self.procs: dict[int, subprocess.Popen] = {}
        self.started: dict[int, float] = {}

    def argv(self, rank: int, extra: Sequence[str] = ()) -> list[str]:
        """Node ``rank``'s command line (``extra`` options first)."""
        return [*self.prefix(rank), *PSLAUNCH, "--nnodes", str(self.nnodes), "--node-rank", str(rank),
                "--rdzv-endpoint", self.endpoint, *extra, *self.args]

    def start(self, rank: int, extra: Sequence[str] = (), env: dict | None = None,
              argv: Sequence[str] | None = None) -> subprocess.Popen:
        """Start node ``rank``'s agent (``argv`` in place of the usual command line when given)."""
        full_env = dict(self.env)
        full_env.update(env or {})
        with open(self.d / f"node{rank}.out", "wb") as out, open(self.d / f"node{rank}.err", "wb") as err:
            proc = subprocess.Popen(list(argv) if argv is not None else self.argv(rank, extra), stdout=out, stderr=err,
                                    env=full_env, start_new_session=True, cwd=str(REPO))
        self.procs[rank] = proc
        self.started[rank] = time.monotonic()
        return proc

    def start_all(self, order: Sequence[int] | None = None, pause: float = 0.0) -> None:
        """Start every node's agent, in ``order`` (default 0, 1, ...), ``pause`` seconds apart."""
        for i, rank in enumerate(order if order is not None else range(self.nnodes)):
            if i and pause:
                time.sleep(pause)
            self.start(rank)

    def output(self, rank: int) -> str:
        """What node ``rank``'s pslaunch wrote so far, stdout then stderr."""
        return "".join((self.d / f"node{rank}.{s}").read_text(errors="replace") for s in ("out", "err")
                       if (self.d / f"node{rank}.{s}").exists())

    def wait_for(self, rank: int, text: str, timeout: float) -> None:
        """Wait until node ``rank``'s output holds ``text``; fail naming what every node printed."""
        deadline = time.monotonic() + timeout
        while text not in self.output(rank):
            if time.monotonic() > deadline:
                raise AssertionError(f"node {rank} did not print {text!r} within {timeout} s:\n{self.report()}")
            time.sleep(0.05)

    def wait(self, timeout: float, ranks: Sequence[int] | None = None) -> dict[int, Result]:
        """Wait until the agents ``ranks`` (default: all started) exit; their results. Fails (after
        killing them) when one runs past ``timeout``."""
        deadline = time.monotonic() + timeout
        chosen = list(self.procs) if ranks is None else list(ranks)
        for rank in chosen:
            try:
                self.procs[rank].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.close()
                raise AssertionError(f"node {rank}'s agent did not end within {timeout} s:\n{self.report()}") from None
        return {rank: Result(self.procs[rank].returncode, (self.d / f"node{rank}.out").read_text(errors="replace"),
                             (self.d / f"node{rank}.err").read_text(errors="replace")) for rank in chosen}

    def report(self) -> str:
        """Every node's output, for an assertion's message."""
        return "\n".join(f"--- node {r} (exit {p.poll()}):\n{self.output(r)}" for r, p in sorted(self.procs.items()))

    def signal(self, rank: int, signum: int) -> None:
        """Send ``signum`` to node ``rank``'s pslaunch alone (not its group)."""
        os.kill(self.procs[rank].pid, signum)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        if self.marker:
            for line in processes_with(self.marker):
                try:
                    os.kill(int(line.split(":")[0]), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def __enter__(self) -> "AgentJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
