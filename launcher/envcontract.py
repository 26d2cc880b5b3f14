"""The launcher's side of the environment contract of docs/env.md.

This is the only launcher module that knows the variable names. ``contract_env`` builds the
variables one process of the job gets; the names are module constants so a test can hold this
module and the runtime's reader (``psnode/env.py``) together. The way back is here too: the exit
code of a node that ended because of another (``EXIT_PEER_FAILED``) and the marker lines a
supervised process writes on stderr (docs/env.md, "Under pslaunch").
"""

from __future__ import annotations

__all__ = [
    "DMLC_ROLE",
    "DMLC_PS_ROOT_URI",
    "DMLC_PS_ROOT_PORT",
    "DMLC_NUM_WORKER",
    "DMLC_NUM_SERVER",
    "DMLC_NODE_HOST",
    "DMLC_INTERFACE",
    "DMLC_WORKER_ID",
    "DMLC_LOCAL",
    "PS_VERBOSE",
    "PSLAUNCH_JOB_ID",
    "PSLAUNCH_LOCAL_RANK",
    "PSLAUNCH_LOCAL_SIZE",
    "PSLAUNCH_RANK",
    "PSLAUNCH_SUPERVISED",
    "EXIT_PEER_FAILED",
    "MARKER",
    "MARKER_READY",
    "MARKER_FAILED",
    "ROLES",
    "REQUIRED",
    "WRITTEN",
    "contract_env",
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
PSLAUNCH_SUPERVISED = "PSLAUNCH_SUPERVISED"

#: Exit code of a node that ended because another node failed or the job was torn down.
EXIT_PEER_FAILED = 75
#: Start of a control line on a process's stderr (also written by the guard and ``mpi_rank``).
MARKER = "\x1fPSLAUNCH-"
#: A bundled node handles SIGUSR1 (end normally) and SIGTERM from here on.
MARKER_READY = MARKER + "READY"
#: A worker printed the traceback of its own uncaught error.
MARKER_FAILED = MARKER + "FAILED"

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
    DMLC_WORKER_ID,
)


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
) -> dict[str, str]:
    """Return the contract variables of one process as a new ``{name: value}`` dict of strings.

    Pure: reads nothing from the launcher's own environment. Raises ``ValueError`` for a role
    outside ``ROLES``.
    """
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
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
        PSLAUNCH_SUPERVISED: "1",
    }
    if role == "worker":
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
    return env
