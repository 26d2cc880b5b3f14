"""Link liveness: the remote guard stops its command when pslaunch goes quiet, answers pings, and
holds its clock while the job is stopped with Ctrl-Z; pslaunch takes the answers out of the output
and calls a host lost after the link timeout, not counting time it did not run itself.

The guard runs here as it runs remotely (``sh -c GUARD_SCRIPT``) with a pipe for the ssh channel's
stdin; the whole path over ssh and a dropped link is in test_cluster_netns.py."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Callable

from launcher.backends.ssh.linkwatch import LinkWatch, PongFilter
from launcher.on_node.guard import PING, PONG, env_payload, remote_command
from testkit.launcher import helper, processes_with, wait_gone


class Guard:
    """A guard around the sleeper helper, fed through a pipe as pslaunch feeds it over ssh: the
    environment, then ``first`` in the same write. ``edit`` changes the guard's command first."""

    def __init__(self, marker: str, link_timeout: float, first: bytes = b"",
                 edit: Callable[[str], str] | None = None) -> None:
        command = remote_command([sys.executable, helper("sleeper.py"), "600", marker], None, False, 1, link_timeout)
        self.marker = marker
        self.proc = subprocess.Popen(["sh", "-c", edit(command) if edit else command], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.err = b""
        self.send(env_payload({}) + first)

    def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def read_until(self, wanted: bytes, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while wanted not in self.err:
            assert time.monotonic() < deadline, f"{wanted!r} did not come: {self.err!r}"
            if select.select([self.proc.stderr], [], [], 0.2)[0]:
                self.err += os.read(self.proc.stderr.fileno(), 65536)

    def assert_stopped_its_command(self) -> None:
        """The guard ended as after SIGTERM to its group, and nothing of the command is left."""
        assert self.proc.wait(30) == 128 + signal.SIGTERM
        assert wait_gone(self.marker, 10) == []


@contextmanager
def started_guard(marker: str, link_timeout: float, **options):
    """A ``Guard`` (``options``: its ``first`` and ``edit``) whose command started; killed with
    everything it started afterwards."""
    guard = Guard(marker, link_timeout, **options)
    try:
        guard.read_until(b"PSLAUNCH-PID")
        yield guard
    finally:
        if guard.proc.poll() is None:
            os.killpg(guard.proc.pid, signal.SIGKILL)
        guard.proc.wait(10)
        for line in processes_with(marker):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


def test_the_guard_answers_pings_and_stops_its_command_once_no_line_came_for_the_link_timeout(marker):
    with started_guard(marker, link_timeout=2) as guard:
        for _ in range(4):  # pinged, the command lives on past the timeout
            guard.send(PING)
            time.sleep(1)
        guard.read_until(PONG)
        assert processes_with(marker)
        guard.assert_stopped_its_command()  # silence, the channel still open (as in a partition)


def test_a_stop_holds_the_guards_link_timeout_until_the_next_line(marker):
    with started_guard(marker, link_timeout=2) as guard:
        guard.send(b"STOP\n")  # pslaunch is stopped too (Ctrl-Z): no pings come meanwhile
        time.sleep(4)
        assert guard.proc.poll() is None and processes_with(marker)
        guard.send(b"CONT\n")
        guard.assert_stopped_its_command()  # the clock runs again from CONT


def test_a_stop_read_before_the_link_timeout_clock_started_still_holds_it(marker):
    # The guard reads lines at once; the clock that counts the silence is a subshell the lines reach
    # as signals. A STOP that reached it before it set its traps killed it (SIGUSR2's default), and
    # the job lost its link timeout: 2 runs in 8 of the test above failed so under load. Here the
    # clock starts 2 s late on purpose (under load a fork can be that slow), with the STOP already
    # written: the guard must read no line before the clock is ready for it.
    def late_clock(command: str) -> str:
        assert command.count("( trap ") == 1, "the clock's subshell is not where this test delays it"
        return command.replace("( trap ", "( sleep 2; trap ")

    with started_guard(marker, link_timeout=2, first=b"STOP\n", edit=late_clock) as guard:
        time.sleep(6)  # the late start, then twice the link timeout: held
        assert guard.proc.poll() is None and processes_with(marker), guard.err
        guard.send(b"CONT\n")
        guard.assert_stopped_its_command()


def test_without_a_link_timeout_the_guard_waits_for_the_end_of_its_input(marker):
    with started_guard(marker, link_timeout=0) as guard:
        time.sleep(3)
        assert guard.proc.poll() is None
        guard.proc.stdin.close()
        guard.assert_stopped_its_command()


def test_pong_markers_leave_the_stream_whole_lines_and_split_markers_included():
    pongs = PongFilter()
    stream = [b"progress 1", PONG[:5], PONG[5:] + b"0%\rprogress 2", PONG + b"0%\n" + PONG, b"done\n\x1f", b""]
    out = b"".join(pongs.feed(chunk) for chunk in stream)
    assert out == b"progress 10%\rprogress 20%\ndone\n\x1f"  # a lone \x1f at the end is the process's own


def test_a_host_is_lost_after_the_timeout_of_silence_and_time_pslaunch_did_not_run_is_not_silence():
    now = [100.0]
    watch = LinkWatch(10, clock=lambda: now[0])
    assert watch.interval == 2.0
    now[0] += 60  # the pre-flight check and rsync ran before the first host was added
    watch.add("a", counting=False)
    watch.heard("elsewhere")  # not watched: never lost
    now[0] += 4
    assert watch.silent_for("a") == 0 and not watch.lost("a")  # still being started
    watch.heard("a")
    now[0] += 4
    assert watch.silent_for("a") == 4 and not watch.lost("a") and not watch.in_doubt("a")
    now[0] += 2
    assert watch.in_doubt("a") and not watch.lost("a")
    now[0] += 4.5
    assert watch.lost("a")
    watch.heard("a")
    now[0] += 60  # pslaunch itself was stopped for a minute: the hosts could not be heard meanwhile
    assert watch.silent_for("a") == 0 and not watch.lost("a")
    for _ in range(11):  # then pslaunch looks as it runs (every 50 ms; every second here)
        now[0] += 1
        watch.silent_for("a")
    assert watch.lost("a")
    watch.close()
