"""Server (argv: marker [die]): joins the servers' barrier and the barrier of all nodes before serving; checks the marker
that rank 0 of the workers writes before it reaches the barrier of all nodes. With ``die``, server 1
exits right after the servers' barrier."""

import os
import sys

from psnode.env import read_env
from psnode.server.node import ServerNode

marker = sys.argv[1]
node = ServerNode(read_env())
try:
    node.register()
    node.barrier("servers")
    print("PASSED servers", node.rank, flush=True)
    if sys.argv[2:] == ["die"] and node.rank == 1:
        os._exit(3)  # dies without a word: the others learn it from the missing heartbeats
    node.barrier("all", timeout=60)
    assert os.path.exists(marker), f"server {node.rank} passed the barrier of all nodes before worker 0 reached it"
    print("PASSED all", node.rank, flush=True)
    sys.exit(node.run())
finally:
    node.close()
