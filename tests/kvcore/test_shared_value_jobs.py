"""Values the workers copy out of a server's memory (psnode.server.shared_values) in real jobs: a
scheduler, 2 servers and 2 workers as processes on one host, exact values after each push, after two
pushes in a row and for a pull sent before the next push, with and without an optimizer on the
servers, and jobs whose values take another path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kvcore_testkit import run_job_ok

SCRIPT = str(Path(__file__).parent / "dist_scripts" / "shared_values.py")
PARTS_PULLED = 7 * 7  # 7 pulls of each key; the 3 keys come in 7 parts (1 whole, 2 split, 4 of 16 MiB)


def shared_counts(results) -> list[int]:
    return [int(m.group(1)) for r in results if r.role == "worker"
            for m in re.finditer(r"^SHARED (\d+)", r.output, re.M)]


@pytest.mark.parametrize("mode", ["sum", "optimizer"])
def test_same_host_workers_copy_every_big_value_out_of_the_servers_memory_and_it_stays_exact(mode):
    results = run_job_ok([SCRIPT, mode], 2, 2, {}, timeout=90)
    assert shared_counts(results) == [PARTS_PULLED, PARTS_PULLED]


@pytest.mark.parametrize("env", [{"PSLAUNCH_SAME_HOST": "ipc"}, {"PSLAUNCH_SAME_HOST": "tcp"}], ids=["ipc", "tcp"])
def test_jobs_without_shared_memory_get_the_same_values_over_their_sockets(env):
    results = run_job_ok([SCRIPT], 2, 2, env, timeout=90)
    assert shared_counts(results) == [0, 0]
