"""Per-node agents: ``pslaunch --nnodes N --node-rank R --rdzv-endpoint HOST:PORT``, the same command
on every node of a cluster that starts one command per node and gives it its index (Kubernetes'
Indexed Jobs, cloud VM groups, HPC sites without ssh between nodes).

* ``nodes``: the plan every node derives alike from its own command line, and each node's share;
* ``wire``: the authenticated link between node 0 and an agent (frames, the handshake);
* ``hub``: node 0's side of the rendezvous: it admits the agents and keeps their links;
* ``backend``: node 0's backend, which supervises every node's processes through the agents;
* ``launcher.supervision.agent``: pslaunch as an agent on node R > 0, which runs its node's share as node 0 says.

docs/launcher.md ("Launching without ssh") has the rules; docs/kubernetes.md a manifest.
"""
