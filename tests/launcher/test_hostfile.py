"""The hostfile parser: format, merging and errors that name file, line, text and expectation."""

from __future__ import annotations

import pytest

from launcher import Host, HostfileError, parse_hostfile, parse_hostfile_text

pytestmark = pytest.mark.unit


def test_parses_users_ports_slots_comments_blank_lines_and_ipv6():
    text = """
# cluster
node1                      # defaults
alice@node2:2222 slots=4
[fe80::1]:2200 slots=2
bob@[::1]
fe80::2
10.0.0.7:22   slots=1
"""
    assert parse_hostfile_text(text) == [
        Host("node1"),
        Host("node2", "alice", 2222, 4),
        Host("fe80::1", None, 2200, 2),
        Host("::1", "bob", None, None),
        Host("fe80::2"),
        Host("10.0.0.7", None, 22, 1),
    ]


def test_repeated_host_lines_add_their_slots():
    assert parse_hostfile_text("a slots=2\na slots=3\nb\n") == [Host("a", slots=5), Host("b")]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("node1:abc", "ssh port 'abc' is not a number in 1..65535"),
        ("node1:70000", "ssh port '70000' is not a number"),
        ("node1 slots=0", "slots must be a whole number >= 1, got '0'"),
        ("node1 slots=x", "slots must be a whole number >= 1, got 'x'"),
        ("node1 cpus=4", "unexpected 'cpus=4'"),
        ("[fe80::1:2200", "'[' without ']'"),
        ("[node1]:22", "'node1' in brackets is not an IPv6 address"),
        ("no/slash", "'no/slash' is not a host name or address"),
        ("bad user@node1", "unexpected 'user@node1'"),
        ("fe80:::zz", "is not an IPv6 address; write [addr]:port for a port"),
    ],
)
def test_bad_line_error_names_file_line_number_text_and_expectation(tmp_path, line, expected):
    path = tmp_path / "hosts"
    path.write_text(f"# ok\ngood-host\n{line}\n")
    with pytest.raises(HostfileError) as info:
        parse_hostfile(path)
    message = str(info.value)
    assert message.startswith(f"{path}:3: {line!r}: ")
    assert expected in message


def test_every_malformed_line_is_named_not_only_the_first(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("good-host\nnode1 cpus=4\nnode2:70000\nnode3 slots=2\nno/slash\n")
    with pytest.raises(HostfileError) as info:
        parse_hostfile(path)
    expected = "expected '[user@]host[:sshport] [slots=N]'"
    assert str(info.value) == (
        f"{path}: 3 malformed lines: {path}:2: 'node1 cpus=4': unexpected 'cpus=4'; {expected}; "
        f"{path}:3: 'node2:70000': ssh port '70000' is not a number in 1..65535; "
        f"{path}:5: 'no/slash': 'no/slash' is not a host name or address; {expected}")


def test_empty_hostfile_and_missing_file_are_errors_naming_the_path(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(HostfileError, match=f"{empty}: no hosts"):
        parse_hostfile(empty)
    with pytest.raises(HostfileError, match="cannot read hostfile .*missing"):
        parse_hostfile(tmp_path / "missing")


def test_hosts_example_parses(tmp_path):
    from testkit.launcher import REPO

    hosts = parse_hostfile(REPO / "hosts.example")
    assert hosts and all(isinstance(h, Host) for h in hosts)
