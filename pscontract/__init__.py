"""The environment contract of docs/env.md, in one module both sides import.

The launcher writes it (``contract_env``, from its plan), the runtime reads it (``psnode.env``, which
validates each value), and the test kits and benchmarks build their jobs' environments with it. Here
are the variable names, the way back to pslaunch (the exit code of a node that ended because of
another, ``EXIT_PEER_FAILED``, and the marker lines a supervised process writes on stderr), the
rule that gives a job started by hand its id (``shared_job_id``) and the one parser of an interface
spec (``--interface`` / ``DMLC_INTERFACE``). Standard library only: importing it loads neither
ZeroMQ nor numpy, so the launcher does not depend on the runtime, nor the runtime on the launcher.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import random
import re
import socket
import stat
from collections.abc import Mapping

__all__ = [
    "CUDA_VISIBLE_DEVICES",
    "DMLC_INTERFACE",
    "DMLC_LOCAL",
    "DMLC_NODE_HOST",
    "DMLC_NUM_SERVER",
    "DMLC_NUM_WORKER",
    "DMLC_PS_ROOT_PORT",
    "DMLC_PS_ROOT_URI",
    "DMLC_ROLE",
    "DMLC_WORKER_ID",
    "EXIT_PEER_FAILED",
    "JOB_KEY_BYTES",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MARKER",
    "MARKER_CAUGHT_UP",
    "MARKER_FAILED",
    "MARKER_FINISHED",
    "MARKER_STALL",
    "MARKER_LEFT",
    "MARKER_JOINED",
    "MARKER_PREEMPTED",
    "EXIT_PREEMPTED",
    "preempt_signal",
    "runtime_signals",
    "ignore_runtime_signals",
    "stack_signal",
    "MARKER_READY",
    "MARKER_RESUMED",
    "MARKER_STATS",
    "MARKER_TRACE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "PSLAUNCH_BIGARRAY_BOUND",
    "PSLAUNCH_PUSH_WINDOW",
    "PSLAUNCH_PLACEMENT_TIMEOUT",
    "PSLAUNCH_BIND_ALL",
    "PSLAUNCH_CHECKPOINT_DIR",
    "PSLAUNCH_ENCRYPT",
    "PSLAUNCH_IO_SCHED",
    "PSLAUNCH_JOB_ID",
    "PSLAUNCH_JOB_KEY",
    "PSLAUNCH_JOB_KEY_FD",
    "PSLAUNCH_JOB_KEY_FILE",
    "PSLAUNCH_LOCAL_RANK",
    "PSLAUNCH_LOCAL_SIZE",
    "PSLAUNCH_RANK",
    "PSLAUNCH_REGISTER_TIMEOUT",
    "PSLAUNCH_RESTART_COUNT",
    "PSLAUNCH_RESTART_SCOPE",
    "PSLAUNCH_SERVER_REPLICA",
    "PSLAUNCH_SERVER_REPLICAS",
    "PSLAUNCH_MIN_WORKERS",
    "PSLAUNCH_ELASTIC_TIMEOUT",
    "PSLAUNCH_START_WORKERS",
    "PSLAUNCH_STALL_WARN",
    "PSLAUNCH_STALL_TIMEOUT",
    "PSLAUNCH_CPU_BIND",
    "PSLAUNCH_SAME_HOST",
    "PSLAUNCH_SERVER_DEVICE",
    "PSLAUNCH_STATS",
    "PSLAUNCH_SUPERVISED",
    "PSLAUNCH_TIMELINE",
    "PSLAUNCH_TRANSPORT",
    "PS_HEARTBEAT_INTERVAL",
    "PS_HEARTBEAT_TIMEOUT",
    "PS_VERBOSE",
    "RANK",
    "REQUIRED",
    "RESTART_SCOPES",
    "ROLES",
    "SETTINGS",
    "TIMELINE_TO_LAUNCHER",
    "TORCH",
    "WORLD_SIZE",
    "WRITTEN",
    "JobKeyError",
    "contract_env",
    "free_port",
    "hand_key_over",
    "PSLAUNCH_NODE_RANK",
    "JOB_COMPLETION_INDEX",
    "interface_address",
    "interface_addresses",
    "new_job_key",
    "parse_interface_spec",
    "read_job_key",
    "shared_job_id",
    "torch_env",
    "with_restart_count",
]

DMLC_ROLE = "DMLC_ROLE"
DMLC_PS_ROOT_URI = "DMLC_PS_ROOT_URI"
DMLC_PS_ROOT_PORT = "DMLC_PS_ROOT_PORT"
DMLC_NUM_WORKER = "DMLC_NUM_WORKER"
DMLC_NUM_SERVER = "DMLC_NUM_SERVER"
DMLC_NODE_HOST = "DMLC_NODE_HOST"
DMLC_INTERFACE = "DMLC_INTERFACE"
DMLC_WORKER_ID = "DMLC_WORKER_ID"
DMLC_LOCAL = "DMLC_LOCAL"
PS_VERBOSE = "PS_VERBOSE"
PSLAUNCH_JOB_ID = "PSLAUNCH_JOB_ID"
PSLAUNCH_LOCAL_RANK = "PSLAUNCH_LOCAL_RANK"
PSLAUNCH_LOCAL_SIZE = "PSLAUNCH_LOCAL_SIZE"
PSLAUNCH_RANK = "PSLAUNCH_RANK"
PS_HEARTBEAT_INTERVAL = "PS_HEARTBEAT_INTERVAL"
PS_HEARTBEAT_TIMEOUT = "PS_HEARTBEAT_TIMEOUT"
PSLAUNCH_REGISTER_TIMEOUT = "PSLAUNCH_REGISTER_TIMEOUT"
PSLAUNCH_SAME_HOST = "PSLAUNCH_SAME_HOST"
PSLAUNCH_IO_SCHED = "PSLAUNCH_IO_SCHED"
PSLAUNCH_SERVER_DEVICE = "PSLAUNCH_SERVER_DEVICE"
PSLAUNCH_BIGARRAY_BOUND = "PSLAUNCH_BIGARRAY_BOUND"
#: Bytes of big pushes a server lets in at once (``psnode.server.invitations``); 0: no limit.
PSLAUNCH_PUSH_WINDOW = "PSLAUNCH_PUSH_WINDOW"
#: Seconds a worker waits for worker 0 to place a key it inits (``kvcore.stores.placement_book``).
PSLAUNCH_PLACEMENT_TIMEOUT = "PSLAUNCH_PLACEMENT_TIMEOUT"
PSLAUNCH_TRANSPORT = "PSLAUNCH_TRANSPORT"
PSLAUNCH_ENCRYPT = "PSLAUNCH_ENCRYPT"
PSLAUNCH_BIND_ALL = "PSLAUNCH_BIND_ALL"
PSLAUNCH_STATS = "PSLAUNCH_STATS"
PSLAUNCH_TIMELINE = "PSLAUNCH_TIMELINE"
#: ``PSLAUNCH_TIMELINE`` value that sends timeline events to pslaunch (``MARKER_TRACE`` lines).
TIMELINE_TO_LAUNCHER = "-"
#: Where servers write checkpoints (``kvcore.elastic.State.commit``); absolute.
PSLAUNCH_CHECKPOINT_DIR = "PSLAUNCH_CHECKPOINT_DIR"
#: ``job`` or ``worker``: what pslaunch restarts after a failure (``worker``: a failed worker alone).
PSLAUNCH_RESTART_SCOPE = "PSLAUNCH_RESTART_SCOPE"
#: How many times pslaunch restarted the job (or this worker) before this start: 0 on the first.
PSLAUNCH_RESTART_COUNT = "PSLAUNCH_RESTART_COUNT"
#: How many other servers' processes hold a copy of each server's keys (0: none): ``--server-replicas``.
PSLAUNCH_SERVER_REPLICAS = "PSLAUNCH_SERVER_REPLICAS"
#: An elastic job (``-n MIN:MAX``): the fewest workers it goes on with; DMLC_NUM_WORKER is then MAX.
PSLAUNCH_MIN_WORKERS = "PSLAUNCH_MIN_WORKERS"
#: Seconds an elastic job with fewer than PSLAUNCH_MIN_WORKERS workers waits for more before it fails.
PSLAUNCH_ELASTIC_TIMEOUT = "PSLAUNCH_ELASTIC_TIMEOUT"
#: The workers an elastic job starts with (MIN..DMLC_NUM_WORKER); the other ranks are free for workers
#: that join the running job.
PSLAUNCH_START_WORKERS = "PSLAUNCH_START_WORKERS"
#: Seconds a ``dist_sync`` round or a barrier may wait before the job says it is stalled, and on whom
#: (``--stall-warn``; 0: never).
PSLAUNCH_STALL_WARN = "PSLAUNCH_STALL_WARN"
PSLAUNCH_STALL_TIMEOUT = "PSLAUNCH_STALL_TIMEOUT"
#: The cores a process binds itself to, ``cores:I:N``, ``numa:I:N`` or ``list:CPUS`` (``pscontract.binding``).
PSLAUNCH_CPU_BIND = "PSLAUNCH_CPU_BIND"
#: ``1`` on a server process that is a replica (it holds another server's keys until that one is lost).
PSLAUNCH_SERVER_REPLICA = "PSLAUNCH_SERVER_REPLICA"
#: The values ``PSLAUNCH_RESTART_SCOPE`` takes.
RESTART_SCOPES = ("job", "worker")
#: The job's secret: passed like a secret ``--env`` value (never in a plan's printed environment).
PSLAUNCH_JOB_KEY = "PSLAUNCH_JOB_KEY"
PSLAUNCH_JOB_KEY_FILE = "PSLAUNCH_JOB_KEY_FILE"
#: What a process started by pslaunch gets instead of ``PSLAUNCH_JOB_KEY``: the number of an
#: inherited file descriptor from which the runtime reads the key once (``hand_key_over``).
PSLAUNCH_JOB_KEY_FD = "PSLAUNCH_JOB_KEY_FD"
#: A per-node agent's rank when ``--node-rank`` is not given (``pslaunch --nnodes``); then
#: Kubernetes' own, which an Indexed Job sets in every pod.
PSLAUNCH_NODE_RANK = "PSLAUNCH_NODE_RANK"
JOB_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"

#: The runtime's optional settings (docs/env.md, "Optional"): ``contract_env(settings=...)`` writes them.
SETTINGS = (
    PS_HEARTBEAT_INTERVAL,
    PS_HEARTBEAT_TIMEOUT,
    PSLAUNCH_REGISTER_TIMEOUT,
    PSLAUNCH_SAME_HOST,
    PSLAUNCH_IO_SCHED,
    PSLAUNCH_SERVER_DEVICE,
    PSLAUNCH_BIGARRAY_BOUND,
    PSLAUNCH_PUSH_WINDOW,
    PSLAUNCH_PLACEMENT_TIMEOUT,
    PSLAUNCH_TRANSPORT,
    PSLAUNCH_ENCRYPT,
    PSLAUNCH_BIND_ALL,
    PSLAUNCH_STATS,
    PSLAUNCH_TIMELINE,
    PSLAUNCH_CHECKPOINT_DIR,
    PSLAUNCH_RESTART_SCOPE,
    PSLAUNCH_SERVER_REPLICAS,
    PSLAUNCH_MIN_WORKERS,
    PSLAUNCH_ELASTIC_TIMEOUT,
    PSLAUNCH_START_WORKERS,
    PSLAUNCH_STALL_WARN,
    PSLAUNCH_STALL_TIMEOUT,
)
PSLAUNCH_SUPERVISED = "PSLAUNCH_SUPERVISED"

#: Exit code of a node that ended because another node failed or the job was torn down.
EXIT_PEER_FAILED = 75
#: Start of a control line on a process's stderr (also written by the guard and ``mpi_rank``).
MARKER = "\x1fPSLAUNCH-"
#: A bundled node handles SIGUSR1 (end normally) and SIGTERM from here on.
MARKER_READY = MARKER + "READY"
#: A worker printed the traceback of its own uncaught error.
MARKER_FAILED = MARKER + "FAILED"
#: A worker replaced in place found its predecessor's last mark (``--restart-scope worker``,
#: ``dist_sync``): a JSON object follows, ``{"mark": id or null, "scalars": {...} or null}``.
MARKER_RESUMED = MARKER + "RESUMED"
#: That replacement sent its first push its predecessor had not: the rounds it owed go on.
MARKER_CAUGHT_UP = MARKER + "CAUGHT-UP"
#: The scheduler took a worker's finish: its part of the training is done (its pushes and pulls are
#: all in). A worker killed after this is not replaced: the job's rounds no longer wait for it.
MARKER_FINISHED = MARKER + "FINISHED"
#: A server, the scheduler or a worker found a round, a barrier or a collective stalled
#: (``PSLAUNCH_STALL_WARN``, ``PSLAUNCH_STALL_TIMEOUT``): a JSON object follows, ``{"node": "server 1",
#: "text": the sentence its log says, "workers": the ranks it waits for, "fatal": past the timeout}``.
MARKER_STALL = MARKER + "STALL"
#: A worker of an elastic job left it at a step boundary (SIGTERM): it exits 0 and is no failure.
MARKER_LEFT = MARKER + "LEFT"
#: A worker joined a running elastic job: a JSON object follows, ``{"rank": its rank, "start": the
#: round it counts from, "workers": the members now}``.
MARKER_JOINED = MARKER + "JOINED"
#: Worker 0, told the job is preempted (``preempt_signal``), committed a checkpoint: a JSON object
#: follows, ``{"checkpoint": id, "scalars": {...}}``; it then exits ``EXIT_PREEMPTED``.
MARKER_PREEMPTED = MARKER + "PREEMPTED"
#: The exit code of a job (and of its worker 0) that was preempted after committing a checkpoint:
#: running the same command again resumes from it.
EXIT_PREEMPTED = 85

def preempt_signal() -> int:
    """The signal on which worker 0 of the bundled runtime commits a checkpoint at its next step
    boundary and exits ``EXIT_PREEMPTED`` (``kvcore.preempting``): pslaunch sends it when it is
    itself told to stop (SIGTERM) and the job keeps checkpoints."""
    import signal

    return int(signal.SIGRTMIN) + 3


def runtime_signals() -> tuple[int, ...]:
    """The signals pslaunch sends that the bundled runtime handles itself: ``stack_signal`` and
    ``preempt_signal``."""
    return stack_signal(), preempt_signal()


def ignore_runtime_signals() -> None:
    """Ignore ``runtime_signals`` in this process, and so in every process it starts (an ignored
    signal stays ignored across ``exec``), until the runtime there installs its handlers: such a
    signal that comes first (a stack asked of a worker still importing its libraries) then does
    nothing, where a real-time signal's default action would end the process. A signal this process
    already handles is left alone; only the main thread can change a signal's disposition, so from
    another thread this does nothing."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for signum in runtime_signals():
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_IGN)


def stack_signal() -> int:
    """The signal on which a worker of the bundled runtime writes every thread's Python stack to its
    stderr (``faulthandler``): pslaunch sends it to a worker that stalled rounds wait for."""
    import signal

    return int(signal.SIGRTMIN) + 2


#: The scheduler's periodic line of the job's counters (``PSLAUNCH_STATS``): a JSON object follows.
MARKER_STATS = MARKER + "STATS"
#: Timeline events of a node (``PSLAUNCH_TIMELINE=-``): a JSON array of trace events follows.
MARKER_TRACE = MARKER + "TRACE"

#: torch.distributed's names (its ``env://`` rendezvous, as torchrun sets them), written for every
#: worker so that a plain torch script runs under pslaunch as under torchrun (docs/env.md).
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
#: ``--gpus-per-worker K``: the GPUs of one worker, by its local rank.
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: torchrun's restart names, which torch scripts read to resume (the count is ``PSLAUNCH_RESTART_COUNT``).
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCH = (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, CUDA_VISIBLE_DEVICES,
         TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID)

#: The three roles, in the order the launcher starts them.
ROLES = ("scheduler", "server", "worker")

#: Variables every process gets (docs/env.md, "Required").
REQUIRED = (DMLC_ROLE, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_WORKER, DMLC_NUM_SERVER)

#: Every variable this module may write.
WRITTEN = REQUIRED + (
    DMLC_NODE_HOST,
    DMLC_INTERFACE,
    DMLC_LOCAL,
    PS_VERBOSE,
    PSLAUNCH_JOB_ID,
    PSLAUNCH_LOCAL_RANK,
    PSLAUNCH_LOCAL_SIZE,
    PSLAUNCH_RANK,
    PSLAUNCH_SUPERVISED,
    PSLAUNCH_RESTART_COUNT,
    DMLC_WORKER_ID,
    PSLAUNCH_JOB_KEY,
    PSLAUNCH_JOB_KEY_FD,
) + SETTINGS + TORCH


def with_restart_count(env: Mapping[str, str], count: int) -> dict[str, str]:
    """A copy of one process's contract ``env`` for its start after ``count`` restarts of the job
    (a worker's torchrun name too)."""
    out = dict(env)
    out[PSLAUNCH_RESTART_COUNT] = str(count)
    if TORCHELASTIC_RESTART_COUNT in out:
        out[TORCHELASTIC_RESTART_COUNT] = str(count)
    return out


def new_job_key() -> str:
    """A fresh job key: 32 random bytes from the operating system, as 64 hex digits."""
    import secrets

    return secrets.token_hex(32)


def contract_env(
    *,
    role: str,
    root_uri: str,
    root_port: int,
    num_workers: int,
    num_servers: int,
    job_id: str,
    rank: int,
    local_rank: int,
    local_size: int,
    node_host: str | None = None,
    interface: str | None = None,
    all_local: bool = False,
    verbose: int = 0,
    fixed_rank: bool = True,
    supervised: bool = True,
    restart_count: int = 0,
    settings: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Return the contract variables of one process as a new ``{name: value}`` dict of strings.

    ``fixed_rank``: a worker's runtime rank is ``rank`` (``DMLC_WORKER_ID``); False leaves it to the
    scheduler. ``supervised``: pslaunch watches the process (``PSLAUNCH_SUPERVISED``); False for a job
    started as by hand (the test kit). ``restart_count``: how many restarts came before this start
    (``PSLAUNCH_RESTART_COUNT``). ``settings``: values for names of ``SETTINGS`` (heartbeats,
    same-host path, checkpoint directory ...).

    Pure: reads nothing from the caller's own environment. Raises ``ValueError`` for a role outside
    ``ROLES`` or a setting outside ``SETTINGS`` (naming it).
    """
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    unknown = sorted(set(settings or ()) - set(SETTINGS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)} is not a setting of the contract; the settings are {', '.join(SETTINGS)}")
    env = {
        DMLC_ROLE: role,
        DMLC_PS_ROOT_URI: root_uri,
        DMLC_PS_ROOT_PORT: str(root_port),
        DMLC_NUM_WORKER: str(num_workers),
        DMLC_NUM_SERVER: str(num_servers),
        PSLAUNCH_JOB_ID: job_id,
        PSLAUNCH_RANK: str(rank),
        PSLAUNCH_LOCAL_RANK: str(local_rank),
        PSLAUNCH_LOCAL_SIZE: str(local_size),
        PSLAUNCH_RESTART_COUNT: str(restart_count),
    }
    if supervised:
        env[PSLAUNCH_SUPERVISED] = "1"
    if role == "worker" and fixed_rank:
        # A fixed rank makes the runtime's rank the launcher's: `[worker.1@host]` is kv.rank 1.
        env[DMLC_WORKER_ID] = str(rank)
    if node_host:
        env[DMLC_NODE_HOST] = node_host
    if interface:
        env[DMLC_INTERFACE] = interface
    if all_local:
        env[DMLC_LOCAL] = "1"
    if verbose:
        env[PS_VERBOSE] = str(verbose)
    env.update({name: str(value) for name, value in (settings or {}).items()})
    return env


def torch_env(*, rank: int, world_size: int, local_rank: int, local_world_size: int,
              master: tuple[str, int] | None = None, gpus_per_worker: int | None = None,
              max_restarts: int = 0, run_id: str = "") -> dict[str, str]:
    """torch.distributed's variables of one worker (torchrun's meaning): its ``RANK`` among the
    ``WORLD_SIZE`` workers, its ``LOCAL_RANK`` among the ``LOCAL_WORLD_SIZE`` workers of its host;
    with ``master`` ``MASTER_ADDR`` and ``MASTER_PORT``, where worker 0's process group listens (every
    worker gets them, whatever ``-s``: a plain torch script runs with servers too); with ``gpus_per_worker`` K, ``CUDA_VISIBLE_DEVICES`` = the K GPUs from
    ``local_rank * K``; torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 on the first start),
    ``TORCHELASTIC_MAX_RESTARTS`` and ``TORCHELASTIC_RUN_ID`` (the job id). Pure."""
    env = {RANK: str(rank), WORLD_SIZE: str(world_size), LOCAL_RANK: str(local_rank),
           LOCAL_WORLD_SIZE: str(local_world_size), TORCHELASTIC_RESTART_COUNT: "0",
           TORCHELASTIC_MAX_RESTARTS: str(max_restarts), TORCHELASTIC_RUN_ID: run_id}
    if master is not None:
        env[MASTER_ADDR], env[MASTER_PORT] = master[0], str(master[1])
    if gpus_per_worker:
        first = local_rank * gpus_per_worker
        env[CUDA_VISIBLE_DEVICES] = ",".join(str(g) for g in range(first, first + gpus_per_worker))
    return env


def hand_key_over(env: dict[str, str]) -> int | None:
    """Move the job key out of the environment ``env`` of a process about to start: into a new
    pipe, whose read end the child inherits (its number in ``PSLAUNCH_JOB_KEY_FD``). Returns that
    read end for the spawner to pass (``pass_fds``) and close once the child started; None when
    ``env`` holds no key.

    So the key is in no process's environment (``/proc/PID/environ``) and no child of the user's
    command finds it there; the runtime reads it from the pipe once (``psnode.transport.security``)
    and a command that never starts the runtime never reads it. The pipe holds 65 bytes, far below
    any pipe's buffer, so writing it never blocks.
    """
    key = env.pop(PSLAUNCH_JOB_KEY, None)
    if key is None:
        return None
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, key.encode() + b"\n")
    finally:
        os.close(write_end)
    env[PSLAUNCH_JOB_KEY_FD] = str(read_end)
    return read_end


#: A job key's length: 32 bytes, written as 64 hex digits.
JOB_KEY_BYTES = 32


class JobKeyError(ValueError):
    """A job key that cannot be used (malformed, unreadable, readable by others); the message
    names the variable and the file, never the key."""


def read_job_key(environ: Mapping[str, str]) -> bytes | None:
    """The job key from ``PSLAUNCH_JOB_KEY`` or the file ``PSLAUNCH_PSLAUNCH_JOB_KEY_FILE`` names, or None.

    Raises:
        JobKeyError: a malformed key, two of the variables set, or a key file that is not a regular file of
            mode 0600 (or stricter) owned by this user. The message never contains the key.
    """
    text = environ.get(PSLAUNCH_JOB_KEY, "").strip()
    path = environ.get(PSLAUNCH_JOB_KEY_FILE, "").strip()
    fd = environ.get(PSLAUNCH_JOB_KEY_FD, "").strip()
    given = [name for name, value in ((PSLAUNCH_JOB_KEY, text), (PSLAUNCH_JOB_KEY_FILE, path), (PSLAUNCH_JOB_KEY_FD, fd)) if value]
    if len(given) > 1:
        raise JobKeyError(f"{' and '.join(given)} are all set; set one of them")
    source = PSLAUNCH_JOB_KEY
    if path:
        source = f"{PSLAUNCH_JOB_KEY_FILE}={path}"
        text = _read_key_file(path)
    elif fd:
        source = f"{PSLAUNCH_JOB_KEY_FD}={fd}"
        text = _read_key_pipe(fd)
    if not text:
        return None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise JobKeyError(f"the job key in {source} is not hexadecimal (it must be {2 * JOB_KEY_BYTES} hex digits)") from None
    if len(key) != JOB_KEY_BYTES:
        raise JobKeyError(f"the job key in {source} has {len(key)} bytes; it must have {JOB_KEY_BYTES} ({2 * JOB_KEY_BYTES} hex digits)")
    return key


def _read_key_pipe(number: str) -> str:
    """The key pslaunch wrote into the pipe whose read end is file descriptor ``number`` (its
    ``hand_key_over``): read to its end and closed, so it is read once."""
    try:
        fd = int(number)
    except ValueError:
        raise JobKeyError(f"{PSLAUNCH_JOB_KEY_FD}={number!r} is not a file descriptor number") from None
    chunks = []
    try:
        while sum(map(len, chunks)) < 4096:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError as exc:
        raise JobKeyError(f"{PSLAUNCH_JOB_KEY_FD}={fd} cannot be read: {exc.strerror}; the key is read once, by the first "
                       "import of kvcore or psnode in the process pslaunch started") from None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    return b"".join(chunks).decode(errors="replace").strip()


def _read_key_file(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise JobKeyError(f"{PSLAUNCH_JOB_KEY_FILE}={path} cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise JobKeyError(f"{PSLAUNCH_JOB_KEY_FILE}={path} is not a regular file")
        if info.st_mode & 0o077:
            raise JobKeyError(f"{PSLAUNCH_JOB_KEY_FILE}={path} has mode {stat.S_IMODE(info.st_mode):04o}; others may read it "
                           "(chmod 600 it)")
        if info.st_uid != os.geteuid():
            raise JobKeyError(f"{PSLAUNCH_JOB_KEY_FILE}={path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()})")
        return os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` right now, for a scheduler to bind soon (``DMLC_PS_ROOT_PORT``).

    Not the kernel's pick (a bind to port 0): that lies in the ephemeral range, from which the kernel
    also takes the source port of every outgoing connection, so between the pick and the scheduler's
    bind another process's connection could take it ("Address already in use", seen with two jobs
    starting at once on a busy host). A port below that range is only ever taken by an explicit
    bind, and a random one of 16,384 rarely by another job picking at the same moment.
    """
    low = _ephemeral_low()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    for _ in range(64):
        port = random.randrange(max(1024, low - 16384), low)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, port))
            except OSError:
                continue  # in use (or reserved): try another
        return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:  # a crowded range: the kernel's pick after all
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > 2048 else 32768


#: The names of this machine's loopback that a by-hand job may spell its scheduler's address with.
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", "127.0.0.1", "::1"})


def shared_job_id(root_uri: str, root_port: int | str) -> str:
    """The job id every process of a job started without ``PSLAUNCH_JOB_ID`` derives alike.

    What all of them share is the scheduler's address and port, so the id is a digest of those:
    ``job-`` and 8 hex digits of the SHA-256 of ``uri:port`` (the uri trimmed and lower-cased, so
    ``Node1`` and ``node1`` agree, and the loopback's names, ``localhost``, ``127.0.0.1`` and ``::1``,
    all read ``127.0.0.1``). Two by-hand jobs on different scheduler ports get different ids.
    """
    uri = root_uri.strip().lower()
    if uri in _LOOPBACK_NAMES:
        uri = "127.0.0.1"
    return "job-" + hashlib.sha256(f"{uri}:{root_port}".encode()).hexdigest()[:8]


_INTERFACE_NAME = r"[A-Za-z0-9_.:-]{1,15}"  # Linux's IFNAMSIZ less the NUL; ASCII only


def parse_interface_spec(text: str) -> list[str] | ipaddress.IPv4Network:
    """An interface spec (``--interface`` / ``DMLC_INTERFACE``): names tried in order (``ib0,eth0``)
    or an IPv4 network (``10.1.0.0/16``).

    Raises ``ValueError`` whose message is what is wrong, to follow the value: the caller writes
    ``--interface 'x' `` or ``DMLC_INTERFACE='x' `` before it.
    """
    text = text.strip()
    if "/" in text:
        try:
            return ipaddress.IPv4Network(text, strict=False)
        except ValueError as exc:
            raise ValueError(f"is not an IPv4 network ({exc}); give a network such as 10.1.0.0/16") from None
    names = [n.strip() for n in text.split(",")]
    wrong = next((name for name in names if not re.fullmatch(_INTERFACE_NAME, name)), None)
    if wrong is not None:
        reason = "is not an interface name, a list of them (ib0,eth0) or an IPv4 network (10.1.0.0/16)"
        raise ValueError(reason if len(names) == 1 else f"{reason}: {wrong!r} is not a name")
    return names


def interface_addresses() -> dict[str, str]:
    """This machine's interfaces that have an IPv4 address: ``{name: address}`` (Linux)."""
    import fcntl
    import struct

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_address(spec: list[str] | ipaddress.IPv4Network, addresses: Mapping[str, str]) -> str | None:
    """The address ``spec`` (from ``parse_interface_spec``) picks among ``addresses``: the first
    listed interface present, or the first address inside the network; None when nothing matches."""
    if isinstance(spec, ipaddress.IPv4Network):
        return next((a for a in addresses.values() if ipaddress.IPv4Address(a) in spec), None)
    return next((addresses[n] for n in spec if n in addresses), None)
