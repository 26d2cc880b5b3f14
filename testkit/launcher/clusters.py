"""Batch schedulers for the tests: a one-machine Slurm and SGE cluster in a temporary directory.

Started as root (their node daemons start jobs as the job's user), touching nothing in /etc; their
clients find them through the environment ``Cluster.env`` gives.
"""

from __future__ import annotations

import getpass
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.processes import reap

__all__ = ["Cluster", "start_slurm", "start_sge"]


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
    reap(procs, grace=1 if asked else 10, term=not asked)
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


    def back_in_service(self, timeout: float = 60) -> str | None:
        """Slurm: resume the node when an earlier test left it drained or down, and wait until it is
        idle; returns what Slurm gave as the reason (None: it was in service).

        A job step that does not end within slurmd's ``UnkillableStepTimeout`` after its cancel has
        slurmctld drain the node ("Kill task failed"), and every later job then waits for it: one
        test's failure would fail every Slurm test after it. SGE keeps no such state between jobs."""
        if self.kind != "slurm":
            return None
        state, _, reason = self.tool("sinfo", "-h", "-N", "-o", "%T|%E").stdout.strip().partition("|")
        if not any(word in state for word in ("drain", "down", "fail")):
            return None
        self.tool("scancel", "--full", "-u", getpass.getuser())
        self.tool("scontrol", "update", f"NodeName={self.node}", "State=RESUME")
        _wait_until(lambda: self.tool("sinfo", "-h", "-N", "-o", "%T").stdout.strip() == "idle", timeout,
                    f"waiting for the Slurm node {self.node}, {state} ({reason}), to be idle after its resume",
                    self.dir / "log" / "daemons.log", [])
        return f"{state}: {reason}"


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
    # Each job's scratch directory is <tmpdir>/<job>.<task>.<queue>, and every cluster numbers its
    # jobs from 1: in a /tmp shared with other clusters (an earlier run's, another session's) a job
    # could find its directory taken ("can't start job 1: can't open tmpdir /tmp/1.1.all.q").
    job_tmp = d / "jobtmp"
    job_tmp.mkdir()
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
                               "ckpt_list NONE\npe_list smp\nrerun FALSE\nslots 8\n"
                               f"tmpdir {job_tmp}\nshell /bin/sh\n"
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
