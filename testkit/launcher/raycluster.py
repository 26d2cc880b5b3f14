"""A real two-node Ray cluster for the tests of ``--launcher ray``: a head in this (the root)
network namespace and a second node inside a namespace of ``testkit.netns``, so that a placement
group spread over two nodes really spans two hosts with addresses of their own.

    with RayCluster(head_cpus=3, node_cpus=3) as ray_cluster:
        ray_cluster.address            # 198.18.N.1:PORT, what `--ray-address` gets
        ray_cluster.node_ip("node")    # 198.18.N.11, the second node's address
        ray_cluster.kill_raylet("node")  # the second node leaves the cluster
        ray_cluster.left()             # live actors and placement groups (none once a job is over)

Each node is one ``ray start --block`` in a session of its own: every Ray process of the node
(GCS, raylet, agents, workers, the guards the actors start) is in that session, so ``close`` stops
them all by pid (a job's processes, in sessions of their own, end with their guards) (never ``ray stop``, which would stop every Ray cluster on the machine). Addresses come
from 198.18.0.0/15 only, after ``ip route add unreachable 198.18.0.0/15`` (``testkit.netns``).
Ray's state is read through its GCS (``ray.util.placement_group_table``, the actor table) by a
helper driver that stays connected: the tests start no dashboard. Needs Ray, root and iproute2;
``ray_usable`` says why not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher.on_node.procfs import session_members
from testkit.launcher.processes import cmdline

__all__ = ["RayCluster", "RayClusterError", "ray_usable", "session_members"]

#: Seconds a node has to say it started.
START_TIMEOUT = 60.0
#: GCS settings for the tests: a node whose raylet died is declared dead in about 1.5 s (Ray's
#: defaults take about 15 s), so the lost-node test stays short.
_FAST_HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
                "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "0"}
_STATE_SCRIPT = r"""
import json, os, sys
answers = os.fdopen(os.dup(1), "w")  # the answers' own stream: Ray prints what the cluster reports to stdout
os.dup2(2, 1)
sys.stdout = sys.stderr
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
from ray._private.state import state
for line in sys.stdin:
    if line.strip() == "nodes":
        answer = {"nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])}
    else:
        pgs = ray.util.placement_group_table()
        actors = state.actor_table(None)
        answer = {
            "placement_groups": [p["placement_group_id"] for p in pgs.values() if p["state"] != "REMOVED"],
            "actors": [f"{a['ActorClassName']} {a['State']} on {a['Address']['IPAddress']}" for a in actors.values()
                       if a["State"] != "DEAD"],
        }
    print(json.dumps(answer), file=answers, flush=True)
"""


class RayClusterError(RuntimeError):
    """The cluster could not be started; the message names the node and what it said."""


def ray_usable() -> str | None:
    """None when Ray can run here (installed, root for the namespaces); otherwise why not."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed: pip install 'pslaunch[ray]' (scripts/test.sh installs it)"
    from testkit.netns import usable

    return usable()


class RayCluster:
    """A head and one more node (``node``, in a network namespace); see the module docstring."""

    def __init__(self, head_cpus: int = 3, node_cpus: int = 3) -> None:
        self.head_cpus = head_cpus
        self.node_cpus = node_cpus
        self.net = None
        self.port = 0
        self._tmp = ""
        self._nodes: dict[str, subprocess.Popen] = {}
        self._ips: dict[str, str] = {}
        self._logs: dict[str, Path] = {}
        self._reader: subprocess.Popen | None = None  # a driver that reads Ray's state for the tests

    # -- where -----------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The head's GCS address, ``IP:PORT``."""
        return f"{self._ips['head']}:{self.port}"

    def node_ip(self, node: str) -> str:
        """The address of ``head`` or ``node``."""
        return self._ips[node]

    def files_holding(self, text: bytes) -> list[str]:
        """Files of the nodes' Ray directories (logs, session state, unpacked working directories)
        holding ``text``."""
        found = []
        for folder, _, names in os.walk(self._tmp):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    with open(path, "rb") as fh:
                        if text in fh.read():
                            found.append(path)
                except OSError:
                    continue  # a socket, a file gone meanwhile
        return found

    def driver_env(self, base: dict | None = None) -> dict:
        """An environment for a driver on the head's host (pslaunch): Ray finds this host's node
        by the head's address, not by the machine's default route."""
        env = dict(os.environ if base is None else base)
        env["RAY_ADDRESS"] = self.address
        env.pop("RAY_NODE_IP_ADDRESS", None)
        return env

    # -- life cycle --------------------------------------------------------------------------------
    def __enter__(self) -> "RayCluster":
        from testkit.netns import NetnsCluster

        self._tmp = tempfile.mkdtemp(prefix="psray-", dir="/tmp")  # Ray's socket paths must stay short
        try:
            self.net = NetnsCluster(nics=("eth0",)).__enter__()
            self._ips = {"head": self.net.launcher_address, "node": self.net.address("h1")}
            self.port = _free_port(self._ips["head"])
            self._start("head", ["--head", "--port", str(self.port), "--num-cpus", str(self.head_cpus)], [])
            self._wait_for_nodes(1, ray_status=True)
            self._start("node", ["--address", self.address, "--num-cpus", str(self.node_cpus)],
                        self.net.run_in("h1", []))
            self._wait_for_nodes(2)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, node: str, args: list[str], prefix: list[str]) -> None:
        temp = os.path.join(self._tmp, node)
        os.makedirs(temp)
        log = Path(self._tmp) / f"{node}.log"
        self._logs[node] = log
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        argv = [*prefix, ray, "start", "--block", *args, "--node-ip-address", self._ips[node], "--temp-dir", temp,
                "--disable-usage-stats", "--object-store-memory", str(80 * 1024 * 1024),
                "--min-worker-port", "0", "--max-worker-port", "0"]
        if not prefix:  # the head, in this machine's namespace: ports no other Ray cluster here may hold
            argv += ["--include-dashboard=false", "--dashboard-port", str(_free_port("127.0.0.1")),
                     "--ray-client-server-port", str(_free_port(self._ips[node])),
                     "--dashboard-agent-listen-port", str(_free_port(self._ips[node]))]
        env = {**os.environ, **_FAST_HEALTH, "RAY_USAGE_STATS_ENABLED": "0"}
        with open(log, "wb") as out:
            self._nodes[node] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                 start_new_session=True, cwd=self._tmp)

    def _wait_for_nodes(self, count: int, ray_status: bool = False) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            for node, proc in self._nodes.items():
                if proc.poll() is not None:
                    raise RayClusterError(f"ray start of {node} exited {proc.returncode}: "
                                          f"{self._logs[node].read_text(errors='replace')[-2000:]}")
            if (self._alive_nodes() if ray_status else len(self._ask("nodes")["nodes"])) >= count:
                return
            if time.monotonic() > deadline:
                raise RayClusterError(f"{count} Ray node(s) not up after {START_TIMEOUT:g} s")
            time.sleep(0.5)

    def _alive_nodes(self) -> int:
        """How many nodes ``ray status`` lists as active (it reads the GCS: no dashboard needed)."""
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        res = subprocess.run([ray, "status", "--address", self.address], capture_output=True, text=True, timeout=30,
                             env=self.driver_env())
        active = res.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in res.stdout else ""
        return active.count("node_")

    def kill_raylet(self, node: str) -> int:
        """SIGKILL ``node``'s raylet (the node leaves the cluster); returns its pid."""
        for pid in session_members(self._nodes[node].pid):
            if "/raylet" in cmdline(pid).split(" ", 1)[0]:
                os.kill(pid, signal.SIGKILL)
                return pid
        raise RayClusterError(f"no raylet found on {node}")

    def restart_node(self, node: str = "node") -> None:
        """Stop what is left of ``node`` and start it again (after ``kill_raylet``)."""
        self._stop(node)
        shutil.rmtree(os.path.join(self._tmp, node), ignore_errors=True)
        self._start(node, ["--address", self.address, "--num-cpus", str(self.node_cpus)], self.net.run_in("h1", []))
        self._wait_for_nodes(2)

    def left(self) -> dict:
        """``{"placement_groups": [...], "actors": [...]}`` still alive in the cluster."""
        return self._ask("state")

    def _ask(self, what: str) -> dict:
        """The state driver's answer to ``what`` (``state``, ``nodes``); it connects at the first
        question and stays for the cluster's life (a driver takes a second or two to connect)."""
        if self._reader is None or self._reader.poll() is not None:
            with open(Path(self._tmp) / "reader.log", "ab") as log:
                self._reader = subprocess.Popen([sys.executable, "-c", _STATE_SCRIPT, self.address],
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                                env=self.driver_env(), start_new_session=True)
        assert self._reader.stdin is not None and self._reader.stdout is not None
        self._reader.stdin.write(what + "\n")
        self._reader.stdin.flush()
        line = self._reader.stdout.readline()  # the tests' own timeout bounds this
        if not line:
            raise RayClusterError(f"the state driver ended: {(Path(self._tmp) / 'reader.log').read_text()[-2000:]}")
        return json.loads(line)

    def wait_empty(self, timeout: float = 20.0) -> dict:
        """Wait until no actor or placement group is alive; returns what is left then (empty: none)."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.left()
            if not left["placement_groups"] and not left["actors"] or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def processes(self, node: str) -> list[int]:
        """Pids of ``node``'s Ray processes (and what they started)."""
        proc = self._nodes.get(node)
        return session_members(proc.pid) if proc is not None else []

    def close(self) -> None:
        """SIGKILL every process of every node this cluster started (by pid, by session), then remove
        the namespace and the temporary directory. Idempotent."""
        if self._reader is not None:
            self._reader.kill()
            self._reader.wait()
            for stream in (self._reader.stdin, self._reader.stdout):
                if stream is not None:
                    stream.close()
            self._reader = None
        for node in list(self._nodes):
            self._stop(node)
        self._nodes = {}
        if self.net is not None:
            self.net.close()
            self.net = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = ""


    def _stop(self, node: str) -> None:
        """SIGKILL every process of ``node``'s session, until none is left (each by pid)."""
        proc = self._nodes.pop(node, None)
        if proc is None:
            return
        for _ in range(50):
            pids = session_members(proc.pid)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _free_port(address: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
