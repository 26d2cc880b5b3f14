"""One validation for every option and every backend: an option the chosen backend has no use for is
refused before anything starts, naming the backend and the option (the same check for --dry-run as
for a real run), and an option it uses is accepted. The table below is the contract."""

from __future__ import annotations

import pytest

from launcher.backends import get_backend
from launcher.cli import build_config, cli
from launcher.errors import ConfigError

pytestmark = pytest.mark.unit

BACKENDS = ("local", "ssh", "mpi", "slurm", "sge", "ray", "agents")
#: What a backend needs to be chosen at all (the agents: --nnodes and its rendezvous).
CHOSEN_BY = {"agents": ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29400"]}

# option -> its arguments ({hosts}, {key} filled in per test)
OPTIONS = {
    "-H": ["-H", "{hosts}"],
    "--sync-dst-dir": ["--sync-dst-dir", "/tmp/job"],
    "--ssh-port": ["--ssh-port", "2222"],
    "--ssh-user": ["--ssh-user", "bob"],
    "-i": ["-i", "{key}"],
    "--ssh-config": ["--ssh-config", "/dev/null"],
    "--known-hosts": ["--known-hosts", "/dev/null"],
    "--host-key-policy": ["--host-key-policy", "strict"],
    "--link-timeout": ["--link-timeout", "5"],
    "--scheduler-host": ["--scheduler-host", "node1"],
    "--slurm-args": ["--slurm-args", "--partition=debug"],
    "--sge-args": ["--sge-args", "-q all.q"],
    "--sge-pe": ["--sge-pe", "mpi"],
    "--ray-address": ["--ray-address", "10.0.0.1:6379"],
    "--ray-strategy": ["--ray-strategy", "pack"],
    "--ray-worker-resources": ["--ray-worker-resources", '{{"CPU": 2, "GPU": 1}}'],  # braces doubled: .format
    "--ray-server-resources": ["--ray-server-resources", '{{"CPU": 2}}'],
    "--ray-timeout": ["--ray-timeout", "30"],
    "--ray-exclude": ["--ray-exclude", "data/", "--ray-exclude", "*.ckpt"],
    "--restart-scope worker": ["--restart-scope", "worker", "--max-restarts", "1", "--allow-restart-from-scratch"],
    "--server-replicas": ["--server-replicas", "1"],
}
RAY_OPTIONS = ("--ray-address", "--ray-strategy", "--ray-worker-resources", "--ray-server-resources", "--ray-timeout",
               "--ray-exclude")
SSH_OPTIONS = ("--ssh-port", "--ssh-user", "-i", "--ssh-config", "--known-hosts", "--host-key-policy", "--link-timeout")

# what each backend accepts; every other option of OPTIONS is refused
ACCEPTS = {
    "local": {"--restart-scope worker", "--server-replicas"},
    "ssh": {"-H", "--sync-dst-dir", *SSH_OPTIONS, "--scheduler-host", "--restart-scope worker", "--server-replicas"},
    "mpi": {"-H", "--sync-dst-dir", *SSH_OPTIONS, "--scheduler-host"},
    "slurm": {"--slurm-args"},
    "sge": {"--sge-args", "--sge-pe"},
    "ray": {"--sync-dst-dir", *RAY_OPTIONS, "--restart-scope worker", "--server-replicas"},
    "agents": {"--link-timeout", "--restart-scope worker", "--server-replicas"},
}


def _configure(backend: str, args: list[str]):
    """What pslaunch checks before anything starts (a real run and --dry-run alike)."""
    ctx = cli.make_context("pslaunch", [*args, *CHOSEN_BY.get(backend, []), "--launcher", backend, "-n", "2", "true"])
    config = build_config(ctx.params, {})
    return get_backend(backend).configure(config, {})


# the backends' classes, not their names: a test parametrized with the name "ssh" would join the
# tests that need the suite's sshd (tests/conftest.py), and nothing here connects anywhere
@pytest.mark.parametrize("backend_cls", [get_backend(name) for name in BACKENDS], ids=BACKENDS)
@pytest.mark.parametrize("option", OPTIONS)
def test_each_backend_accepts_the_options_it_uses_and_refuses_the_others_naming_both(backend_cls, option, tmp_path):
    backend = backend_cls.name
    hosts = tmp_path / "hosts"
    hosts.write_text("node1\nnode2\n")
    key = tmp_path / "id_key"
    key.write_text("not a real key\n")
    args = [a.format(hosts=hosts, key=key) for a in OPTIONS[option]]
    if backend == "ssh" and option != "-H":
        args += ["-H", str(hosts)]  # the ssh backend always needs its hosts
    if option in ACCEPTS[backend]:
        _configure(backend, args)
    else:
        with pytest.raises(ConfigError) as refused:
            _configure(backend, args)
        message = str(refused.value)
        named = {"-i": "--identity", "--restart-scope worker": "--restart-scope worker"}.get(option, option)
        assert named in message, message
        assert f"--launcher {backend}" in message or {"slurm": "Slurm", "sge": "SGE"}.get(backend, "?") in message, message


def test_a_refusal_says_why():
    with pytest.raises(ConfigError, match=r"-H/--hostfile is not an option of --launcher local: the local backend "
                                          r"runs every process on this machine"):
        _configure("local", ["-H", "/etc/hostname"])


@pytest.mark.parametrize("backend_cls", [get_backend(name) for name in BACKENDS], ids=BACKENDS)
def test_the_ssh_pre_flight_timeout_is_an_option_of_the_backends_that_use_ssh_only(backend_cls):
    # --connect-timeout is one of the ssh group's options (LaunchConfig.ssh): the backends that reach
    # no host over ssh refuse it with the others of the group, naming why
    backend = backend_cls.name
    args = ["--connect-timeout", "3"] + (["-H", "/etc/hostname"] if backend in ("ssh", "mpi") else [])
    if backend in ("ssh", "mpi"):
        assert _configure(backend, args).ssh.connect_timeout == 3
    else:
        with pytest.raises(ConfigError, match=rf"--connect-timeout is not an option of --launcher {backend}: \w"):
            _configure(backend, args)


def test_an_option_of_another_backends_group_names_the_backend_that_reads_it():
    with pytest.raises(ConfigError, match="--sge-pe is not an option of --launcher slurm: it is read by --launcher "
                                          "sge only"):
        _configure("slurm", ["--sge-pe", "mpi"])
