"""The ray backend: the job on an existing Ray cluster (``--launcher ray``, ``pip install 'pslaunch[ray]'``).

* ``settings``: the ``--ray-*`` options, parsed and checked; the placement group's bundles (one per
  process of the plan) and, when they cannot be placed, which resources the cluster lacks;
* ``placement``: the plan moved onto the nodes Ray gave the bundles (hosts, local ranks, the
  scheduler's address), a pure function;
* ``launcher.on_node.ray_actor``: what runs on a node, inside Ray: one actor per process, which
  starts it under the remote guard and keeps its output until pslaunch reads it;
* ``upload``: the working directory Ray uploads, sized (and refused past Ray's limit) first;
* ``backend``: pslaunch's side: the connection, the placement group, the actors and the handles.

docs/ray.md has the rules. The registry loads ``backend.RayBackend``; this file imports nothing, so
that ``launcher.backends`` never loads Ray unless the backend is used.
"""
