"""Addresses: what --interface means, and the scheduler's address when hosts are remote (never a
loopback one; an error naming the candidates instead). Pure, but for the kernel's routing table."""

from __future__ import annotations

import ipaddress

import pytest

from launcher.errors import ConfigError
from launcher.planning.network import choose_scheduler_address, parse_interface, route_source
from pscontract import interface_address

pytestmark = pytest.mark.unit

HERE = {"lo": "127.0.0.1", "eth0": "10.9.9.9", "ib0": "172.16.4.2"}


@pytest.mark.parametrize(("text", "picked"), [
    ("eth0", "10.9.9.9"),
    ("ib1,ib0,eth0", "172.16.4.2"),  # the first listed that this host has
    ("172.16.0.0/16", "172.16.4.2"),
    ("10.9.9.0/24", "10.9.9.9"),
    ("ens5", None),
    ("192.168.0.0/16", None),
])
def test_an_interface_is_a_name_a_list_tried_in_order_or_a_network(text, picked):
    assert interface_address(parse_interface(text), HERE) == picked


@pytest.mark.parametrize(("text", "why"), [
    ("eth0;reboot", r"'eth0;reboot' is not an interface name"),
    ("eth0,,ib0", r"'eth0,,ib0' is not an interface name.*'' is not a name"),
    ("10.1.0.0/33", r"not an IPv4 network"),
])
def test_a_malformed_interface_is_an_error_naming_it(text, why):
    with pytest.raises(ConfigError, match=why):
        parse_interface(text)


def test_a_host_that_is_this_machine_keeps_the_job_on_loopback():
    assert choose_scheduler_address([("localhost", "localhost"), ("127.0.0.2", "127.0.0.2")], None,
                                    lambda: HERE) == ("127.0.0.1", False)


def test_a_remote_host_gives_the_source_address_of_the_route_toward_its_real_name():
    # An alias resolved through ssh config's HostName: the route to 10.1.2.3, not to "node1".
    address, remote = choose_scheduler_address([("node1", "10.1.2.3")], None, lambda: HERE)
    assert remote and address == route_source("10.1.2.3") and not ipaddress.ip_address(address).is_loopback


def test_the_route_toward_the_hosts_wins_over_the_interface_given_which_serves_when_no_host_has_a_route():
    # The nodes' --interface may name an interface this machine has on another network.
    assert choose_scheduler_address([("node1", "10.1.2.3")], "ib0", lambda: HERE)[0] == route_source("10.1.2.3")
    behind_bastion = [("node1", "no-such-host.invalid")]
    assert choose_scheduler_address(behind_bastion, "ib0", lambda: HERE) == ("172.16.4.2", True)
    assert choose_scheduler_address(behind_bastion, "172.16.0.0/16", lambda: HERE) == ("172.16.4.2", True)


def test_a_host_whose_name_does_not_resolve_is_named_with_its_hostfile_line():
    hosts = [("127.0.0.2", "127.0.0.2"), ("node1", "no-such-host.invalid")]
    with pytest.raises(ConfigError) as info:
        choose_scheduler_address(hosts, None, lambda: HERE, where={"node1": "hosts:3"})
    text = str(info.value)
    assert text.startswith("hosts:3: host node1 (no-such-host.invalid) does not resolve on this machine: unknown name")
    assert "--scheduler-host HOST or --interface NAME" in text


def test_without_any_usable_address_the_launch_stops_naming_what_was_tried_and_the_candidates():
    with pytest.raises(ConfigError) as info:
        choose_scheduler_address([("node1", "no-such-host.invalid")], "lo", lambda: HERE)
    text = str(info.value)
    assert "a loopback address would send every node to its own machine" in text
    assert "--interface lo: a loopback address here" in text
    assert "node1 (no-such-host.invalid): unknown name" in text
    assert "This machine's addresses: eth0 10.9.9.9, ib0 172.16.4.2." in text and "lo 127" not in text
    assert "--interface NAME or --interface NETWORK" in text and "--scheduler-host" in text
