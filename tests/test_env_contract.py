"""The launcher's writer and the runtime's reader of docs/env.md agree on every variable."""

import pathlib
import re

import pytest

import pscontract
from psnode import env as node_env

pytestmark = pytest.mark.unit

DOC = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "env.md").read_text()


def documented_names():
    return set(re.findall(r"^\| `([A-Z_]+)`", DOC, flags=re.M))


@pytest.mark.parametrize("role", pscontract.ROLES)
def test_runtime_reads_what_the_launcher_writes(role):
    written = pscontract.contract_env(
        role=role, root_uri="127.0.0.2", root_port=9123, num_workers=3, num_servers=2,
        job_id="job-x", rank=1, local_rank=1, local_size=2, node_host="127.0.0.5",
        interface="lo", all_local=True, verbose=2, restart_count=2,
        settings={pscontract.PSLAUNCH_CHECKPOINT_DIR: "/shared/ckpt", pscontract.PSLAUNCH_RESTART_SCOPE: "worker"},
    )
    read = node_env.read_env(written)
    # restarts: how many came before, where checkpoints live, what a restart starts again
    assert (read.restart_count, read.checkpoint_dir, read.restart_scope) == (2, "/shared/ckpt", "worker")
    assert pscontract.RESTART_SCOPES == ("job", "worker")
    assert (read.role, read.root_uri, read.root_port) == (role, "127.0.0.2", 9123)
    assert (read.num_workers, read.num_servers) == (3, 2)
    assert (read.job_id, read.local_rank, read.local_size) == ("job-x", 1, 2)
    assert (read.node_host, read.interface, read.local, read.verbose) == ("127.0.0.5", "lo", True, 2)
    # a worker's runtime rank is the launcher's rank, so output labels and kv.rank agree
    assert read.worker_id == (1 if role == "worker" else None)
    # the launcher watches liveness: no registration timeout
    assert read.supervised and read.register_timeout == float("inf")


def test_launcher_and_runtime_agree_on_the_way_back():
    assert pscontract.EXIT_PEER_FAILED == node_env.EXIT_PEER_FAILED
    assert pscontract.MARKER_READY == node_env.MARKER_READY
    assert pscontract.MARKER_FAILED == node_env.MARKER_FAILED
    assert pscontract.MARKER_STATS == node_env.MARKER_STATS
    assert pscontract.MARKER_TRACE == node_env.MARKER_TRACE
    assert (pscontract.MARKER_RESUMED, pscontract.MARKER_CAUGHT_UP) == (node_env.MARKER_RESUMED, node_env.MARKER_CAUGHT_UP)
    assert pscontract.TIMELINE_TO_LAUNCHER == node_env.TIMELINE_TO_LAUNCHER
    assert f"| `{pscontract.EXIT_PEER_FAILED}` |" in DOC


def test_a_job_without_servers_is_read_as_such():
    written = pscontract.contract_env(
        role="scheduler", root_uri="127.0.0.1", root_port=1, num_workers=2, num_servers=0,
        job_id="j", rank=0, local_rank=0, local_size=1,
    )
    assert node_env.read_env(written).num_servers == 0


def test_minimal_launcher_env_is_complete_for_the_runtime():
    written = pscontract.contract_env(
        role="worker", root_uri="127.0.0.1", root_port=1, num_workers=1, num_servers=1,
        job_id="j", rank=0, local_rank=0, local_size=1,
    )
    assert set(pscontract.REQUIRED) <= set(written)
    node_env.read_env(written, default_role=None)


def test_every_variable_either_side_uses_is_documented():
    names = documented_names()
    assert set(pscontract.WRITTEN) <= names
    runtime_source = pathlib.Path(node_env.__file__).read_text()
    read_names = set(re.findall(r'"((?:DMLC|PS|PSLAUNCH)_[A-Z_]+)"', runtime_source))
    assert read_names, "the runtime reader names no variable"
    assert read_names <= names, sorted(read_names - names)


def test_runtime_reads_the_observability_settings_the_launcher_writes():
    written = pscontract.contract_env(
        role="worker", root_uri="127.0.0.1", root_port=1, num_workers=2, num_servers=1, job_id="j", rank=1,
        local_rank=0, local_size=1,
        settings={pscontract.PSLAUNCH_STATS: "0.5", pscontract.PSLAUNCH_TIMELINE: pscontract.TIMELINE_TO_LAUNCHER},
    )
    read = node_env.read_env(written)
    assert (read.stats_interval, read.timeline, read.launch_rank) == (0.5, "-", 1)
    # the scheduler's stats lines are for pslaunch only: a job started by hand asks for none
    by_hand = node_env.read_env({**written, pscontract.PSLAUNCH_SUPERVISED: "0",
                                 pscontract.PSLAUNCH_TIMELINE: "/tmp/trace.json"})
    assert by_hand.stats_interval == 0 and by_hand.timeline == "/tmp/trace.json"


@pytest.mark.parametrize("text", ["eth0", "ib0,eth0", " ens5 ", "10.1.0.0/16", "eth0;reboot", "eth0,,ib0",
                                  "10.1.0.0/33", "éth0", "eth٠", "a" * 16, "bond0.100", "veth-1:2"])
def test_the_launcher_and_the_runtime_accept_the_same_interface_specs(text):
    # One parser (pscontract.parse_interface_spec) for --interface and DMLC_INTERFACE: a spec the
    # launcher passes on is one every node accepts, and one refused is refused by both, naming it.
    from launcher.errors import ConfigError
    from launcher.planning.network import parse_interface

    outcomes = []
    for parse, error in ((parse_interface, ConfigError), (node_env._interface_spec, node_env.EnvError)):
        try:
            outcomes.append(parse(text))
        except error as exc:
            assert repr(text) in str(exc)
            outcomes.append("refused")
    assert outcomes[0] == outcomes[1]
    assert (outcomes[0] == "refused") == (text in ("eth0;reboot", "eth0,,ib0", "10.1.0.0/33", "éth0", "eth٠", "a" * 16))


def test_a_job_started_by_hand_gets_its_id_from_the_contract_rule():
    env = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "Node1", "DMLC_PS_ROOT_PORT": "9091",
           "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1"}
    assert node_env.read_env(env).job_id == pscontract.shared_job_id("node1 ", 9091)
    assert pscontract.shared_job_id("node1", 9091) != pscontract.shared_job_id("node1", 9092)
