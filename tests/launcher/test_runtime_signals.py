"""The runtime's own signals (``pscontract.runtime_signals``: pslaunch asking a worker for its stack, and
worker 0's commit in a preempted job) reach a worker that has not started its runtime yet, one still
importing its libraries or a replacement just started, and do nothing: pslaunch's local spawner and
the ssh guard start every process with them ignored, and the runtime installs its handlers over that.
(A real-time signal's default action ends the process: a stall line once killed a replacement so.)"""

from __future__ import annotations

import os
import re

import pytest

from pscontract import runtime_signals
from testkit.launcher import REPO, helper, reaped
from testkit.launcher.processes import StderrWatch, start_pslaunch

LATE = helper("late_runtime.py")

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("launcher", ["local", "ssh"])
def test_the_runtimes_signals_sent_before_its_runtime_runs_leave_the_worker_running(launcher, request, tmp_path):
    args = ["-n", "1", "-s", "1", "--no-dashboard", "--timeout", "60"]
    if launcher == "ssh":
        sshd = request.getfixturevalue("sshd")
        hosts = sshd.hostfile(tmp_path / "hosts", ["127.0.0.2"])
        args += ["-H", hosts, *sshd.ssh_flags(), "--env", f"PYTHONPATH:{REPO}"]
    with reaped(start_pslaunch([*args, "python", LATE, str(tmp_path)]), str(tmp_path)) as proc:
        watch = StderrWatch(proc)
        assert watch.wait_for(r"WAITING (\d+)", 30), watch.text()
        pid = int(re.search(r"WAITING (\d+)", watch.text()).group(1))
        for signum in runtime_signals():
            os.kill(pid, signum)  # its runtime is not running yet
        (tmp_path / "go").write_text("")
        err = watch.finish(90)
    assert proc.returncode == 0, err
    assert "OK 0" in err, err
