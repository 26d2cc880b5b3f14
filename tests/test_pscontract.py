"""The launcher's side of docs/env.md: every name it writes is documented, the required ones match."""

from __future__ import annotations

import re
import socket

import pytest

import pscontract as ec
from testkit.launcher import REPO

pytestmark = pytest.mark.unit


def _doc_names(section: str) -> list[str]:
    text = (REPO / "docs" / "env.md").read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([A-Z_]+)` \|", body, flags=re.M)


def test_every_written_name_is_in_the_contract_and_required_ones_match():
    documented = set(_doc_names("Required")) | set(_doc_names("Optional (ps-lite names)")) | set(
        _doc_names("pslaunch's own names")) | set(_doc_names("The job key")) | set(_doc_names("For torch.distributed"))
    assert set(ec.WRITTEN) <= documented
    assert set(ec.REQUIRED) == set(_doc_names("Required"))


def test_contract_env_writes_required_names_with_string_values():
    env = ec.contract_env(role="server", root_uri="10.0.0.1", root_port=9091, num_workers=4, num_servers=2,
                          job_id="j", rank=1, local_rank=0, local_size=1, interface="eth0", verbose=2)
    assert env[ec.DMLC_ROLE] == "server" and env[ec.DMLC_PS_ROOT_PORT] == "9091"
    assert env[ec.DMLC_INTERFACE] == "eth0" and env[ec.PS_VERBOSE] == "2"
    assert all(isinstance(v, str) for v in env.values())
    assert set(ec.REQUIRED) <= set(env)


def test_a_free_port_for_the_scheduler_lies_below_the_kernels_ephemeral_range_and_can_be_bound():
    # the kernel takes outgoing connections' source ports from the ephemeral range: a port picked
    # there could be taken by any connection before the scheduler binds it
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        low = int(fh.read().split()[0])
    for _ in range(20):
        port = ec.free_port()
        assert 1024 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_picked():
    held = []
    try:
        for _ in range(200):  # hold many ports of the range: a port picked again would fail to bind
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", ec.free_port()))
    finally:
        for sock in held:
            sock.close()
