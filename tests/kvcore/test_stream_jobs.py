"""Streams (psnode.transport.streams) in real jobs: scheduler, servers and workers as processes on
127.0.0.1, every message between a worker and a server on the worker's stream to it (a Unix socket
when the job takes the same-host path, TCP otherwise), exact sums, what a stranger sends to a
stream port or socket, and the jobs that keep ZeroMQ alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kvcore_testkit import run_job_ok

SCRIPT = str(Path(__file__).parent / "dist_scripts" / "streams.py")
TCP = {"PSLAUNCH_SAME_HOST": "tcp"}


def stream_counts(results) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in m.groups()) for r in results if r.role == "worker"
            for m in re.finditer(r"^STREAMS (\d+) (\d+) (\d+)", r.output, re.M)]


def stream_families(results) -> list[str]:
    return [m.group(1) for r in results if r.role == "worker" for m in re.finditer(r"^FAMILIES (.*)$", r.output, re.M)]


@pytest.mark.parametrize("env, family", [(TCP, "AF_INET"), ({"PSLAUNCH_SAME_HOST": "shm"}, "AF_UNIX"),
                                         ({"PSLAUNCH_SAME_HOST": "ipc"}, "AF_UNIX")],
                         ids=["tcp", "same-host", "same-host-ipc"])
def test_a_workers_messages_to_its_servers_take_its_streams_and_sum_exactly_after_a_strangers_bytes(env, family):
    results = run_job_ok([SCRIPT], 2, 2, env, timeout=90)
    assert stream_families(results) == [f"{family} {family}"] * 2, stream_families(results)
    counts = stream_counts(results)
    assert len(counts) == 2, counts
    for streams, sent, received in counts:
        assert streams == 2, counts  # one to each server
        # per round 4 keys and a list, each pushed and pulled on both servers at most: replies come back
        assert sent >= 5 * 5 and received >= 5 * 5, counts
    servers = "\n".join(r.output for r in results if r.role == "server")
    # the first refusal is logged (at most one a second); the forged proof's is asserted by the worker
    assert "refused a lane from" in servers and "did not open a workers' streams connection" in servers, servers


@pytest.mark.parametrize("env", [{"PSLAUNCH_STREAMS": "off"}, {"PSLAUNCH_RESTART_SCOPE": "worker"},
                                 {"PSLAUNCH_ENCRYPT": "curve"}],
                         ids=["streams-off", "restart-scope-worker", "encrypted"])
def test_jobs_without_streams_send_everything_through_zeromq_alike(env):
    results = run_job_ok([SCRIPT], 2, 2, {**TCP, **env}, timeout=90)
    assert stream_counts(results) == [(0, 0, 0), (0, 0, 0)]
