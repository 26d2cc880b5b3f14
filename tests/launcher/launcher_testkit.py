"""Helpers shared by the launcher tests: the test sshd, pslaunch runs, process checks.

A module with its own name (not ``conftest``) so that ``from launcher_testkit import ...`` cannot
pick up another directory's conftest.
"""

from __future__ import annotations

import getpass
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

HELPERS = Path(__file__).parent / "helpers"
REPO = Path(__file__).resolve().parents[2]
LOOPBACK_HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
PSLAUNCH = [sys.executable, "-m", "launcher.cli"]


def _free_port_on_all(addresses) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind((addresses[0], 0))
            port = s.getsockname()[1]
        try:
            for addr in addresses[1:]:
                with socket.socket() as s:
                    s.bind((addr, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


@dataclass
class Sshd:
    """A running test sshd: where it listens and the key that logs in."""

    port: int
    key: str
    known_hosts: str
    user: str
    dir: Path

    def hostfile(self, path: Path, lines: list[str]) -> str:
        """Write a hostfile with ``lines`` and return its path."""
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    def ssh_flags(self) -> list[str]:
        """pslaunch flags that reach this sshd."""
        return ["--ssh-port", str(self.port), "-i", self.key, "--known-hosts", self.known_hosts,
                "--ssh-config", str(self.dir / "no_ssh_config")]


def start_sshd(d: Path, hosts: tuple[str, ...] = LOOPBACK_HOSTS, log_level: str = "ERROR",
               authorized_key: str | None = None):
    """Generator: start a real OpenSSH server on ``hosts`` with keys in ``d``, yield it, stop it.

    ``authorized_key`` (a public key line) logs in instead of the server's own ``id_user`` key;
    ``log_level`` is sshd's (its log is ``d / "sshd.log"``).
    """
    if not os.path.exists("/usr/sbin/sshd"):
        pytest.fail("/usr/sbin/sshd is missing: run scripts/test.sh (it installs openssh-server)")
    for name in ("host_key", "id_user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True, timeout=30)
    (d / "authorized_keys").write_text(authorized_key or (d / "id_user.pub").read_text())
    port = _free_port_on_all(hosts)
    listen = "\n".join(f"ListenAddress {h}" for h in hosts)
    (d / "sshd_config").write_text(f"""Port {port}
{listen}
HostKey {d / 'host_key'}
PidFile {d / 'sshd.pid'}
AuthorizedKeysFile {d / 'authorized_keys'}
PermitRootLogin yes
StrictModes no
UsePAM no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
MaxSessions 30
MaxStartups 100
Subsystem sftp internal-sftp
LogLevel {log_level}
""")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    (d / "no_ssh_config").write_text("")
    proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", str(d / "sshd_config"), "-e"],
                            stdout=subprocess.DEVNULL, stderr=open(d / "sshd.log", "wb"), start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        pending = list(hosts)
        while pending:
            if proc.poll() is not None:
                pytest.fail(f"sshd exited with {proc.returncode}: {(d / 'sshd.log').read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"sshd did not listen on {pending} port {port} within 15 s")
            try:
                with socket.create_connection((pending[0], port), timeout=1):
                    pending.pop(0)
            except OSError:
                time.sleep(0.1)
        yield Sshd(port, str(d / "id_user"), str(d / "known_hosts"), getpass.getuser(), d)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ancestors(pid: int) -> list[int]:
    """The parent, grandparent, ... of ``pid`` up to init, from /proc."""
    chain = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                pid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except OSError:
            break
        chain.append(pid)
    return chain


def cmdline(pid: int) -> str:
    """The command line of ``pid`` (empty once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def processes_with(text: str) -> list[str]:
    """Command lines of live (non-zombie) processes whose argv contains ``text``, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != b"Z":
            found.append(f"{entry}: {cmd}")
    return found


def wait_gone(text: str, timeout: float = 10.0) -> list[str]:
    """Wait until no process carries ``text``; returns what is left after ``timeout`` (empty = gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_with(text)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@dataclass
class Result:
    """A finished pslaunch run."""

    returncode: int
    stdout: str
    stderr: str


def start_pslaunch(args: list[str], cwd: str | None = None, env: dict | None = None) -> subprocess.Popen:
    """Start pslaunch with ``args`` in the background, in its own process group, its output piped.

    ``env`` (default: this process's environment) gets the repository put first on PYTHONPATH.
    The caller reaps it: see :func:`reaped`.
    """
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.Popen(PSLAUNCH + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                            env=full_env, start_new_session=True)


def wait_for_records(out: Path, count: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    """Wait until ``count`` role.py records (``*.json``) stand in ``out``: the job's processes started.

    Fails at once, with pslaunch's output, if pslaunch ends first, and after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while len(list(out.glob("*.json"))) < count:
        if proc.poll() is not None:
            raise AssertionError(f"pslaunch ended early: {proc.communicate()}")
        assert time.monotonic() < deadline, "the job's processes did not start"
        time.sleep(0.05)


@contextmanager
def reaped(proc: subprocess.Popen, marker: str):
    """Yield ``proc``; afterwards, pass or fail, kill its process group if it still runs and
    SIGKILL every process still carrying ``marker``, so that a failing test leaves nothing behind."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for line in processes_with(marker):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


def run_pslaunch(args: list[str], timeout: float = 60, cwd: str | None = None, env: dict | None = None) -> Result:
    """Run pslaunch with ``args`` in a fresh process (its own group, killed on timeout)."""
    proc = start_pslaunch(args, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"pslaunch {args} did not finish within {timeout} s:\n{out.decode()}\n{err.decode()}") from None
    return Result(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def helper(name: str) -> str:
    """Path of a helper script in tests/launcher/helpers."""
    return str(HELPERS / name)


# -- batch schedulers: a one-machine Slurm and SGE cluster in a temporary directory -------------------

def _daemon_env(extra: dict[str, str]) -> dict[str, str]:
    """A small environment for cluster daemons: what jobs inherit from them stays predictable."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def _start_daemon(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as fh:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop_daemons(procs: list[subprocess.Popen], marker: str, asked: bool = False) -> None:
    """Stop the daemons and every process whose environment carries ``marker`` (the cluster's
    conf path: job steps and shepherds the daemons started). Daemons not ``asked`` to end already
    get SIGTERM; any still there after 10 s (1 s when asked) get SIGKILL: the cluster's state is
    thrown away, nothing is lost."""
    for proc in procs:
        if proc.poll() is None and not asked:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(1 if asked else 10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in _pids_with_environ(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pids_with_environ(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if text.encode() in fh.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _wait_until(check, timeout: float, what: str, log: Path, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"{proc.args[0]} exited with {proc.returncode} while {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what} took over {timeout:g} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


@dataclass
class Cluster:
    """A running one-machine batch cluster: the environment its clients need, and its cold start."""

    kind: str
    dir: Path
    env: dict[str, str]
    node: str
    start_seconds: float

    def client_env(self, base: dict | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) plus what the cluster's clients need."""
        env = dict(os.environ if base is None else base)
        env.update(self.env)
        return env

    def tool(self, *argv: str) -> subprocess.CompletedProcess:
        """Run one of the cluster's client commands; output captured as text."""
        return subprocess.run(list(argv), env=self.client_env(), capture_output=True, text=True, timeout=30)

    def jobs(self) -> list[str]:
        """Jobs the scheduler lists as queued or running (job ids, with Slurm's steps as ``J.S``)."""
        if self.kind == "slurm":
            out = self.tool("squeue", "-h", "-o", "%i").stdout.split() + self.tool("squeue", "-h", "-s", "-o", "%i").stdout.split()
        else:
            out = [line.split()[0] for line in self.tool("qstat", "-u", "*").stdout.splitlines()[2:] if line.strip()]
        return out

    def wait_no_jobs(self, timeout: float = 20) -> list[str]:
        """Wait until no job is listed; returns those still listed after ``timeout`` (empty = none)."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.jobs()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


def _need_root(kind: str) -> None:
    # Fail, not skip: a CI machine must not pass the batch backends' tests without running them.
    if os.geteuid() != 0:
        pytest.fail(f"the {kind} test cluster needs root: its node daemon starts jobs as their user (CI runs as root)")


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("0.0.0.0", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_slurm(d: Path):
    """Generator: a Slurm 22.05 controller and node daemon for this machine, configured in ``d``
    (auth/none, 8 CPUs whatever the machine has), yielded as a ``Cluster``; stopped afterwards."""
    for daemon in ("/usr/sbin/slurmctld", "/usr/sbin/slurmd"):
        if not os.path.exists(daemon):
            pytest.fail(f"{daemon} is missing: run scripts/test.sh (it installs slurmctld, slurmd and slurm-client)")
    _need_root("Slurm")
    node = socket.gethostname()
    ctld_port, d_port = _free_ports(2)
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=pslaunchtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
SlurmctldLogFile={d / 'log' / 'slurmctld.log'}
SlurmdLogFile={d / 'log' / 'slurmd.log'}
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
ReturnToService=2
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")
    env = {"SLURM_CONF": str(conf)}
    log = d / "log" / "daemons.log"
    start = time.monotonic()
    procs = [_start_daemon(["/usr/sbin/slurmctld", "-D", "-i"], _daemon_env(env), log)]
    try:
        procs.append(_start_daemon(["/usr/sbin/slurmd", "-D"], _daemon_env(env), log))
        cluster = Cluster("slurm", d, env, node, 0.0)

        def idle() -> bool:
            res = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=cluster.client_env(), capture_output=True,
                                 text=True, timeout=30)
            return res.stdout.strip() == "idle"

        _wait_until(idle, 30, "waiting for the Slurm node to be idle", log, procs)
        cluster.start_seconds = time.monotonic() - start
        yield cluster
    finally:
        subprocess.run(["scancel", "--full", "-u", getpass.getuser()], env=_daemon_env(env), capture_output=True, timeout=30)
        _stop_daemons(procs, f"SLURM_CONF={conf}")


_SGE_BINARIES = "/usr/lib/gridengine"
_SGE_DEBIAN_ROOT = "/var/lib/gridengine"  # Debian's SGE_ROOT: bin/<arch>, utilbin/<arch>, util/


def _qconf(cluster: Cluster, flag: str, text: str) -> None:
    path = cluster.dir / f"qconf{flag}.txt"
    path.write_text(text)
    res = cluster.tool(f"{_SGE_BINARIES}/qconf", flag, str(path))
    if res.returncode != 0:
        pytest.fail(f"qconf {flag} failed: {res.stdout}{res.stderr}")


def start_sge(d: Path):
    """Generator: an SGE 8.1.9 qmaster and execd for this machine in a private cell in ``d``
    (classic spooling, an ``smp`` parallel environment with ``control_slaves TRUE``, one queue of
    8 slots, a 1 s scheduling interval), yielded as a ``Cluster``; stopped afterwards."""
    for daemon in ("sge_qmaster", "sge_execd", "spoolinit"):
        if not os.path.exists(f"{_SGE_BINARIES}/{daemon}"):
            pytest.fail(f"{_SGE_BINARIES}/{daemon} is missing: run scripts/test.sh (it installs gridengine-master, "
                        "gridengine-exec and gridengine-client)")
    _need_root("SGE")
    node = socket.gethostname()
    root, cell = d / "root", "pslaunchtest"
    common, spool, execd_spool = root / cell / "common", d / "qmaster", d / "execd"
    common.mkdir(parents=True)
    spool.mkdir()
    execd_spool.mkdir()
    for sub in ("bin", "utilbin", "lib", "util"):
        os.symlink(f"{_SGE_DEBIAN_ROOT}/{sub}", root / sub)
    qmaster_port, execd_port = _free_ports(2)
    env = {"SGE_ROOT": str(root), "SGE_CELL": cell, "SGE_QMASTER_PORT": str(qmaster_port),
           "SGE_EXECD_PORT": str(execd_port)}
    (common / "bootstrap").write_text(f"""admin_user none
default_domain none
ignore_fqdn true
spooling_method classic
spooling_lib libspoolc
spooling_params {common};{spool}
binary_path {_SGE_BINARIES}
qmaster_spool_dir {spool}
security_mode none
listener_threads 2
worker_threads 2
scheduler_threads 1
""")
    (common / "act_qmaster").write_text(node + "\n")
    # Clients reach the qmaster over 127.0.0.1, which resolves back to "localhost": without the
    # alias every request fails with "local host name error".
    (common / "host_aliases").write_text(f"{node} localhost\n")
    defaults = Path("/usr/share/gridengine/default-configuration").read_text()
    defaults = re.sub(r"(?m)^execd_spool_dir\s.*$", f"execd_spool_dir {execd_spool}", defaults)
    defaults = re.sub(r"(?m)^(min_[ug]id)\s.*$", r"\1 0", defaults)  # the tests run as root
    (d / "global.conf").write_text(defaults)
    denv = _daemon_env(env)
    log = d / "daemons.log"
    start = time.monotonic()
    for argv in (["spoolinit", "classic", "libspoolc", f"{common};{spool}", "init"],
                 ["spooldefaults", "configuration", str(d / "global.conf")],
                 ["spooldefaults", "complexes", "/usr/share/gridengine/util/resources/centry"],
                 ["spooldefaults", "usersets", "/usr/share/gridengine/util/resources/usersets"],
                 ["spooldefaults", "managers", getpass.getuser()]):
        res = subprocess.run([f"{_SGE_BINARIES}/{argv[0]}", *argv[1:]], env=denv, capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            pytest.fail(f"{' '.join(argv)} failed: {res.stdout}{res.stderr}")
    # SGE_ND keeps the daemons in the foreground: children of this process, stopped and reaped here.
    procs = [_start_daemon([f"{_SGE_BINARIES}/sge_qmaster"], dict(denv, SGE_ND="1"), log)]
    cluster = Cluster("sge", d, dict(env, PATH=f"{_SGE_BINARIES}:{os.environ.get('PATH', '')}"), node, 0.0)
    try:
        _wait_until(lambda: cluster.tool("qconf", "-sh").returncode == 0, 30, "waiting for sge_qmaster", log, procs)
        sched = re.sub(r"(?m)^schedule_interval\s.*$", "schedule_interval 0:0:1", cluster.tool("qconf", "-ssconf").stdout)
        _qconf(cluster, "-Msconf", sched)
        if cluster.tool("qconf", "-as", node).returncode != 0:
            pytest.fail(f"qconf -as {node} failed")
        _qconf(cluster, "-Ap", "pe_name smp\nslots 999\nuser_lists NONE\nxuser_lists NONE\nstart_proc_args NONE\n"
                               "stop_proc_args NONE\nallocation_rule $fill_up\ncontrol_slaves TRUE\n"
                               "job_is_first_task FALSE\nurgency_slots min\naccounting_summary FALSE\nqsort_args NONE\n")
        _qconf(cluster, "-Ae", f"hostname {node}\nload_scaling NONE\ncomplex_values NONE\nuser_lists NONE\n"
                               "xuser_lists NONE\nprojects NONE\nxprojects NONE\nusage_scaling NONE\nreport_variables NONE\n")
        limits = "".join(f"{k} INFINITY\n" for k in ("s_rt", "h_rt", "s_cpu", "h_cpu", "s_fsize", "h_fsize", "s_data",
                                                     "h_data", "s_stack", "h_stack", "s_core", "h_core", "s_rss",
                                                     "h_rss", "s_vmem", "h_vmem"))
        _qconf(cluster, "-Aq", f"qname all.q\nhostlist {node}\nseq_no 0\nload_thresholds NONE\n"
                               "suspend_thresholds NONE\nnsuspend 1\nsuspend_interval 00:05:00\npriority 0\n"
                               "min_cpu_interval 00:05:00\nprocessors UNDEFINED\nqtype BATCH INTERACTIVE\n"
                               "ckpt_list NONE\npe_list smp\nrerun FALSE\nslots 8\ntmpdir /tmp\nshell /bin/sh\n"
                               "prolog NONE\nepilog NONE\nshell_start_mode posix_compliant\nstarter_method NONE\n"
                               "suspend_method NONE\nresume_method NONE\nterminate_method NONE\nnotify 00:00:60\n"
                               "owner_list NONE\nuser_lists NONE\nxuser_lists NONE\nsubordinate_list NONE\n"
                               "complex_values NONE\nprojects NONE\nxprojects NONE\ncalendar NONE\n"
                               f"initial_state default\n{limits}")
        procs.append(_start_daemon([f"{_SGE_BINARIES}/sge_execd"], dict(denv, SGE_ND="1"), log))

        def queue_up() -> bool:  # the queue instance loses its "a(larm)"/"u(nknown)" state once execd reports
            lines = cluster.tool("qstat", "-f", "-q", "all.q").stdout.splitlines()
            row = [line.split() for line in lines if line.startswith("all.q@")]
            return bool(row) and len(row[0]) == 5
        _wait_until(queue_up, 60, "waiting for sge_execd to report", log, procs)
        cluster.start_seconds = time.monotonic() - start
        yield cluster
    finally:
        # sge_qmaster takes 10 s to end, however asked; its spool is thrown away, so it is killed
        # after a second.
        for argv in (["qdel", "-f", "-u", "*"], ["qconf", "-ke", node], ["qconf", "-km"]):
            subprocess.run([f"{_SGE_BINARIES}/{argv[0]}", *argv[1:]], env=denv, capture_output=True, timeout=30)
        _stop_daemons(procs, f"SGE_ROOT={root}", asked=True)
