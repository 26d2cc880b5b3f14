"""How long pslaunch takes to give up on a host whose link dropped, and to leave nothing behind.

    python -m benchmarks.link_loss [--link-timeout 15] [--reps 2] [--json out.json]

On the launcher tests' simulated cluster (three network namespaces with an sshd each, reached by
ssh config aliases: ``testkit/launcher.start_cluster``), a 2-host job runs, node2's
link is taken down, and the script measures the seconds from the link going down to pslaunch's
exit (``detect_s``: it must name node2 as the root cause, exit 255) for a kvcore job and a plain
command over ssh and for a plain command under mpi; then the link comes back and it measures how
long until none of the job's processes is left in node2's namespace (``clean_s``, counted from the
link going down; the guards stop their processes after the link timeout). Needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
HELPERS = REPO / "tests" / "launcher" / "helpers"

CASES = {
    "ssh kvcore": ["--env", "STEPS:1000000", "--env", "STEP_SLEEP:0.02", sys.executable, str(HELPERS / "steps_worker.py")],
    "ssh plain": ["--command-for-all-roles", sys.executable, str(HELPERS / "sleeper.py"), "600"],
    "mpi plain": ["--launcher", "mpi", "--command-for-all-roles", sys.executable, str(HELPERS / "sleeper.py"), "600"],
}
STARTED = {"ssh kvcore": "step 10", "ssh plain": "[worker.1@node2] sleeping", "mpi plain": "[worker.1@node2] sleeping"}


def _left(cluster, host: str) -> list[str]:
    pids = subprocess.run(["ip", "netns", "pids", cluster.net.namespace(host)], capture_output=True, text=True,
                          timeout=10).stdout.split()
    found = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if re.search(r"pslaunch-guard|psnode|steps_worker|sleeper|rank_shim|orted", cmd):
            found.append(cmd)
    return found


def one(cluster, case: str, link_timeout: float) -> dict:
    """Run ``case`` once; returns ``{"detect_s", "clean_s", "exit", "root_cause"}``."""
    hosts = cluster.hostfile("two", ["node1", "node2"])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "-n", "2", "-s", "2", "-H", hosts, *cluster.ssh_flags(),
                             "--link-timeout", f"{link_timeout:g}", "--timeout", "300", *CASES[case]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        seen, deadline = b"", time.monotonic() + 120
        while STARTED[case].encode() not in seen:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise click.ClickException(f"{case}: the job did not start: {seen.decode(errors='replace')[-2000:]}")
            if select.select([proc.stdout], [], [], 0.5)[0]:
                seen += os.read(proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
        down = time.monotonic()
        cluster.net.cut("h2")
        try:
            _, err = proc.communicate(timeout=link_timeout + 120)
            detect = time.monotonic() - down
        finally:
            cluster.net.restore("h2")
        while _left(cluster, "h2") and time.monotonic() - down < link_timeout + 300:
            time.sleep(0.2)
        clean = time.monotonic() - down
        cause = next((line for line in err.decode(errors="replace").splitlines() if "root cause:" in line), "")
        return {"detect_s": round(detect, 2), "clean_s": round(clean, 2), "exit": proc.returncode, "root_cause": cause,
                "left": _left(cluster, "h2")}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--link-timeout", type=float, default=15.0, show_default=True, help="pslaunch's --link-timeout.")
@click.option("--reps", type=int, default=2, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(link_timeout: float, reps: int, json_path: Path | None) -> None:
    """Measure the time to detect a lost host and to clean up behind it; print a table."""
    from testkit.launcher import start_cluster
    from testkit.netns import usable

    why = usable()
    if why is not None:
        raise click.ClickException(f"the simulated cluster needs network namespaces: {why}")
    results: dict[str, list[dict]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory(prefix="pslaunch-linkloss-") as tmp:
        gen = start_cluster(Path(tmp))
        cluster = next(gen)
        try:
            for rep in range(reps):
                for case in CASES:
                    click.echo(f"[rep {rep + 1}/{reps}] {case} ...", err=True)
                    results[case].append(one(cluster, case, link_timeout))
        finally:
            gen.close()
    click.echo(f"link dropped mid-job (--link-timeout {link_timeout:g}); seconds from the link going down")
    click.echo(f"{'case':<12}{'to pslaunch exit':>18}{'to nothing left':>18}  root cause")
    ok = True
    for case, runs in results.items():
        detect = statistics.median(r["detect_s"] for r in runs)
        clean = statistics.median(r["clean_s"] for r in runs)
        named = all(r["exit"] == 255 and "host node2 lost" in r["root_cause"] and not r["left"] for r in runs)
        ok = ok and named
        click.echo(f"{case:<12}{detect:>17.1f}s{clean:>17.1f}s  {'host node2 lost' if named else 'WRONG: ' + str(runs)}")
    if json_path is not None:
        json_path.write_text(json.dumps({"link_timeout": link_timeout, "runs": results}, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()  # pylint: disable=no-value-for-parameter
