"""How bytes travel between nodes: the transport interface and its ZeroMQ and in-process
implementations, the job key's security, and the two fast paths for big values.

- ``base``: the interface (frames between named peers) and the table of transports by name.
- ``zeromq``: the ZeroMQ transport (one ROUTER receives, one DEALER per peer sends).
- ``inproc``: peers inside one process, for tests (``testkit.InProcJob``).
- ``security``: the job key, ZAP authentication and CURVE encryption.
- ``lanes``: plain TCP streams between two workers for big data messages.
- ``same_host``: shared memory between processes of one host for big values.
- ``message_heap``: message memory that stays mapped (no page faults on the data path).

Nothing here knows a role: the scheduler, servers and workers build on it (``psnode.node``).
"""
