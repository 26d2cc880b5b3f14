"""Collectives between the workers of a job: allreduce, broadcast and allgather without servers.

A job with 0 servers (``pslaunch -s 0``) is a scheduler (registration, ranks, heartbeats, barriers,
rendezvous values) and workers that sum their values among themselves. Every worker node has an
``Engine`` (``WorkerNode.collectives``) that shares the node's connection, so membership, liveness
and failure are the runtime's own, and its messages travel on the node's transport.

Parts:

- ``wire``: the ``COLL`` message (a tag, a record, a data frame), every field checked;
- ``base``: ``Op`` (one collective as a state machine), ``Topology``, the algorithms by name and
  ``choose``;
- ``engine.Engine``: tags and versions, the ops in flight, early messages, failure;
- ``direct`` (small values, one hop), ``ring`` (pipelined reduce-scatter and allgather),
  ``local`` (same host through shared memory; hierarchical over several hosts), ``gather``
  (broadcast, allgather): the algorithms;
- ``nccl``: CuPy arrays summed with NCCL, the unique id exchanged through the scheduler.

docs/collectives.md describes the algorithms, the ordering and the failures.
"""

from .base import Op, Topology, algorithm, algorithm_names, choose
from .engine import Engine
from .tags import key_id_of
from .wire import Desc

__all__ = ["Engine", "Op", "Topology", "Desc", "algorithm", "algorithm_names", "choose",
           "key_id_of"]
