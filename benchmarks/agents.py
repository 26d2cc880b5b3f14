"""Per-node agents on a simulated cluster: how long the job takes to form, and to end when a node is lost.

    python -m benchmarks.agents [--reps 3] [--link-timeout 15] [--json out.json]

Three network namespaces as three Kubernetes pods (``testkit.launcher.agents.Pods``: the Service's
names in a hosts file per namespace, the key in a file, no sshd), one ``pslaunch --nnodes 3`` per
pod, a dist_sync job of 3 workers and 3 servers (one of each per node) whose worker 0 writes the
wall-clock time of its first finished step (push and pull) to a file:

* ``form_node0_last_s``: from the start of the last agent (node 0, the other two started 1 s before)
  to that first step; ``form_node0_first_s``: the same with node 0 started first and the agents 1 s
  later (the last agent's start counts). Baseline in the same run: ``local_s``, the same job under
  ``pslaunch --launcher local`` on one machine, from its start to its first step;
* ``lost_s``: node 1's link goes down mid-job; the seconds until every agent has exited (node 0 and
  node 2 naming node 1, node 1 naming node 0; exit 255 each), and ``lost_s - link_timeout``, the part
  that is not the timeout itself.

Needs root and iproute2 (``testkit.netns``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent

WORKER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import kvcore
    kv = kvcore.create("dist_sync")
    kv.init(0, np.zeros(4, np.float32))
    out = np.zeros(4, np.float32)
    for step in range(int(os.environ.get("STEPS", "20"))):
        kv.push(0, np.ones(4, np.float32))
        kv.pull(0, out=out)
        if step == 0 and kv.rank == 0:
            with open(os.path.join(sys.argv[1], "first_step"), "w") as fh:
                fh.write(repr(time.time()))
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
""")


def _first_step(out: Path, timeout: float = 120) -> float:
    deadline = time.monotonic() + timeout
    path = out / "first_step"
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no first step within {timeout} s")
        time.sleep(0.005)
    return float(path.read_text())


def _job(work: Path, out: Path, steps: int, sleep: float) -> list[str]:
    script = work / "worker.py"
    script.write_text(WORKER)
    return ["-n", "3", "-s", "3", "--env", f"STEPS:{steps}", "--env", f"STEP_SLEEP:{sleep:g}", "--timeout", "300",
            sys.executable, str(script), str(out)]


def formation(pods, work: Path, node0_last: bool) -> float:
    from testkit.launcher.agents import AgentJob, write_key

    out = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "PSLAUNCH_JOB_KEY_FILE": str(write_key(out / "key"))}
    with AgentJob(out, 3, pods.endpoint, _job(work, out, 20, 0), env=env, prefix=pods.prefix) as job:
        order = [2, 1, 0] if node0_last else [0, 1, 2]
        job.start(order[0])
        job.start(order[1])
        time.sleep(1.0)
        last = time.time()
        job.start(order[2])
        first = _first_step(out)
        results = job.wait(120)
    assert all(r.returncode == 0 for r in results.values()), job.report()
    return first - last


def local(work: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "--launcher", "local", *_job(work, out, 20, 0)],
                          env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    return _first_step(out) - start


def loss(pods, work: Path, link_timeout: float) -> float:
    from testkit.launcher.agents import AgentJob, write_key

    out = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "PSLAUNCH_JOB_KEY_FILE": str(write_key(out / "key"))}
    args = ["--link-timeout", f"{link_timeout:g}", "--stop-grace", "2", *_job(work, out, 10**6, 0.02)]
    with AgentJob(out, 3, pods.endpoint, args, env=env, prefix=pods.prefix) as job:
        job.start_all()
        _first_step(out)
        time.sleep(1.0)
        pods.net.cut(pods.hosts[1])
        cut = time.monotonic()
        try:
            ended = {}
            while len(ended) < 3:
                for rank, proc in job.procs.items():
                    if rank not in ended and proc.poll() is not None:
                        ended[rank] = time.monotonic() - cut
                if time.monotonic() - cut > link_timeout * 4 + 30:
                    raise RuntimeError(f"the agents did not all exit: {job.report()}")
                time.sleep(0.01)
        finally:
            pods.net.restore(pods.hosts[1])
        codes = {rank: proc.returncode for rank, proc in job.procs.items()}
    assert codes == {0: 255, 1: 255, 2: 255}, (codes, job.report())
    return max(ended.values())


@click.command()
@click.option("--reps", default=3, show_default=True)
@click.option("--link-timeout", default=15.0, show_default=True)
@click.option("--json", "json_path", default=None)
def main(reps: int, link_timeout: float, json_path: str | None) -> None:
    sys.path.insert(0, str(REPO))
    from testkit.launcher.agents import Pods
    from testkit.netns import NetnsCluster

    rows: dict[str, list[float]] = {"local_s": [], "form_node0_last_s": [], "form_node0_first_s": [], "lost_s": []}
    with tempfile.TemporaryDirectory() as tmp, NetnsCluster(nics=("eth0", "eth0", "eth0")) as net:
        work = Path(tmp)
        pods = Pods(net)
        try:
            for _ in range(reps):
                rows["local_s"].append(local(work))
                rows["form_node0_last_s"].append(formation(pods, work, node0_last=True))
                rows["form_node0_first_s"].append(formation(pods, work, node0_last=False))
                rows["lost_s"].append(loss(pods, work, link_timeout))
        finally:
            pods.close()
    summary = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
               for name, v in rows.items()}
    summary["lost_minus_timeout_s"] = {"median": statistics.median(rows["lost_s"]) - link_timeout}
    summary["link_timeout_s"] = link_timeout
    for name, value in summary.items():
        if isinstance(value, dict):
            print(f"{name:24s} median {value['median']:.3f} s" + (f"  (min {value['min']:.3f}, max {value['max']:.3f})"
                                                                 if "min" in value else ""))
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
