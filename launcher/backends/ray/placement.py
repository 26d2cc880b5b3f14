"""The plan moved onto the nodes Ray placed its bundles on.

The plan is first made on a placeholder host (``PENDING_HOST``: ``--dry-run`` shows it), since Ray
decides where each bundle goes only once the placement group is placed. ``place`` then gives each
process the node of its bundle (its Ray node address is its host: output prefixes, tables), and
redoes what follows from hosts: local ranks and sizes per role and node, the scheduler's address and
port, torch's ``MASTER_ADDR`` / ``MASTER_PORT`` (worker 0's node), the address each process
advertises (its node's Ray address, which every node reaches, unless ``--interface``). Processes
start in the working directory Ray unpacked on their node (``runtime_env``'s ``working_dir``), or in
``--sync-dst-dir``. Pure.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import pscontract as ec

from ...config import LaunchConfig
from ...planning.hostfile import Host
from ...planning.plan import Plan

__all__ = ["PENDING_HOST", "place", "assign_bundles"]

#: Where the plan puts processes before Ray has placed the bundles (``--dry-run``).
PENDING_HOST = Host("<ray-node>")


def assign_bundles(roles: Sequence[str], bundles: Sequence[Mapping[str, float]], nodes: Sequence[str]) -> list[int]:
    """Which bundle each process takes (``roles``: each process's role in plan order; ``bundles``:
    what each asked for, ``nodes``: the node Ray placed each on). Bundles that ask the same are
    interchangeable, and Ray's SPREAD spreads bundles, not roles: so servers choose first, each the
    node of a fitting bundle that holds the fewest servers so far (distinct nodes while there are
    enough), then workers the same way, then the scheduler what is left. Ties go to the node with
    the most free bundles, then to the first node. Pure."""
    free: dict[tuple, list[int]] = {}  # a bundle's shape -> its bundles still free, in order
    for index, bundle in enumerate(bundles):
        free.setdefault(tuple(sorted(bundle.items())), []).append(index)
    order = list(dict.fromkeys(nodes))
    chosen: dict[int, int] = {}
    for role in ("server", "worker", "scheduler"):
        held: dict[str, int] = {}  # node -> processes of this role on it so far
        for process, process_role in enumerate(roles):
            if process_role != role:
                continue
            shape = tuple(sorted(bundles[process].items()))
            candidates = free[shape]
            left = {node: sum(1 for b in candidates if nodes[b] == node) for node in order}
            node = min((n for n in order if left[n]), key=lambda n: (held.get(n, 0), -left[n], order.index(n)))
            bundle = next(b for b in candidates if nodes[b] == node)
            candidates.remove(bundle)
            held[node] = held.get(node, 0) + 1
            chosen[process] = bundle
    return [chosen[process] for process in range(len(roles))]


def place(plan: Plan, config: LaunchConfig, nodes: Sequence[str], scheduler_port: int,
          master_port: int | None) -> Plan:
    """``plan`` with process ``i`` on node ``nodes[i]`` (an address), the scheduler listening at
    ``scheduler_port`` on its node and, for a job without servers, torch's process group at
    ``master_port`` on worker 0's node."""
    assert len(nodes) == len(plan.processes)
    hosts = [Host(address) for address in nodes]
    sizes: dict[tuple[str, Host], int] = {}
    for spec, host in zip(plan.processes, hosts):
        sizes[(spec.role, host)] = sizes.get((spec.role, host), 0) + 1
    scheduler = next(host for spec, host in zip(plan.processes, hosts) if spec.role == "scheduler")
    first_worker = next(host for spec, host in zip(plan.processes, hosts) if spec.role == "worker" and spec.rank == 0)
    seen: dict[tuple[str, Host], int] = {}
    placed = []
    for spec, host in zip(plan.processes, hosts):
        local_rank = seen.get((spec.role, host), 0)
        seen[(spec.role, host)] = local_rank + 1
        local_size = sizes[(spec.role, host)]
        env = dict(spec.env)
        env.update({ec.DMLC_PS_ROOT_URI: scheduler.name, ec.DMLC_PS_ROOT_PORT: str(scheduler_port),
                    ec.PSLAUNCH_LOCAL_RANK: str(local_rank), ec.PSLAUNCH_LOCAL_SIZE: str(local_size)})
        if not config.interface:
            env[ec.DMLC_NODE_HOST] = host.name
        if spec.role == "worker":
            env.update({ec.LOCAL_RANK: str(local_rank), ec.LOCAL_WORLD_SIZE: str(local_size)})
            if ec.MASTER_ADDR in env and master_port is not None:
                env.update({ec.MASTER_ADDR: first_worker.name, ec.MASTER_PORT: str(master_port)})
        placed.append(replace(spec, host=host, env=env, local_rank=local_rank, local_size=local_size,
                              cwd=config.sync_dst_dir or None, on_launcher=False))
    return replace(plan, root_uri=scheduler.name, root_port=scheduler_port, processes=tuple(placed))
