"""A process group's id is its leader's pid, which the system hands to a new process once every
process of the group has ended. pslaunch, its watchdog and a rank shim signal a group they started
only while the id is still that group (``launcher.on_node.process_groups.Group``): a stranger that
took the number gets nothing. (A suite run on a busy machine once saw pslaunch SIGKILL another
test's pslaunch: its close killed the id of a worker that had ended long before.) Real processes;
the stranger is a process in a session of its own, as every process of a job is."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from launcher.backends.local import LocalSpawner
from launcher.on_node.process_groups import Group, leader_start
from testkit.launcher import REPO


@pytest.fixture
def stranger():
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _alive_after(proc: subprocess.Popen, seconds: float = 0.3) -> bool:
    time.sleep(seconds)
    return proc.poll() is None


def test_a_group_whose_id_another_process_took_gets_no_signal_and_ours_does(stranger):
    started = leader_start(stranger.pid)
    assert started is not None
    earlier = Group(stranger.pid, started - 1)  # ours had this id, and ended: the number is the stranger's now
    assert not earlier.ours() and not earlier.alive()
    assert earlier.signal(signal.SIGKILL) is False and earlier.verb("KILL") is False
    assert _alive_after(stranger)
    ours = Group.of(stranger.pid)
    assert ours.ours() and ours.alive() and ours.signal(signal.SIGKILL)
    assert stranger.wait(5) == -signal.SIGKILL


def test_a_group_whose_leader_ended_is_still_signalled_while_its_members_hold_the_id(tmp_path):
    # the leader starts a member in its group and exits: the id stays taken, by our member
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    group = Group.of(leader.pid)
    member = int(leader.stdout.readline())
    leader.wait(5)
    try:
        assert leader_start(leader.pid) is None and group.ours() and group.alive()
        assert group.signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while leader_start(member) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leader_start(member) is None, "the member of our group was not killed"
    finally:
        subprocess.run(["kill", "-9", str(member)], capture_output=True)


def test_the_watchdog_stops_its_groups_and_spares_a_stranger_that_took_an_id(stranger):
    ours = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        lines = (f"add {ours.pid} {leader_start(ours.pid)}\n"
                 f"add {stranger.pid} {leader_start(stranger.pid) - 1}\n")  # an ended group's id, taken since
        watchdog = subprocess.Popen([sys.executable, "-m", "launcher.on_node.watchdog", "1"], stdin=subprocess.PIPE,
                                    cwd=REPO)
        watchdog.communicate(lines.encode(), timeout=30)  # EOF: what pslaunch's death looks like
        assert ours.wait(5) in (-signal.SIGTERM, -signal.SIGKILL)
        assert _alive_after(stranger)
    finally:
        ours.kill()
        ours.wait()


def test_pslaunchs_spawner_closing_kills_what_lingers_of_its_groups_but_not_a_stranger(stranger):
    spawner = LocalSpawner(grace=1.0)
    ours = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        spawner._watch(Group.of(ours.pid))  # the seam spawn() uses for each process it starts
        spawner._watch(Group(stranger.pid, leader_start(stranger.pid) - 1))
        spawner.close()
        assert ours.wait(5) == -signal.SIGKILL
        assert _alive_after(stranger)
    finally:
        ours.kill()
        ours.wait()
