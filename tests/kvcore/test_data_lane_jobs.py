"""Data lanes (psnode.node.data_lanes) in real jobs: scheduler, servers and workers as processes on
127.0.0.1 over TCP, big pushes and pull replies on lanes (copied pushes written from the caller's
array when a lane is idle), exact sums, what a stranger sends to a data lane port, and the same job
with lanes off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kvcore_testkit import run_job_ok

SCRIPT = str(Path(__file__).parent / "dist_scripts" / "data_lanes.py")
TCP = {"PSLAUNCH_SAME_HOST": "tcp", "PSLAUNCH_BIGARRAY_BOUND": "100000"}


def lane_counts(results) -> list[tuple[int, int, int, int]]:
    return [tuple(int(x) for x in m.groups()) for r in results if r.role == "worker"
            for m in re.finditer(r"^LANES (\d+) (\d+) (\d+) (\d+)", r.output, re.M)]


def test_big_pushes_and_pulls_take_the_lanes_over_tcp_and_sum_exactly_after_a_strangers_bytes():
    results = run_job_ok([SCRIPT], 2, 2, TCP, timeout=90)
    counts = lane_counts(results)
    assert len(counts) == 2, counts
    for sent, received, in_place, through in counts:
        # per round: key 5 whole (one push, one reply), key 6 in parts on both servers, key 8 in 4 parts
        assert sent >= 4 * 7 and received >= 4 * 7, counts
        # every reply read straight into its out, a server's 2 parts of key 8 included (a reply each)
        assert in_place == received, counts
        # copied pushes on lanes that were idle went from the caller's array, changed right after
        assert 1 <= through <= 2 * 7, counts
    servers = "\n".join(r.output for r in results if r.role == "server")
    assert "refused a lane" in servers, servers  # the stranger was turned away, and said so


@pytest.mark.parametrize("env", [{"PSLAUNCH_LANES": "off"}, {"PSLAUNCH_SAME_HOST": "shm"},
                                 {"PSLAUNCH_RESTART_SCOPE": "worker"}],
                         ids=["lanes-off", "same-host", "restart-scope-worker"])
def test_jobs_that_do_not_take_data_lanes_send_everything_through_zeromq_alike(env):
    results = run_job_ok([SCRIPT], 2, 2, {**TCP, **env}, timeout=90)
    assert lane_counts(results) == [(0, 0, 0, 0), (0, 0, 0, 0)]
