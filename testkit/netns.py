"""A simulated cluster on one machine: network namespaces as hosts, joined by bridges.

    with NetnsCluster(nics=("eth0", "ens5", "eth0"), compute=True) as cluster:
        cluster.address("h1")                       # 198.18.N.11, h1's management address
        cluster.address("h2", "compute")            # 198.19.N.12, h2's compute-only address
        cluster.launcher_address                    # 198.18.N.1, this (the root) namespace's
        argv = cluster.run_in("h1", [...])          # argv that starts inside h1
        cluster.cut("h2"); cluster.restore("h2")    # h2's links down, then up again
        cluster.join("compute")                     # the launching host on the compute network too
        cluster.shape("1gbit")                      # tc tbf on every host link, each way

For the launcher's tests (a real sshd in each namespace, alias hostfiles, a second network, a link
dropped mid-job) and for the capped-link benchmark. Layout, with N a /24 picked free per run:

* the **management network** 198.18.N.0/24: a bridge in the root namespace holding 198.18.N.1 (the
  launching host), and one veth pair per host, host ``hI`` at 198.18.N.(10+I) on an interface
  named by ``nics`` (hosts' interface names may differ, as on real clusters);
* with ``compute``, a **compute network** 198.19.N.0/24 on a second bridge, each host's ``ib0`` at
  198.19.N.(10+I); the root namespace is on it only with ``launcher_on_compute``;
* ``join`` / ``leave``: the root namespace's address on a network, for a while.

Safety: addresses come from 198.18.0.0/15 (RFC 2544's benchmarking range) only, and before anything
else the root namespace gets ``ip route add unreachable 198.18.0.0/15``, so no packet for the range
can leave the machine through its real routes. ``close`` (also on an exception) kills what runs
in the namespaces and deletes them and the bridges; it removes the route once nothing of the range
is left on the machine (other runs may hold links at the same time). A run that was killed outright
leaves its namespaces behind: the next one sweeps those of processes that no longer exist. Needs
root (CAP_NET_ADMIN) and iproute2. Thread-safe: no; one owner.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator, Sequence

__all__ = ["NetnsCluster", "NetnsError", "BENCH_RANGE", "usable", "sweep_stale", "process_alive"]

#: The only addresses a cluster uses, unreachable from the root namespace but for its bridges.
BENCH_RANGE = "198.18.0.0/15"
_NS_PREFIX = "pslnet-"
_LOCK_PATH = "/run/pslnet-setup.lock"  # one per machine, as the namespaces are
_STALE_NS = re.compile(rf"^{_NS_PREFIX}(\d+)[a-z]-h\d+\b")
_STALE_LINK = re.compile(r"^\d+: (pn(\d+)[a-z]-[0-9a-z]+)[@:]")
_made = itertools.count()  # clusters made by this process: each gets a letter of its own


class NetnsError(RuntimeError):
    """The cluster could not be set up or changed; the message names the command and its error."""


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check)


def _batch(options: list[str], lines: list[str]) -> None:
    proc = subprocess.run(["ip", *options, "-batch", "-"], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, timeout=30)
    if proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(options)} -batch` exited {proc.returncode}: {proc.stderr.strip()}")


def usable() -> str | None:
    """None when this machine can make namespaces (root, iproute2); otherwise why not, as a sentence."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "network namespaces need iproute2's `ip` and `tc` (scripts/test.sh installs iproute2)"
    name = f"{_NS_PREFIX}{os.getpid()}-h0probe"
    made = _ip("netns", "add", name, check=False)
    _ip("netns", "del", name, check=False)
    return None if made.returncode == 0 else f"cannot make a network namespace: {made.stderr.strip()}"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a killed run's process may stay one)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _kill_namespace(name: str) -> None:
    """SIGKILL every process in namespace ``name``, then delete it."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if process_alive(int(p))]
        time.sleep(0.02)
    _ip("netns", "del", name, check=False)
    shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)  # files a test mounted into it


def sweep_stale() -> None:
    """Delete the namespaces and links of clusters whose process is gone (a run killed outright)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        match = _STALE_NS.match(line)
        if match and not process_alive(int(match.group(1))):
            _kill_namespace(line.split()[0])
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        match = _STALE_LINK.match(line)
        if match and not process_alive(int(match.group(2))):
            _ip("link", "del", match.group(1), check=False)


def _range_in_use() -> bool:
    """Whether anything on this machine still uses the range: a namespace of any run, an address."""
    if any(line.startswith(("psl", "pslbench")) for line in _ip("netns", "list", check=False).stdout.splitlines()):
        return True
    net = ipaddress.ip_network(BENCH_RANGE)
    for found in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", _ip("-4", "-o", "addr", "show", check=False).stdout):
        if ipaddress.ip_address(found) in net:
            return True
    return False


@contextlib.contextmanager
def _setup_lock() -> Iterator[None]:
    """Held while a cluster picks its subnet and makes its links (an flock: a killed holder frees it)."""
    with open(_LOCK_PATH, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _free_subnet() -> int:
    """A third octet N with neither 198.18.N.0/24 nor 198.19.N.0/24 on this namespace's interfaces or
    in its routes (a cluster without the launcher on its compute network holds only a route there)."""
    addresses = _ip("-4", "-o", "addr", "show", check=False).stdout
    routes = _ip("-4", "route", "show", check=False).stdout
    used = {int(m) for m in re.findall(r"inet 198\.1[89]\.(\d+)\.", addresses)}
    used |= {int(m) for m in re.findall(r"\b198\.1[89]\.(\d+)\.\d+/24\b", routes)}
    start = os.getpid() % 250
    for step in range(250):
        octet = 1 + (start + step) % 250
        if octet not in used:
            return octet
    raise NetnsError("every 198.18.N.0/24 is in use on this machine")


class NetnsCluster:
    """Hosts ``h1``...``hK`` (K = ``len(nics)``) as network namespaces; see the module docstring."""

    def __init__(self, nics: Sequence[str] = ("eth0", "ens5", "eth0"), compute: bool = False,
                 launcher_on_compute: bool = False) -> None:
        self.nics = tuple(nics)
        self.compute = compute
        self.launcher_on_compute = launcher_on_compute
        # the process id (a killed run's leftovers are found by it) and a letter per cluster
        self.tag = f"{os.getpid()}{'abcdefghijklmnopqrstuvwxyz'[next(_made) % 26]}"
        self.hosts = [f"h{i + 1}" for i in range(len(self.nics))]
        self.octet = 0
        self._route_added = False
        self._namespaces: list[str] = []
        self._links: list[str] = []  # root-side interfaces (bridges, veth ends) this cluster made
        self._routes: list[str] = []  # this cluster's own unreachable routes

    # -- names and addresses ---------------------------------------------------------------------
    def namespace(self, host: str) -> str:
        """The network namespace's name of ``host``."""
        return f"{_NS_PREFIX}{self.tag}-{host}"

    def _dev(self, suffix: str) -> str:
        return f"pn{self.tag}-{suffix}"  # at most 15 characters: pn + 7 digits + a letter + - + 3

    def address(self, host: str, network: str = "management") -> str:
        """``host``'s address on ``network`` (``management`` or ``compute``)."""
        index = self.hosts.index(host) + 1
        return f"198.{18 if network == 'management' else 19}.{self.octet}.{10 + index}"

    def nic(self, host: str, network: str = "management") -> str:
        """The interface name ``host`` has on ``network``."""
        return self.nics[self.hosts.index(host)] if network == "management" else "ib0"

    @property
    def launcher_address(self) -> str:
        """The root namespace's (the launching host's) address on the management network."""
        return f"198.18.{self.octet}.1"

    def subnet(self, network: str = "management") -> str:
        """``network`` as a CIDR."""
        return f"198.{18 if network == 'management' else 19}.{self.octet}.0/24"

    def run_in(self, host: str, argv: Sequence[str], hostname: bool = False) -> list[str]:
        """``argv`` started inside ``host`` (``ip netns exec`` execs it: the pid stays the program's);
        with ``hostname``, also in a UTS namespace of its own named ``host`` (as a real host's
        programs see their own host name: Open MPI tells its daemons apart by it)."""
        named = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host] if hostname else []
        return ["ip", "netns", "exec", self.namespace(host), *named, *argv]

    def describe(self) -> str:
        """One line for reports."""
        nets = f"management {self.subnet()}" + (f", compute {self.subnet('compute')}" if self.compute else "")
        return (f"{len(self.hosts)} network namespaces ({', '.join(self.namespace(h) for h in self.hosts)}) on "
                f"bridges: {nets}; {BENCH_RANGE} unreachable from the root namespace")

    # -- life cycle --------------------------------------------------------------------------------
    def __enter__(self) -> "NetnsCluster":
        why = usable()
        if why is not None:
            raise NetnsError(why)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        # First of all: nothing addressed to the range may leave through the machine's real routes.
        added = _ip("route", "add", "unreachable", BENCH_RANGE, check=False)
        if added.returncode != 0 and "File exists" not in added.stderr:  # present: another run's
            raise NetnsError(f"`ip route add unreachable {BENCH_RANGE}` exited {added.returncode}: {added.stderr.strip()}")
        self._route_added = True
        # Choosing a free /24 and taking it must be one step: test processes set clusters up side by
        # side, and two that chose the same one collide on its route ("File exists").
        with _setup_lock():
            sweep_stale()
            self.octet = _free_subnet()
            self._make_links()

    def _make_links(self) -> None:
        networks = ["management"] + (["compute"] if self.compute else [])
        # Two batches of `ip` (one in the root namespace, one in each host's) keep the set-up short.
        root: list[str] = []
        for network in networks:
            bridge = self._dev(f"b{network[0]}")
            root.append(f"link add {bridge} type bridge")
            self._links.append(bridge)
            if network == "management" or self.launcher_on_compute:
                root.append(f"addr add 198.{18 if network == 'management' else 19}.{self.octet}.1/24 dev {bridge}")
            root.append(f"link set {bridge} up")
        inside: dict[str, list[str]] = {}
        for index, host in enumerate(self.hosts, start=1):
            ns = self.namespace(host)
            _ip("netns", "add", ns)
            self._namespaces.append(ns)
            inside[ns] = ["link set lo up"]
            for network in networks:
                outer, nic = self._dev(f"{index}{network[0]}"), self.nic(host, network)
                root.append(f"link add {outer} type veth peer name {nic} netns {ns}")
                self._links.append(outer)
                root.append(f"link set {outer} master {self._dev(f'b{network[0]}')}")
                root.append(f"link set {outer} up")
                inside[ns] += [f"addr add {self.address(host, network)}/24 dev {nic}", f"link set {nic} up"]
        if self.compute and not self.launcher_on_compute:
            # This run's own guard: the range's route is shared with other runs, one may remove it.
            root.append(f"route add unreachable {self.subnet('compute')}")
            self._routes.append(self.subnet("compute"))
        _batch([], root)
        for ns, lines in inside.items():
            _batch(["-n", ns], lines)

    def join(self, network: str) -> str:
        """Put the root namespace (the launching host) on ``network`` too; returns its address there."""
        address = f"198.{18 if network == 'management' else 19}.{self.octet}.1"
        if self.subnet(network) in self._routes:
            _ip("route", "del", "unreachable", self.subnet(network), check=False)
        _ip("addr", "replace", f"{address}/24", "dev", self._dev(f"b{network[0]}"))
        return address

    def leave(self, network: str) -> None:
        """Take the root namespace's address off ``network`` (undoes ``join``)."""
        address = f"198.{18 if network == 'management' else 19}.{self.octet}.1"
        _ip("addr", "del", f"{address}/24", "dev", self._dev(f"b{network[0]}"), check=False)
        if self.subnet(network) in self._routes:
            _ip("route", "add", "unreachable", self.subnet(network), check=False)

    def _outer(self, host: str, network: str | None = None) -> list[str]:
        index = self.hosts.index(host) + 1
        networks = ("m", "c")[: 2 if self.compute else 1]
        return [self._dev(f"{index}{n}") for n in networks if network is None or n == network[0]]

    def cut(self, host: str, network: str | None = None) -> None:
        """Take ``host``'s links down (its cables pulled; only the one to ``network`` when given)."""
        for dev in self._outer(host, network):
            _ip("link", "set", dev, "down")

    def restore(self, host: str, network: str | None = None) -> None:
        """Bring ``host``'s links back up (only the one to ``network`` when given)."""
        for dev in self._outer(host, network):
            _ip("link", "set", dev, "up")

    def link_bytes(self, host: str) -> tuple[int, int]:
        """``(sent, received)``: the bytes ``host`` has sent and received on its management link so
        far (its veth's counters seen from the bridge's side, frames' headers included)."""
        stats = Path("/sys/class/net") / self._outer(host, "management")[0] / "statistics"
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def shape(self, rate: str, burst: str = "1mb", latency: str = "50ms") -> None:
        """Cap every host link at ``rate`` (a tc rate: ``1gbit``) each way with a token bucket."""
        for host in self.hosts:
            for dev, network in zip(self._outer(host), ("management", "compute")):
                for prefix in ([], ["-n", self.namespace(host)]):
                    name = dev if not prefix else self.nic(host, network)
                    _run(["tc", *prefix, "qdisc", "replace", "dev", name, "root", "tbf", "rate", rate, "burst", burst,
                          "latency", latency])

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them and the bridges; idempotent."""
        for ns in reversed(self._namespaces):
            _kill_namespace(ns)
        self._namespaces = []
        for dev in reversed(self._links):
            _ip("link", "del", dev, check=False)  # a veth's end in a deleted namespace took the pair with it
        self._links = []
        for subnet in self._routes:
            _ip("route", "del", "unreachable", subnet, check=False)
        self._routes = []
        if self._route_added and not _range_in_use():
            _ip("route", "del", "unreachable", BENCH_RANGE, check=False)
        self._route_added = False
