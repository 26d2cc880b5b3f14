"""Reading and validating the environment contract (docs/env.md): the one place psnode reads it.

``read_env()`` returns a frozen ``NodeEnv``; a missing or malformed variable raises ``EnvError``
naming the variable and the value it had. Nothing else in psnode looks at ``os.environ`` for
contract names.

The contract also has a way back to pslaunch (docs/env.md, "Under pslaunch"): the exit code of a
node that ended because of another node, and the marker lines a supervised node writes on stderr.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Mapping

from pscontract import (
    EXIT_PEER_FAILED,
    MARKER_CAUGHT_UP,
    MARKER_FAILED,
    MARKER_FINISHED,
    MARKER_LEFT,
    MARKER_READY,
    MARKER_RESUMED,
    MARKER_STALL,
    MARKER_STATS,
    MARKER_TRACE,
    ROLES,
    TIMELINE_TO_LAUNCHER,
    binding,
    interface_address,
    interface_addresses,
    parse_interface_spec,
    shared_job_id,
)
from psnode.errors import EnvError
from psnode.transport import security

__all__ = ["NodeEnv", "read_env", "ROLES", "resolve_host", "shared_job_id", "EXIT_PEER_FAILED", "MARKER_READY", "MARKER_FAILED",
           "MARKER_RESUMED", "MARKER_CAUGHT_UP", "MARKER_FINISHED", "MARKER_STALL", "MARKER_LEFT", "MARKER_STATS", "MARKER_TRACE", "TIMELINE_TO_LAUNCHER"]

@dataclass(frozen=True)
class NodeEnv:
    """Everything a node learns from its environment (see docs/env.md for each name)."""

    role: str
    root_uri: str
    root_port: int
    num_workers: int
    num_servers: int
    node_host: str | None = None
    interface: str | None = None
    worker_id: int | None = None
    local: bool = False
    verbose: int = 0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    job_id: str = ""
    job_id_from: str = ""  # the scheduler's address as given, when the job id was derived from it
    local_rank: int = 0
    local_size: int = 1
    register_timeout: float = 60.0
    bigarray_bound: int = 1_000_000
    push_window: int = 256 << 20
    placement_timeout: float = 600.0
    server_device: str = "cpu"
    same_host: str = "shm"
    io_sched: str = "batch"
    transport: str = "zmq"
    supervised: bool = False
    job_key: bytes | None = field(default=None, repr=False)
    encrypt: bool = False
    bind_all: bool = False
    stats_interval: float = 0.0
    launch_rank: int | None = None
    timeline: str = ""
    restart_count: int = 0
    checkpoint_dir: str | None = None
    malloc_tuning: bool = True
    restart_scope: str = "job"
    lanes: bool = True
    streams: bool = True  # PSLAUNCH_STREAMS: a worker's messages to a server on a TCP stream the nodes' own threads poll
    server_replicas: int = 0  # PSLAUNCH_SERVER_REPLICAS: copies of each server's keys on other server processes
    replica: bool = False  # PSLAUNCH_SERVER_REPLICA=1: this server process is one of those copies
    stall_warn: float = 60.0  # PSLAUNCH_STALL_WARN: seconds a round or barrier waits before it is called stalled
    stall_timeout: float = 0.0  # PSLAUNCH_STALL_TIMEOUT: seconds a stalled wait may last before the job ends (0: never)
    min_workers: int = 0  # PSLAUNCH_MIN_WORKERS: an elastic job goes on with this many (0: not elastic)
    elastic_timeout: float = 60.0  # PSLAUNCH_ELASTIC_TIMEOUT: seconds with fewer than min_workers before it fails
    start_workers: int = 0  # PSLAUNCH_START_WORKERS: an elastic job's workers at its start (0: all); the rest may join
    cpu_bind: str = ""  # PSLAUNCH_CPU_BIND: the cores this process binds itself to (pscontract.binding); "": none

    @property
    def elastic(self) -> bool:
        """Whether workers may leave the running job (``PSLAUNCH_MIN_WORKERS`` below ``DMLC_NUM_WORKER``)."""
        return 0 < self.min_workers < self.num_workers

    @property
    def workers_at_start(self) -> int:
        """The workers the job starts with (``PSLAUNCH_START_WORKERS``; the others of an elastic job's
        ``DMLC_NUM_WORKER`` ranks may join later)."""
        return self.start_workers or self.num_workers

    def bind_cpus(self) -> None:
        """Bind every thread of this process to its ``PSLAUNCH_CPU_BIND`` share (once a node starts:
        a process started over ssh or by hand is bound too; pslaunch's local spawner did it already)."""
        if not self.cpu_bind or not hasattr(os, "sched_setaffinity"):
            return
        binding.bind_self(binding.resolve(self.cpu_bind))

    @property
    def root_address(self) -> str:
        """``host:port`` of the scheduler, for messages."""
        return f"{self.root_uri}:{self.root_port}"

    def advertised_host(self) -> str:
        """The address this node tells its peers (and binds): DMLC_NODE_HOST, DMLC_INTERFACE's on this
        host, or that of the interface toward the scheduler.

        Raises:
            EnvError: the name does not resolve, DMLC_INTERFACE matches nothing here, or no route
                leads to the scheduler (each message names the value and what this host has).
        """
        if self.node_host:
            return resolve_host(self.node_host, "DMLC_NODE_HOST")
        if self.interface:
            return interface_spec_address(self.interface)
        return route_address(self.root_uri, self.root_port)

    def security(self) -> security.Security:
        """How this node's connections are secured: ``curve``, ``auth`` with a job key, else ``none``."""
        if self.job_key is None:
            return security.Security("none", self.job_id)
        return security.Security("curve" if self.encrypt else "auth", self.job_id, self.job_key)

    @property
    def max_message(self) -> int:
        """The largest frame a node accepts (``ZMQ_MAXMSGSIZE``): what the job's keys need.

        A key below ``PSLAUNCH_BIGARRAY_BOUND`` elements travels whole (8 bytes an element at most);
        bigger keys travel in parts of at most 4 MiB; small values share frames of at most
        ``PACK_LIMIT``. A peer that announces a bigger frame is disconnected before it is buffered.
        """
        return max(16 << 20, 8 * self.bigarray_bound + (1 << 20))


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _required(env: Mapping[str, str], name: str, example: str) -> str:
    value = _get(env, name)
    if value is None:
        raise EnvError(f"environment variable {name} is not set; it is required (e.g. {name}={example}, see docs/env.md)")
    return value


def _int(name: str, text: str, low: int | None = None, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise EnvError(f"environment variable {name}={text!r} is not an integer") from None
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise EnvError(f"environment variable {name}={text!r} must be {bounds}")
    return value


def _float(name: str, text: str, low: float = 0.0) -> float:
    try:
        value = float(text)
    except ValueError:
        raise EnvError(f"environment variable {name}={text!r} is not a number") from None
    if not value >= low:  # also rejects nan
        raise EnvError(f"environment variable {name}={text!r} must be >= {low}")
    return value


def read_env(environ: Mapping[str, str] | None = None, default_role: str | None = "worker") -> NodeEnv:
    """Read and validate the contract from ``environ`` (``os.environ`` by default).

    ``default_role`` is the role of a process started without DMLC_ROLE (MXNet's rule: a worker);
    pass None to require the variable.

    Raises:
        EnvError: a variable is missing or malformed; the message names it and its value.
    """
    env = os.environ if environ is None else environ
    role = _get(env, "DMLC_ROLE") or default_role
    if role is None:
        raise EnvError("environment variable DMLC_ROLE is not set; it must be scheduler, server or worker")
    role = role.lower()
    if role not in ROLES:
        raise EnvError(f"environment variable DMLC_ROLE={env.get('DMLC_ROLE')!r} must be one of {', '.join(ROLES)}")
    root_uri = _required(env, "DMLC_PS_ROOT_URI", "127.0.0.1")
    root_port = _int("DMLC_PS_ROOT_PORT", _required(env, "DMLC_PS_ROOT_PORT", "9091"), 1, 65535)
    num_workers = _int("DMLC_NUM_WORKER", _required(env, "DMLC_NUM_WORKER", "2"), 1)
    # 0 servers: an allreduce job (workers and the scheduler only, kvcore.create('allreduce'))
    num_servers = _int("DMLC_NUM_SERVER", _required(env, "DMLC_NUM_SERVER", "1"), 0)
    worker_id = None
    if _get(env, "DMLC_WORKER_ID") is not None:
        worker_id = _int("DMLC_WORKER_ID", _get(env, "DMLC_WORKER_ID"), 0, num_workers - 1)
    local_text = _get(env, "DMLC_LOCAL") or "0"
    if local_text not in ("0", "1"):
        raise EnvError(f"environment variable DMLC_LOCAL={local_text!r} must be 0 or 1")
    supervised_text = _get(env, "PSLAUNCH_SUPERVISED") or "0"
    if supervised_text not in ("0", "1"):
        raise EnvError(f"environment variable PSLAUNCH_SUPERVISED={supervised_text!r} must be 0 or 1")
    supervised = supervised_text == "1"
    # Under pslaunch the launcher is the authority on liveness: it ends the job when a process dies,
    # so a slow start (a long data load before kvcore.create) must not time registration out.
    register_timeout = math.inf if supervised else _float(
        "PSLAUNCH_REGISTER_TIMEOUT", _get(env, "PSLAUNCH_REGISTER_TIMEOUT") or "60", 0.001)
    verbose = _int("PS_VERBOSE", _get(env, "PS_VERBOSE") or "0", 0, 2)
    interval = _float("PS_HEARTBEAT_INTERVAL", _get(env, "PS_HEARTBEAT_INTERVAL") or "1")
    timeout = _float("PS_HEARTBEAT_TIMEOUT", _get(env, "PS_HEARTBEAT_TIMEOUT") or "10")
    if interval > 0 and timeout <= interval:
        raise EnvError(
            f"PS_HEARTBEAT_TIMEOUT={timeout:g} must be larger than PS_HEARTBEAT_INTERVAL={interval:g}"
        )
    device = (_get(env, "PSLAUNCH_SERVER_DEVICE") or "cpu").lower()
    if not (device == "cpu" or device == "gpu" or (device.startswith("gpu:") and device[4:].isdigit())):
        raise EnvError(f"environment variable PSLAUNCH_SERVER_DEVICE={device!r} must be cpu, gpu or gpu:N")
    same_host = (_get(env, "PSLAUNCH_SAME_HOST") or "shm").lower()
    if same_host not in ("shm", "ipc", "tcp"):
        raise EnvError(f"environment variable PSLAUNCH_SAME_HOST={same_host!r} must be shm, ipc or tcp")
    io_sched = (_get(env, "PSLAUNCH_IO_SCHED") or "batch").lower()
    if io_sched not in ("batch", "normal"):
        raise EnvError(f"environment variable PSLAUNCH_IO_SCHED={io_sched!r} must be batch or normal")
    transport = _get(env, "PSLAUNCH_TRANSPORT") or "zmq"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", transport):
        raise EnvError(f"environment variable PSLAUNCH_TRANSPORT={transport!r} is not a transport name")
    encrypt_text = (_get(env, "PSLAUNCH_ENCRYPT") or "none").lower()
    if encrypt_text not in ("none", "curve"):
        raise EnvError(f"environment variable PSLAUNCH_ENCRYPT={encrypt_text!r} must be none or curve")
    malloc_text = (_get(env, "PSLAUNCH_MALLOC_TUNING") or "on").lower()
    if malloc_text not in ("on", "off"):
        raise EnvError(f"environment variable PSLAUNCH_MALLOC_TUNING={malloc_text!r} must be on or off")
    lanes_text = (_get(env, "PSLAUNCH_LANES") or "on").lower()
    if lanes_text not in ("on", "off"):
        raise EnvError(f"environment variable PSLAUNCH_LANES={lanes_text!r} must be on or off")
    streams_text = (_get(env, "PSLAUNCH_STREAMS") or "on").lower()
    if streams_text not in ("on", "off"):
        raise EnvError(f"environment variable PSLAUNCH_STREAMS={streams_text!r} must be on or off")
    bind_all_text = _get(env, "PSLAUNCH_BIND_ALL") or "0"
    if bind_all_text not in ("0", "1"):
        raise EnvError(f"environment variable PSLAUNCH_BIND_ALL={bind_all_text!r} must be 0 or 1")
    key = security.read_job_key(env) if (security.JOB_KEY in env or security.JOB_KEY_FILE in env) else security.taken_key()
    if encrypt_text == "curve" and key is None:
        raise EnvError("PSLAUNCH_ENCRYPT=curve needs a job key (PSLAUNCH_JOB_KEY or PSLAUNCH_JOB_KEY_FILE): "
                       "the encryption keys are derived from it")
    stats_interval = _float("PSLAUNCH_STATS", _get(env, "PSLAUNCH_STATS") or "0")
    timeline = _get(env, "PSLAUNCH_TIMELINE") or ""
    if timeline == TIMELINE_TO_LAUNCHER and not supervised:
        raise EnvError("PSLAUNCH_TIMELINE=- sends timeline events to pslaunch, but this process does not run under "
                       "pslaunch (PSLAUNCH_SUPERVISED is not 1); give a file path instead")
    launch_rank_text = _get(env, "PSLAUNCH_RANK")
    launch_rank = None if launch_rank_text is None else _int("PSLAUNCH_RANK", launch_rank_text, 0)
    restart_count = _int("PSLAUNCH_RESTART_COUNT", _get(env, "PSLAUNCH_RESTART_COUNT") or "0", 0)
    restart_scope = (_get(env, "PSLAUNCH_RESTART_SCOPE") or "job").lower()
    if restart_scope not in ("job", "worker"):
        raise EnvError(f"environment variable PSLAUNCH_RESTART_SCOPE={restart_scope!r} must be job or worker")
    server_replicas = _int("PSLAUNCH_SERVER_REPLICAS", _get(env, "PSLAUNCH_SERVER_REPLICAS") or "0", 0, 8)
    min_text = _get(env, "PSLAUNCH_MIN_WORKERS")
    min_workers = 0 if min_text is None else _int("PSLAUNCH_MIN_WORKERS", min_text, 1, num_workers)
    elastic_timeout = _float("PSLAUNCH_ELASTIC_TIMEOUT", _get(env, "PSLAUNCH_ELASTIC_TIMEOUT") or "60")
    if min_workers and min_workers < num_workers and (server_replicas or restart_scope == "worker"
                                                      or not num_servers):
        raise EnvError(f"PSLAUNCH_MIN_WORKERS={min_workers} makes the job elastic, which does not go with "
                       + ("PSLAUNCH_SERVER_REPLICAS" if server_replicas else "PSLAUNCH_RESTART_SCOPE=worker"
                          if restart_scope == "worker" else "a job without servers (DMLC_NUM_SERVER=0)") + " yet")
    start_text = _get(env, "PSLAUNCH_START_WORKERS")
    start_workers = 0 if start_text is None else _int("PSLAUNCH_START_WORKERS", start_text, 1, num_workers)
    if start_workers and start_workers < num_workers and not (0 < min_workers < num_workers):
        raise EnvError(f"PSLAUNCH_START_WORKERS={start_workers} below DMLC_NUM_WORKER={num_workers} lets workers join "
                       "later, which needs an elastic job (PSLAUNCH_MIN_WORKERS below DMLC_NUM_WORKER)")
    if start_workers and start_workers < min_workers:
        raise EnvError(f"PSLAUNCH_START_WORKERS={start_workers} is below PSLAUNCH_MIN_WORKERS={min_workers}: a job "
                       "starts with at least its minimum of workers")
    stall_warn = _float("PSLAUNCH_STALL_WARN", _get(env, "PSLAUNCH_STALL_WARN") or "60")
    stall_timeout = _float("PSLAUNCH_STALL_TIMEOUT", _get(env, "PSLAUNCH_STALL_TIMEOUT") or "0")
    cpu_bind = (_get(env, "PSLAUNCH_CPU_BIND") or "").strip()
    if cpu_bind:
        try:
            binding.parse(cpu_bind)
        except ValueError as exc:
            raise EnvError(f"environment variable PSLAUNCH_CPU_BIND={cpu_bind!r} is not valid: {exc}") from None
    replica_text = _get(env, "PSLAUNCH_SERVER_REPLICA") or "0"
    if replica_text not in ("0", "1"):
        raise EnvError(f"environment variable PSLAUNCH_SERVER_REPLICA={replica_text!r} must be 0 or 1")
    if replica_text == "1" and (role != "server" or not server_replicas):
        raise EnvError(f"PSLAUNCH_SERVER_REPLICA=1 names a replica of a server's keys, but this process is a {role} "
                       f"of a job with PSLAUNCH_SERVER_REPLICAS={server_replicas}; a replica is a server of a job "
                       "with PSLAUNCH_SERVER_REPLICAS of 1 or more")
    if server_replicas and not num_servers:
        raise EnvError(f"PSLAUNCH_SERVER_REPLICAS={server_replicas} keeps copies of the servers' keys, but the job has "
                       "no servers (DMLC_NUM_SERVER=0)")
    checkpoint_dir = _get(env, "PSLAUNCH_CHECKPOINT_DIR")
    if checkpoint_dir is not None:
        if "\0" in checkpoint_dir:
            raise EnvError("environment variable PSLAUNCH_CHECKPOINT_DIR holds a NUL byte")
        checkpoint_dir = os.path.abspath(os.path.expanduser(checkpoint_dir))
    node_host = _get(env, "DMLC_NODE_HOST")
    interface = _get(env, "DMLC_INTERFACE")
    if interface is not None:
        _interface_spec(interface)
    return NodeEnv(
        role=role,
        root_uri=root_uri,
        root_port=root_port,
        num_workers=num_workers,
        num_servers=num_servers,
        node_host=node_host,
        interface=interface,
        worker_id=worker_id,
        local=local_text == "1",
        verbose=verbose,
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        job_id=_get(env, "PSLAUNCH_JOB_ID") or shared_job_id(root_uri, root_port),
        job_id_from="" if _get(env, "PSLAUNCH_JOB_ID") else f"{root_uri}:{root_port}",
        local_rank=_int("PSLAUNCH_LOCAL_RANK", _get(env, "PSLAUNCH_LOCAL_RANK") or "0", 0),
        local_size=_int("PSLAUNCH_LOCAL_SIZE", _get(env, "PSLAUNCH_LOCAL_SIZE") or "1", 1),
        register_timeout=register_timeout,
        bigarray_bound=_int("PSLAUNCH_BIGARRAY_BOUND", _get(env, "PSLAUNCH_BIGARRAY_BOUND") or "1000000", 1),
        push_window=_int("PSLAUNCH_PUSH_WINDOW", _get(env, "PSLAUNCH_PUSH_WINDOW") or str(256 << 20), 0),
        placement_timeout=_float("PSLAUNCH_PLACEMENT_TIMEOUT", _get(env, "PSLAUNCH_PLACEMENT_TIMEOUT") or "600", 0.001),
        server_device=device,
        same_host=same_host,
        io_sched=io_sched,
        transport=transport,
        supervised=supervised,
        job_key=key,
        encrypt=encrypt_text == "curve",
        bind_all=bind_all_text == "1",
        # only pslaunch reads the scheduler's stats lines: by hand they would be noise on stderr
        stats_interval=stats_interval if supervised else 0.0,
        launch_rank=launch_rank,
        timeline=timeline,
        restart_count=restart_count,
        checkpoint_dir=checkpoint_dir,
        restart_scope=restart_scope,
        server_replicas=server_replicas,
        replica=replica_text == "1",
        stall_warn=stall_warn,
        stall_timeout=stall_timeout,
        min_workers=min_workers if min_workers < num_workers else 0,
        elastic_timeout=elastic_timeout,
        start_workers=start_workers,
        cpu_bind=cpu_bind,
        malloc_tuning=malloc_text == "on",
        lanes=lanes_text == "on",
        streams=streams_text == "on",
    )


def resolve_host(host: str, variable: str = "host") -> str:
    """Resolve a host name to an IPv4 address (an address is returned as it is).

    Raises:
        EnvError: the name does not resolve; the message names ``variable`` and the host.
    """
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise EnvError(f"{variable}={host!r} does not resolve to an address: {exc}") from exc


def _interface_spec(text: str) -> list[str] | ipaddress.IPv4Network:
    """DMLC_INTERFACE's value, parsed by the contract's one parser.

    Raises:
        EnvError: neither interface names nor an IPv4 network (the message names the value).
    """
    try:
        return parse_interface_spec(text)
    except ValueError as exc:
        raise EnvError(f"environment variable DMLC_INTERFACE={text!r} {exc}") from None


def interface_spec_address(text: str) -> str:
    """The address DMLC_INTERFACE picks on this host: the first listed interface it has, or its
    address inside the network.

    Raises:
        EnvError: the value is malformed, or nothing here matches it (naming what this host has).
    """
    here = interface_addresses()
    found = interface_address(_interface_spec(text), here)
    if found is None:
        known = ", ".join(f"{n} {a}" for n, a in here.items())
        raise EnvError(f"DMLC_INTERFACE={text!r} matches no interface of {socket.gethostname()} (here: {known})")
    return found


def route_address(root_uri: str, root_port: int) -> str:
    """The local address the kernel would use to reach the scheduler (no packet is sent).

    Raises:
        EnvError: the scheduler's name does not resolve, or no route leads there.
    """
    root = resolve_host(root_uri, "DMLC_PS_ROOT_URI")
    if root.startswith("127."):
        return root
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.connect((root, root_port))
        return sock.getsockname()[0]
    except OSError as exc:
        raise EnvError(f"no route from {socket.gethostname()} to the scheduler at {root_uri}:{root_port} "
                       f"(DMLC_PS_ROOT_URI): {exc.strerror or exc}") from exc
    finally:
        sock.close()
