"""An elastic job's capacity sources (``launcher.planning.capacity``): the discovery script's
``host:slots`` lines, a script that fails or hangs, the hostfile read again; and what pslaunch
refuses before anything starts."""

from __future__ import annotations

import pytest

from launcher.errors import HostfileError
from launcher.planning.capacity import CapacityError, DiscoveryScript, HostfileCapacity, parse_discovered
from testkit.launcher import run_pslaunch

pytestmark = pytest.mark.timeout(60)


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_discovered_lines_are_host_slots_a_bare_host_is_one_slot_and_repeats_add_up():
    hosts = parse_discovered("# capacity\nnode-1:4\nnode-2\nops@node-3:2\n[fe80::1]:2\nnode-1:1\n\n", "disc")
    assert [(h.user, h.name, h.slots) for h in hosts] == [(None, "node-1", 5), (None, "node-2", 1),
                                                          ("ops", "node-3", 2), (None, "fe80::1", 2)]


def test_bad_discovered_lines_are_each_named_with_their_number_and_text():
    with pytest.raises(HostfileError) as err:
        parse_discovered("node-1:4\nnode-2 slots=2\nnode-3:0\nno good!:1\n", "disc")
    text = str(err.value)
    assert "disc:2: 'node-2 slots=2': expected '[user@]host[:slots]'" in text
    assert "disc:3: 'node-3:0': slots '0' is not a number in 1..65535" in text and "disc:4: 'no good!:1'" in text


def test_a_discovery_script_that_fails_hangs_or_cannot_run_is_an_error_naming_it(tmp_path):
    assert [h.slots for h in DiscoveryScript(_script(tmp_path, "echo 127.0.0.2:3")).read()] == [3]
    failing = _script(tmp_path, "echo 'no inventory service' >&2; exit 3")
    with pytest.raises(CapacityError, match=r"discover.sh failed with exit code 3: no inventory service"):
        DiscoveryScript(failing).read()
    slow = _script(tmp_path, "sleep 5")
    with pytest.raises(CapacityError, match=r"discover.sh ran longer than 0.3 s"):
        DiscoveryScript(slow, timeout=0.3).read()
    with pytest.raises(CapacityError, match=r"--host-discovery-script /nonexistent/discover could not run"):
        DiscoveryScript("/nonexistent/discover").read()


def test_the_hostfile_is_read_again_only_when_its_bytes_change(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("h1 slots=2\n")
    source = HostfileCapacity(str(path))
    assert [h.slots for h in source.read()] == [2] and not source.changed()
    path.write_text("h1 slots=2\nh2 slots=1\n")
    assert source.changed() and [h.name for h in source.read()] == ["h1", "h2"]
    path.write_text("h1 slots=two\n")
    with pytest.raises(CapacityError, match=r"hosts:1: 'h1 slots=two': slots must be a whole number"):
        source.read()


@pytest.mark.parametrize("extra, message", [
    (["-n", "2", "--launcher", "ssh"], "--host-discovery-script gives an elastic job its hosts: it needs -n MIN:MAX "
                                       "and --launcher ssh (here -n 2, --launcher ssh)"),
    (["-n", "1:2", "--launcher", "local"], "it needs -n MIN:MAX and --launcher ssh (here -n 1:2, --launcher local)"),
])
def test_a_discovery_script_outside_an_elastic_ssh_job_is_refused(tmp_path, extra, message):
    res = run_pslaunch([*extra, "--host-discovery-script", _script(tmp_path, "echo 127.0.0.2:2"), "--dry-run",
                        "python", "train.py"], timeout=30)
    assert res.returncode != 0 and message in res.stderr, res.stderr


def test_a_job_waits_for_its_minimum_of_slots_then_fails_naming_what_the_script_reported(tmp_path):
    res = run_pslaunch(["-n", "2:3", "--host-discovery-script", _script(tmp_path, "echo 127.0.0.2:1"),
                        "--elastic-timeout", "1", "--dry-run", "python", "train.py"], timeout=30)
    assert res.returncode != 0
    assert ("discover.sh reported 1 slot (127.0.0.2:1), fewer than the job's minimum of 2 workers (-n), for 1 s "
            "(--elastic-timeout)") in res.stderr, res.stderr


def test_the_plan_starts_the_workers_the_slots_hold_and_leaves_the_other_ranks_to_joiners(tmp_path):
    res = run_pslaunch(["-n", "2:4", "-s", "1", "--host-discovery-script",
                        _script(tmp_path, "echo 127.0.0.2:2; echo 127.0.0.3:1"), "--dry-run", "python", "train.py"],
                       timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("worker.") == 3 and "PSLAUNCH_START_WORKERS=3" in res.stdout, res.stdout
    assert "DMLC_NUM_WORKER=4" in res.stdout and "PSLAUNCH_MIN_WORKERS=2" in res.stdout
