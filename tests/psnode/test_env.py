"""psnode.env reads the contract of docs/env.md and names the variable at fault."""

import re
from pathlib import Path

import pytest

from psnode.env import NodeEnv, read_env
from psnode.errors import EnvError

pytestmark = pytest.mark.unit

BASE = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9091", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1"}


def test_a_complete_environment_gives_the_documented_defaults():
    env = read_env(BASE)
    assert env == NodeEnv(role="worker", root_uri="127.0.0.1", root_port=9091, num_workers=2, num_servers=1, job_id=env.job_id,
                          job_id_from="127.0.0.1:9091")  # no PSLAUNCH_JOB_ID: derived from the address as given
    assert (env.heartbeat_interval, env.heartbeat_timeout, env.register_timeout) == (1.0, 10.0, 60.0)
    assert (env.bigarray_bound, env.server_device, env.verbose, env.local) == (1_000_000, "cpu", 0, False)
    assert (env.same_host, env.io_sched) == ("shm", "batch")
    assert read_env({**BASE, "PSLAUNCH_IO_SCHED": "Normal"}).io_sched == "normal"
    assert read_env(BASE).malloc_tuning and not read_env({**BASE, "PSLAUNCH_MALLOC_TUNING": "Off"}).malloc_tuning


def test_an_unset_role_means_worker_unless_the_caller_requires_one():
    assert read_env(BASE).role == "worker"
    with pytest.raises(EnvError, match="DMLC_ROLE is not set"):
        read_env(BASE, default_role=None)


@pytest.mark.parametrize("name", ["DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER"])
def test_a_missing_required_variable_is_named(name):
    env = {k: v for k, v in BASE.items() if k != name}
    with pytest.raises(EnvError, match=f"{name} is not set"):
        read_env(env)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("DMLC_ROLE", "boss", "DMLC_ROLE='boss' must be one of scheduler, server, worker"),
        ("DMLC_PS_ROOT_PORT", "70000", "DMLC_PS_ROOT_PORT='70000' must be between 1 and 65535"),
        ("DMLC_PS_ROOT_PORT", "http", "DMLC_PS_ROOT_PORT='http' is not an integer"),
        ("DMLC_NUM_WORKER", "0", "DMLC_NUM_WORKER='0' must be >= 1"),
        ("DMLC_WORKER_ID", "2", "DMLC_WORKER_ID='2' must be between 0 and 1"),
        ("DMLC_LOCAL", "yes", "DMLC_LOCAL='yes' must be 0 or 1"),
        ("PS_VERBOSE", "3", "PS_VERBOSE='3' must be between 0 and 2"),
        ("PS_HEARTBEAT_TIMEOUT", "soon", "PS_HEARTBEAT_TIMEOUT='soon' is not a number"),
        ("PS_HEARTBEAT_TIMEOUT", "0.5", "PS_HEARTBEAT_TIMEOUT=0.5 must be larger than PS_HEARTBEAT_INTERVAL=1"),
        ("PSLAUNCH_BIGARRAY_BOUND", "-1", "PSLAUNCH_BIGARRAY_BOUND='-1' must be >= 1"),
        ("PSLAUNCH_SERVER_DEVICE", "tpu", "PSLAUNCH_SERVER_DEVICE='tpu' must be cpu, gpu or gpu:N"),
        ("PSLAUNCH_SAME_HOST", "carrier", "PSLAUNCH_SAME_HOST='carrier' must be shm, ipc or tcp"),
        ("PSLAUNCH_IO_SCHED", "fifo", "PSLAUNCH_IO_SCHED='fifo' must be batch or normal"),
        ("PSLAUNCH_MALLOC_TUNING", "no", "PSLAUNCH_MALLOC_TUNING='no' must be on or off"),
        ("PSLAUNCH_STREAMS", "yes", "PSLAUNCH_STREAMS='yes' must be on or off"),
        ("PSLAUNCH_LANES", "0", "PSLAUNCH_LANES='0' must be on or off"),
        ("PSLAUNCH_SUPERVISED", "yes", "PSLAUNCH_SUPERVISED='yes' must be 0 or 1"),
    ],
)
def test_a_malformed_variable_is_named_with_its_value(name, value, message):
    with pytest.raises(EnvError, match=re.escape(message)):
        read_env({**BASE, name: value})


def test_optional_variables_are_read():
    env = read_env({**BASE, "DMLC_ROLE": "Server", "DMLC_WORKER_ID": "1", "DMLC_LOCAL": "1", "PS_VERBOSE": "2",
                    "PS_HEARTBEAT_INTERVAL": "0", "PS_HEARTBEAT_TIMEOUT": "3", "PSLAUNCH_SERVER_DEVICE": "gpu:1",
                    "PSLAUNCH_JOB_ID": "j1", "PSLAUNCH_REGISTER_TIMEOUT": "5", "PSLAUNCH_BIGARRAY_BOUND": "10"})
    assert (env.role, env.worker_id, env.local, env.verbose) == ("server", 1, True, 2)
    assert (env.heartbeat_interval, env.heartbeat_timeout, env.server_device) == (0.0, 3.0, "gpu:1")
    assert (env.job_id, env.register_timeout, env.bigarray_bound) == ("j1", 5.0, 10)


def test_without_a_job_id_every_process_of_a_job_derives_the_same_one_from_the_schedulers_address():
    # a job started by hand (MXNet's five variables) has no PSLAUNCH_JOB_ID: every role must agree
    ids = {read_env({**BASE, "DMLC_ROLE": role}).job_id for role in ("scheduler", "server", "worker")}
    assert len(ids) == 1 and re.fullmatch(r"job-[0-9a-f]{8}", ids.pop())
    assert read_env({**BASE, "DMLC_PS_ROOT_URI": " 127.0.0.1 "}).job_id == read_env(BASE).job_id
    assert read_env({**BASE, "DMLC_PS_ROOT_URI": "Sched.Example"}).job_id == read_env(
        {**BASE, "DMLC_PS_ROOT_URI": "sched.example"}).job_id
    # another scheduler port or address is another job
    assert read_env({**BASE, "DMLC_PS_ROOT_PORT": "9092"}).job_id != read_env(BASE).job_id
    assert read_env({**BASE, "DMLC_PS_ROOT_URI": "127.0.0.2"}).job_id != read_env(BASE).job_id
    # the launcher's id wins
    assert read_env({**BASE, "PSLAUNCH_JOB_ID": "j1"}).job_id == "j1"


def test_under_pslaunch_registration_has_no_time_limit_even_one_set_explicitly():
    supervised = read_env({**BASE, "PSLAUNCH_SUPERVISED": "1", "PSLAUNCH_REGISTER_TIMEOUT": "5"})
    assert supervised.supervised and supervised.register_timeout == float("inf")
    alone = read_env({**BASE, "PSLAUNCH_SUPERVISED": "0", "PSLAUNCH_REGISTER_TIMEOUT": "5"})
    assert not alone.supervised and alone.register_timeout == 5.0


def test_the_advertised_host_resolves_names_and_interfaces():
    assert read_env({**BASE, "DMLC_NODE_HOST": "localhost"}).advertised_host().startswith("127.")
    assert read_env({**BASE, "DMLC_INTERFACE": "lo"}).advertised_host() == "127.0.0.1"
    with pytest.raises(EnvError, match="DMLC_INTERFACE='nosuchnic0'"):
        read_env({**BASE, "DMLC_INTERFACE": "nosuchnic0"}).advertised_host()
    with pytest.raises(EnvError, match="DMLC_NODE_HOST='no.such.host.invalid'"):
        read_env({**BASE, "DMLC_NODE_HOST": "no.such.host.invalid"}).advertised_host()


@pytest.mark.parametrize("value", ["nosuchnic0,lo", "127.0.0.0/8", "127.0.0.1/32"])
def test_dmlc_interface_is_a_list_of_names_tried_in_order_or_a_network_resolved_on_this_host(value):
    assert read_env({**BASE, "DMLC_INTERFACE": value}).advertised_host() == "127.0.0.1"


@pytest.mark.parametrize(("value", "why"), [
    ("eth0;reboot", "is not an interface name, a list of them"),
    ("10.0.0.0/40", "is not an IPv4 network"),
])
def test_a_malformed_dmlc_interface_is_refused_naming_it(value, why):
    with pytest.raises(EnvError, match=f"DMLC_INTERFACE={value!r} {why}"):
        read_env({**BASE, "DMLC_INTERFACE": value})


def test_a_dmlc_interface_that_matches_nothing_here_names_what_this_host_has():
    with pytest.raises(EnvError, match=r"DMLC_INTERFACE='192.0.0.0/29' matches no interface of .* \(here: .*lo 127.0.0.1"):
        read_env({**BASE, "DMLC_INTERFACE": "192.0.0.0/29"}).advertised_host()


def test_every_variable_psnode_reads_is_documented_in_env_md():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "env.md").read_text()
    source = (Path(__file__).resolve().parents[2] / "psnode" / "env.py").read_text()
    source += (Path(__file__).resolve().parents[2] / "psnode" / "node" / "connection.py").read_text()
    names = set(re.findall(r'"((?:DMLC|PS|PSLAUNCH)_[A-Z_]+)"', source))
    assert names, "no variable names found"
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"read by psnode but not documented in docs/env.md: {missing}"


@pytest.mark.parametrize("extra, message", [
    ({"PSLAUNCH_START_WORKERS": "1"}, "PSLAUNCH_START_WORKERS=1 below DMLC_NUM_WORKER=2 lets workers join later, which "
                                      "needs an elastic job"),
    ({"PSLAUNCH_START_WORKERS": "3"}, "PSLAUNCH_START_WORKERS='3' must be between 1 and 2"),
    ({"DMLC_NUM_WORKER": "4", "PSLAUNCH_MIN_WORKERS": "3", "PSLAUNCH_START_WORKERS": "2"},
     "PSLAUNCH_START_WORKERS=2 is below PSLAUNCH_MIN_WORKERS=3"),
])
def test_an_elastic_jobs_start_workers_is_checked_naming_the_variables(extra, message):
    with pytest.raises(EnvError, match=re.escape(message)):
        read_env({**BASE, **extra})


def test_an_elastic_job_starts_with_start_workers_and_all_of_them_by_default():
    elastic = {**BASE, "DMLC_NUM_WORKER": "4", "PSLAUNCH_MIN_WORKERS": "2"}
    assert read_env(elastic).workers_at_start == 4
    assert read_env({**elastic, "PSLAUNCH_START_WORKERS": "2"}).workers_at_start == 2
