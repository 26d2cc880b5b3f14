"""Workers joining a running elastic job (``-n MIN:MAX``; ``PSLAUNCH_START_WORKERS`` below
``DMLC_NUM_WORKER``): a worker that registers while the job runs takes the lowest free rank, the
servers agree the round it counts from, it gets the members' ``State`` scalars and goes on from their
step; nothing stops, and every ``dist_sync`` round sums exactly its members."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from testkit import free_port, reap
from testkit.launcher import REPO, helper

pytestmark = pytest.mark.timeout(120)

HELPER = helper("elastic_join.py")


def records(out) -> dict[int, dict[int, tuple[int, float, float]]]:
    """Per step, each worker's ``rank -> (num_workers, value0, value1)``."""
    steps: dict[int, dict[int, tuple[int, float, float]]] = {}
    for path in out.glob("steps.*.txt"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                steps.setdefault(int(parts[1]), {})[int(parts[0])] = (int(parts[2]), float(parts[3]), float(parts[4]))
    return steps


def check_exact(steps: dict[int, dict[int, tuple[int, float, float]]], count: int) -> list[frozenset[int]]:
    """Every step's values are the sum over the workers that took part in it, every member saw the
    same and counted them right; returns the members of each step."""
    assert sorted(steps) == list(range(count)), sorted(steps)
    members = []
    for step in range(count):
        seen = steps[step]
        expected = float(sum(rank + 1 for rank in seen) * (step + 1))
        assert all(v == (len(seen), expected, expected) for v in seen.values()), (step, seen)
        members.append(frozenset(seen))
    return members


def lines(out, rank: int) -> list[str]:
    return [line for path in sorted(out.glob(f"steps.{rank}.*.txt")) for line in path.read_text().splitlines()]


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_worker_started_by_hand_joins_leaves_and_another_takes_its_rank_and_every_round_is_exact(tmp_path):
    # DMLC_NUM_WORKER=3 ranks, 2 start (PSLAUNCH_START_WORKERS), minimum 2: worker 2 joins once step 3
    # is done, leaves after its step 9's pulls (its step 10 is its last), and a second joiner takes rank 2
    port, procs = free_port(), []
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLAUNCH_"))}
    base.update(PYTHONPATH=str(REPO), DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_SERVER="2",
                DMLC_NUM_WORKER="3", PSLAUNCH_MIN_WORKERS="2", PSLAUNCH_START_WORKERS="2", STEPS="40",
                STEP_SLEEP="0.08")

    def start(name: str, role: str, **extra: str) -> subprocess.Popen:
        with open(tmp_path / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, HELPER, str(tmp_path)], env={**base, "DMLC_ROLE": role, **extra},
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    try:
        for name, role in (("scheduler", "scheduler"), ("server0", "server"), ("server1", "server"),
                           ("worker0", "worker"), ("worker1", "worker")):
            start(name, role)
        wait_for(lambda: len(lines(tmp_path, 0)) >= 4)
        first = start("joiner1", "worker", LEAVE="2:9")
        assert first.wait(timeout=60) == 0
        wait_for(lambda: records(tmp_path) and max(records(tmp_path)) >= 14)
        start("joiner2", "worker")
        wait_for(lambda: sum(line.startswith("2 joined") for line in lines(tmp_path, 2)) == 2)
        full = start("joiner3", "worker")  # the job holds its maximum of 3 workers now
        assert full.wait(timeout=60) != 0
        codes = [p.wait(timeout=60) for p in procs if p not in (full,)]
    finally:
        reap(procs)
    logs = {p.stem: p.read_text() for p in tmp_path.glob("*.log")}
    assert codes == [0] * len(codes), logs
    members = check_exact(records(tmp_path), 40)
    with_joiner = [step for step, m in enumerate(members) if m == {0, 1, 2}]
    joined = [int(line.split()[2]) for line in lines(tmp_path, 2) if line.startswith("2 joined")]
    # the first joiner came after step 3, took part through step 10 (SIGTERM after step 9's pulls), and
    # the second from where it restored the members' step on
    assert len(joined) == 2 and 4 <= joined[0] and joined[1] > 11, joined
    assert with_joiner == list(range(joined[0], 11)) + list(range(joined[1], 40)), (joined, with_joiner)
    assert all(m == {0, 1} for step, m in enumerate(members) if step not in with_joiner)
    for rank in (0, 1):  # the reset callbacks ran at exactly the steps where the count changed
        resets = (tmp_path / f"resets.{rank}.txt").read_text().split("\n")
        assert resets[:3] == [f"{rank} reset {joined[0]} 3", f"{rank} reset 11 2", f"{rank} reset {joined[1]} 3"]
    assert "the job has its maximum of 3 workers (DMLC_NUM_WORKER, -n MIN:MAX)" in logs["joiner3"], logs["joiner3"]
    scheduler = logs["scheduler"]
    assert scheduler.count("worker 2 joined the job from 127.0.0.1:") == 2, scheduler
