"""testkit.netns_link: a tc-shaped veth link between two real network namespaces, and nothing of it
left behind, whether the block ends, raises, or its process is killed.

Needs root and iproute2 (scripts/test.sh installs it); skipped where namespaces cannot be made.
Other runs on the machine may hold links of their own at the same time, so checks look at this
test's namespaces by name and at the route only when no other run's namespaces exist.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from testkit.netns_link import BENCH_NET, RateLimitedLink


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) for network namespaces"
    try:
        name = f"pslprobe-{os.getpid()}"
        made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=10)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"iproute2 is not usable: {exc}"
    return None if made.returncode == 0 else f"cannot make a network namespace: {made.stderr.strip()}"


_UNUSABLE = _can_make_namespaces()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_UNUSABLE is not None, reason=str(_UNUSABLE))]

SERVER = textwrap.dedent("""
    import socket, sys
    srv = socket.create_server((sys.argv[1], 0))
    print(srv.getsockname()[1], flush=True)
    conn, peer = srv.accept()
    total = 0
    while chunk := conn.recv(1 << 16):
        total += len(chunk)
    print(total, peer[0], flush=True)
""")
CLIENT = "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2])), 10); s.sendall(bytes(1 << 20)); s.close()"


def _others_hold_links(mine: set[str]) -> bool:
    return any(re.match(r"pslbench-\d+-[ab]$", ns) and ns not in mine for ns in _namespaces())


def _route_present() -> bool:
    out = subprocess.run(["ip", "route", "show", "type", "unreachable"], capture_output=True, text=True, timeout=10).stdout
    return BENCH_NET in out


def test_the_link_carries_tcp_between_its_namespaces_and_its_range_is_unreachable_from_the_root_namespace():
    with RateLimitedLink("100mbit") as link:
        mine = set(link.namespaces.values())
        assert mine <= set(_namespaces()) and _route_present()
        server = subprocess.Popen(link.run_in("a", [sys.executable, "-c", SERVER, link.address("a")]),
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = server.stdout.readline().strip()
            subprocess.run(link.run_in("b", [sys.executable, "-c", CLIENT, link.address("a"), port]), check=True,
                           timeout=30)
            assert server.stdout.readline().split() == [str(1 << 20), link.address("b")]
        finally:
            server.kill()
            server.wait(10)
        # from the root namespace the range goes nowhere: no route to the link's addresses
        with pytest.raises(OSError):
            socket.create_connection((link.address("a"), int(port)), timeout=5)
        assert "tbf" in subprocess.run(["tc", "-n", link.namespaces["a"], "qdisc", "show"], capture_output=True,
                                       text=True, timeout=10).stdout
    assert not mine & set(_namespaces())
    if not _others_hold_links(mine):
        assert not _route_present()


def test_the_link_is_removed_when_its_block_raises():
    link = RateLimitedLink()
    with pytest.raises(RuntimeError, match="boom"):
        with link:
            raise RuntimeError("boom")
    assert not set(link.namespaces.values()) & set(_namespaces())


def test_namespaces_of_a_killed_run_are_removed_by_the_next_run():
    code = ("import sys, time; from testkit.netns_link import RateLimitedLink; "
            "link = RateLimitedLink().__enter__(); print(' '.join(link.namespaces.values()), flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        left = set(child.stdout.readline().split())
    finally:
        child.kill()  # no cleanup can run
        child.wait(10)
    assert len(left) == 2 and left <= set(_namespaces())
    with RateLimitedLink():
        assert not left & set(_namespaces())
