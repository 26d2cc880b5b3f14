"""The failures benchmark runs: a quick pass on the MLP example gives an uninterrupted row, one with a
worker replaced in place and one with the job restarted from its checkpoint, each kill landed and the
final weights equal.

No timing is asserted (the figures live in docs/benchmarks.md and docs/failures.md); this checks that
``python -m benchmarks.failures`` kills what it says, reaps every job and writes a complete report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.launcher import reaped, wait_gone

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_quick_run_kills_replaces_and_restarts_with_the_uninterrupted_weights(tmp_path):
    # the kill lands mid-run (half the uninterrupted run's time, on a worker 0.5 s old)
    out = tmp_path / "out.json"
    argv = [sys.executable, "-m", "benchmarks.failures", "--models", "mlp", "--quick", "--kills", "1", "--min-age",
            "0.5", "--json", str(out), "--job-timeout", "120"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    with reaped(proc, "pslaunch-failures-"):  # its jobs' processes carry their folder's name
        stdout, _ = proc.communicate(timeout=280)
    assert proc.returncode == 0, stdout
    rows = {row["case"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"uninterrupted", "ready", "worker", "job", "replicas", "server", "server-job", "elastic",
                         "elastic-leave", "elastic-lost"}, rows
    assert all(rows[case]["ok"] and rows[case]["restarts_of_the_job"] == 0 for case in ("elastic-leave", "elastic-lost"))
    assert rows["ready"]["kept_bytes"] > 0 and rows["uninterrupted"]["kept_bytes"] == 0, rows
    replaced, restarted = rows["worker"], rows["job"]
    # a quick run may end before a kill lands, or the kill may land after the worker's finish (nothing then
    # waits for it: it is neither replaced nor a failure); timing is the machine's, what landed is accounted for
    assert len(replaced["replacements"]) + len(replaced["ended_after_their_part"]) == len(replaced["kills"]), replaced
    assert all(r["waited_s"] is not None and r["waited_s"] > 0 for r in replaced["replacements"]), replaced
    assert restarted["restarts_of_the_job"] + len(restarted["ended_after_their_part"]) == len(restarted["kills"]), restarted
    assert replaced["weights_equal"] is True and restarted["weights_equal"] is True, rows
    # one server killed: its replica took over (nothing restarted), or the job started again from its checkpoint
    server, server_job = rows["server"], rows["server-job"]
    assert len(server["kills"]) <= 1 and server["restarts_of_the_job"] == 0 and server["weights_equal"] is True, server
    assert server_job["restarts_of_the_job"] == len(server_job["kills"]) <= 1 and server_job["weights_equal"] is True, \
        server_job
    assert "| mlp | worker, replaced in place |" in stdout and "| mlp | server, its replica takes over |" in stdout, stdout
    assert not wait_gone("pslaunch-failures-")
