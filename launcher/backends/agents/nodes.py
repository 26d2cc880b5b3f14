"""The job as every node sees it: the same plan, computed alike on each from its own command line.

Nothing about the plan travels between the nodes. Each agent turns its own ``LaunchConfig``
(``--nnodes``, ``--rdzv-endpoint``, ``-n``, ``-s``, COMMAND, ``--env``...) into the same plan with
``node_config`` and ``launcher.planning.plan.make_plan``, and starts the processes placed on its node; node 0
checks at the handshake that the agent's command agrees with its own (``command_fields``), and
then only says which processes to start for which attempt (``attempt_specs``).

Placement (docs/launcher.md, "Launching without ssh"): the nodes are hosts ``node0`` ...
``nodeN-1`` in rank order, so the hostfile's rule holds: the scheduler on node 0, server ``r`` on
node ``r mod N``, worker ``r`` on node ``r mod N``. The scheduler listens at the rendezvous host,
port ``PORT+1`` (or ``--scheduler-port``), and torch's ``MASTER_ADDR:MASTER_PORT`` is the
rendezvous host, port ``PORT+2`` (worker 0 is on node 0): every node knows both without
asking. Each process advertises its own interface toward the scheduler (or ``--interface``'s).
"""

from __future__ import annotations

from dataclasses import replace
from operator import attrgetter

import pscontract as ec

from ...config import LaunchConfig, parse_endpoint
from ...errors import ConfigError
from ...planning.hostfile import Host
from ...planning.plan import Plan, ProcessSpec, joiner_spec

__all__ = ["node_config", "node_label", "node_of", "node_slots", "share", "attempt_specs", "command_fields", "differences",
           "joiner_of"]


def node_label(rank: int) -> str:
    """How output prefixes, tables and errors name node ``rank``: ``node0``, ``node1``..."""
    return f"node{rank}"


def node_of(spec: ProcessSpec) -> int:
    """The rank of the node ``spec`` is placed on."""
    return int(spec.host.name[len("node"):])


def node_config(config: LaunchConfig) -> LaunchConfig:
    """``config`` with the nodes as its hosts and the scheduler's (and torch's) address and ports
    set as every node derives them. Raises ``ConfigError`` when PORT+1 or PORT+2 is past 65535."""
    assert config.agents.nnodes is not None and config.agents.rdzv_endpoint is not None
    host, port = parse_endpoint(config.agents.rdzv_endpoint)
    scheduler_port = config.scheduler_port or port + 1
    master_port = port + 2
    if max(scheduler_port, master_port) > 65535:
        raise ConfigError(f"--rdzv-endpoint {config.agents.rdzv_endpoint}: the scheduler listens at port {port + 1} and "
                          "torch's master at the one after; choose a rendezvous port below 65534")
    nodes = tuple(Host(node_label(rank)) for rank in range(config.agents.nnodes))
    if config.agents.min_nnodes:  # the first nodes form the job; each node has room for its share of MAX
        nodes = tuple(Host(node_label(rank), slots=node_slots(config)) for rank in range(config.agents.min_nnodes))
    return replace(config, hosts=nodes, scheduler_host=node_label(0), launch_address=host,
                   scheduler_port=scheduler_port, master_port=master_port)


def node_slots(config: LaunchConfig) -> int:
    """``--nnodes MIN:MAX``: the workers each node holds, MAX workers over MAX nodes (rounded up)."""
    assert config.agents.nnodes
    return -(-config.num_workers // config.agents.nnodes)


def share(plan: Plan, rank: int) -> tuple[ProcessSpec, ...]:
    """The processes of ``plan`` that node ``rank`` starts, in plan order."""
    return tuple(spec for spec in plan.processes if node_of(spec) == rank)


def attempt_specs(plan: Plan, config: LaunchConfig, generation: int, names: list[str] | None = None
                  ) -> tuple[ProcessSpec, ...]:
    """The processes ``names`` (every one when None) of ``plan`` as started for attempt
    ``generation`` (0: the first; n: the n-th restart, ``PSLAUNCH_RESTART_COUNT``).

    A restart of the whole job also gives it a job id of its own (``<id>.g<n>``): the scheduler
    refuses every process of an earlier attempt, so one that a lost node still runs when the link
    comes back cannot join the new attempt. A worker restarted alone (``--restart-scope worker``)
    keeps the id: it rejoins the job that goes on.

    Raises ``KeyError`` naming a process the plan does not have."""
    by_name = {spec.name: spec for spec in plan.processes}
    chosen = plan.processes if names is None else tuple(by_name[name] for name in names)
    if generation == 0:
        return chosen
    specs = plan.restarted(generation, chosen).processes
    if config.restart_scope != "job":
        return specs
    job_id = f"{plan.job_id}.g{generation}"
    return tuple(replace(spec, env={**spec.env, ec.PSLAUNCH_JOB_ID: job_id}) for spec in specs)


def joiner_of(plan: Plan, config: LaunchConfig, name: object, place: object) -> ProcessSpec:
    """The worker ``name`` (``worker.R@nodeK``) that joins the running elastic job on node K, as node
    0 and that node's agent derive it alike: rank R, the ``place`` = ``[local rank, local size]``
    node 0 chose. Raises ``ValueError`` naming what is wrong (node 0's word is checked too)."""
    role, _, rest = str(name).partition(".")
    rank_text, _, label = rest.partition("@")
    if (role != "worker" or not rank_text.isdigit() or not label.startswith("node") or not label[4:].isdigit()
            or not isinstance(place, list) or len(place) != 2 or not all(type(v) is int and v >= 0 for v in place)
            or not int(rank_text) < config.num_workers or not int(label[4:]) < (config.agents.nnodes or 0)):
        raise ValueError(f"{str(name)[:80]!r} at {str(place)[:40]} is no worker that may join this job")
    host = Host(label, slots=node_slots(config))
    return joiner_spec(config, plan, host, int(rank_text), place[0], max(place[1], place[0] + 1))


#: What every node's command must agree on, by ``LaunchConfig`` field (dotted in a group), with the
#: flag that sets it.
_COMMAND_FIELDS = (("agents.nnodes", "--nnodes"), ("agents.min_nnodes", "--nnodes MIN"), ("num_workers", "-n"),
                   ("min_workers", "-n MIN"), ("num_servers", "-s"), ("command", "COMMAND"),
                   ("user_command_for_all_roles", "--command-for-all-roles"), ("scheduler_port", "--scheduler-port"),
                   ("interface", "--interface"), ("encrypt", "--encrypt"), ("max_restarts", "--max-restarts"),
                   ("restart_scope", "--restart-scope"), ("checkpoint_dir", "--checkpoint-dir"),
                   ("gpus_per_worker", "--gpus-per-worker"), ("link_timeout", "--link-timeout"))


def command_fields(config: LaunchConfig) -> dict[str, object]:
    """The options every node's command must agree on, as JSON values, by flag; ``--env`` by the
    names and scopes it sets (values stay on each node: they may be secrets, or differ by node)."""
    fields: dict[str, object] = {}
    for name, flag in _COMMAND_FIELDS:
        value = attrgetter(name)(config)
        fields[flag] = list(value) if isinstance(value, tuple) else value
    fields["--env"] = sorted(f"{v.scope}:{v.name}" for v in config.env)
    return fields


def differences(mine: dict[str, object], theirs: object, rank: int) -> list[str]:
    """Where the ``command_fields`` of the agent of node ``rank`` (``theirs``, from the wire) differ from
    node 0's (``mine``), as ``FLAG X on node1, Y on node 0`` phrases, which read the same on either
    node; a malformed ``theirs`` is one difference."""
    if not isinstance(theirs, dict):
        return ["its command's options were not sent"]
    out = []
    for flag, value in mine.items():
        if theirs.get(flag) != value:
            out.append(f"{flag} {_shown(theirs.get(flag))} on {node_label(rank)}, {_shown(value)} on node 0")
    return out


def _shown(value: object) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) if value else "(none)"
    return "(not given)" if value is None else str(value)
